"""Stage 0 of upcycling: the hybrid config for a base model, and the student initialised from its weights.

MLA layers get the SVD init of the base q/k/v/o (checkpoint-format.md §7.1), GDN layers the GQA-expand +
truncate init (§7.4), Mamba-2 layers the MambaInLlama mapping V->x, K->B, Q->C, O->out_proj (§7.3); MLP,
norms and embeddings are copied verbatim; ``lm_head`` is an independent copy of the
base head (for tied bases: of the embedding, §4.3 (a)).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from hylo_bench.models.config import HyLoConfig
from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.upcycle.init import gdn_init_from_attention, mamba2_init_from_attention, svd_init_mla

logger = logging.getLogger(__name__)

# Released MLA / GDN dimensions per backbone shape (checkpoint-format.md §3.3), keyed by
# (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim).
RELEASED_DIMS: dict[tuple[int, int, int, int, int], dict] = {
    (2048, 16, 32, 8, 64): dict(q_lora_rank=1344, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32,
                                v_head_dim=64, gdn_num_heads=6, gdn_head_dim=256),   # Llama-3.2-1B
    (3072, 28, 24, 8, 128): dict(q_lora_rank=1536, kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                 v_head_dim=128, gdn_num_heads=9, gdn_head_dim=256),  # Llama-3.2-3B
    (2048, 28, 16, 8, 128): dict(q_lora_rank=1344, kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64,
                                 v_head_dim=128, gdn_num_heads=6, gdn_head_dim=256),  # Qwen3-1.7B
}


def _round8(x: float) -> int:
    return max(8, int(math.ceil(x / 8)) * 8)


def base_dims(base_config) -> dict:
    """Attention dims of an HF Llama / Qwen3 config: hidden, layers, heads, kv heads, head_dim."""
    n_heads = base_config.num_attention_heads
    head_dim = getattr(base_config, "head_dim", None) or base_config.hidden_size // n_heads
    return dict(hidden_size=base_config.hidden_size, n_layer=base_config.num_hidden_layers, num_heads=n_heads,
                num_kv_heads=getattr(base_config, "num_key_value_heads", None) or n_heads, head_dim=head_dim)


def default_mixer_dims(base_config) -> dict:
    """MLA and GDN dims for a base model: the released values for the released backbones, otherwise
    d_N = d_R = d_h/2, d_V = d_h, r_kv = max(n_kv d_h / 4, 64), r_q ~ 0.65 n_h d_h (multiples of 8), and GDN
    heads of 256 key dims (d_h below hidden 1024) with key dim = 0.75 H (paper App. A.3)."""
    b = base_dims(base_config)
    key = (b["hidden_size"], b["n_layer"], b["num_heads"], b["num_kv_heads"], b["head_dim"])
    if key in RELEASED_DIMS:
        return dict(RELEASED_DIMS[key])
    d_h, H = b["head_dim"], b["hidden_size"]
    kv_full = 2 * b["num_kv_heads"] * d_h
    gdn_head = 256 if H >= 1024 else d_h
    return dict(q_lora_rank=min(_round8(0.65 * b["num_heads"] * d_h), (H // 8) * 8),
                kv_lora_rank=min(max(_round8(b["num_kv_heads"] * d_h / 4), 64), kv_full, (H // 8) * 8),
                qk_rope_head_dim=d_h // 2, qk_nope_head_dim=d_h - d_h // 2, v_head_dim=d_h,
                gdn_num_heads=max(1, round(0.75 * H / gdn_head)), gdn_head_dim=gdn_head)


def hybrid_config_for(base_config, mla_layers: list[int], linear_type: str = "gdn", **overrides) -> HyLoConfig:
    """``HyLoConfig`` for upcycling ``base_config`` (an HF ``PretrainedConfig``) with the given MLA layers.

    Raises:
        ValueError: for an unsupported base (needs Llama/Qwen3-style attention) or bad overrides.
    """
    model_type = getattr(base_config, "model_type", "")
    if model_type not in ("llama", "qwen3", "qwen2", "mistral"):
        raise ValueError(f"base model_type {model_type!r} is not supported; expected a Llama or Qwen3 checkpoint")
    b = base_dims(base_config)
    dims = default_mixer_dims(base_config)
    dims.update({k: v for k, v in overrides.items() if v is not None})
    rope_theta = getattr(base_config, "rope_theta", None)
    if rope_theta is None:
        rope_theta = (getattr(base_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    base_dict = base_config.to_dict()
    if linear_type == "mamba":  # Zebra-Llama's convention (checkpoint-format.md §3.1): heads and state from attention
        dims.setdefault("ssm_cfg", {"expand": 1, "ngroups": b["num_heads"], "d_state": b["head_dim"],
                                    "repeat_kv_before_conv": False})
        dims.setdefault("d_inner", b["num_heads"] * b["head_dim"])
        dims.setdefault("d_xb", b["num_kv_heads"] * b["head_dim"])
    return HyLoConfig(
        vocab_size=base_config.vocab_size, hidden_size=b["hidden_size"],
        intermediate_size=base_config.intermediate_size, hidden_act=getattr(base_config, "hidden_act", "silu"),
        n_layer=b["n_layer"], mla_layers=mla_layers, rms_norm_eps=base_config.rms_norm_eps,
        num_attention_heads=b["num_heads"], num_key_value_heads=b["num_kv_heads"],
        max_position_embeddings=getattr(base_config, "max_position_embeddings", 4096), rope_theta=rope_theta,
        linear_type=linear_type, use_qk_norm=model_type == "qwen3", base_model_type=model_type,
        base_num_key_value_heads=b["num_kv_heads"], base_head_dim=b["head_dim"], base_config=base_dict,
        bos_token_id=base_config.bos_token_id, eos_token_id=base_config.eos_token_id,
        pad_token_id=getattr(base_config, "pad_token_id", None), **dims)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


@torch.no_grad()
def init_student(base_model: nn.Module, config: HyLoConfig) -> HyLoForCausalLM:
    """Build the hybrid student from an HF Llama / Qwen3 causal LM (paper §3.1; checkpoint-format.md §7).

    Args:
        base_model: the student base model (``LlamaForCausalLM`` / ``Qwen3ForCausalLM``), any dtype/device.
        config: from :func:`hybrid_config_for`.

    Returns:
        ``HyLoForCausalLM`` in fp32 on the base model's device.
    """
    device = next(base_model.parameters()).device
    student = HyLoForCausalLM(config).to(device=device, dtype=torch.float32)
    b, s = base_model.model, student.model
    _copy(s.embed_tokens.weight, b.embed_tokens.weight)
    _copy(s.norm.weight, b.norm.weight)
    _copy(student.lm_head.weight, base_model.lm_head.weight)  # tied bases: this is the embedding (copied)
    d = base_dims(base_model.config)
    for i, (bl, sl) in enumerate(zip(b.layers, s.layers)):
        _copy(sl.input_layernorm.weight, bl.input_layernorm.weight)
        _copy(sl.post_attention_layernorm.weight, bl.post_attention_layernorm.weight)
        sl.mlp.load_state_dict({k: v.float() for k, v in bl.mlp.state_dict().items()})
        att = bl.self_attn
        q_w, k_w, v_w, o_w = (getattr(att, n).weight.float() for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        if sl.mixer_type == "mla":
            new = svd_init_mla(
                q_w, k_w, v_w, o_w, num_heads=d["num_heads"], num_kv_heads=d["num_kv_heads"],
                head_dim=d["head_dim"], q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                v_head_dim=config.v_head_dim, num_mla_kv_heads=config.num_key_value_heads,
                q_norm_w=getattr(getattr(att, "q_norm", None), "weight", None),
                k_norm_w=getattr(getattr(att, "k_norm", None), "weight", None))
            if config.use_qk_norm and "q_norm.weight" in new:
                new["q_norm.weight"] = _check_norm_width(new["q_norm.weight"], config.qk_head_dim)
                new["k_norm.weight"] = _check_norm_width(new["k_norm.weight"], config.qk_head_dim)
        elif sl.mixer_type == "mamba":
            dims = config.mamba_dims()
            new = mamba2_init_from_attention(q_w, k_w, v_w, o_w, sl.mixer.state_dict(), d_inner=dims["d_inner"],
                                             d_xb=dims["d_xb"])
        else:
            new = gdn_init_from_attention(q_w, k_w, v_w, o_w, sl.mixer.state_dict(), num_heads=d["num_heads"],
                                          num_kv_heads=d["num_kv_heads"], head_dim=d["head_dim"])
        missing, unexpected = sl.mixer.load_state_dict({k: v.float() for k, v in new.items()}, strict=False)
        assert not unexpected, f"layer {i}: init produced unknown keys {unexpected}"
        assert all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing), missing
    return student


def _check_norm_width(w: torch.Tensor, width: int) -> torch.Tensor:
    """Qwen3 q/k norm weights are [d_h]; MLA norms act on d_qk = d_N + d_R, which must equal d_h."""
    if w.numel() == width:
        return w
    raise ValueError(f"q/k norm width {w.numel()} != qk_nope_head_dim + qk_rope_head_dim = {width}; "
                     f"choose MLA head dims that add up to the base head_dim")
