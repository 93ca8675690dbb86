"""Stage 0 of upcycling: the hybrid config for a base model, and the student initialised from its weights.

MLA layers get the SVD init of the base q/k/v/o (checkpoint-format.md §7.1), GDN layers the GQA-expand +
truncate init (§7.4), Mamba-2 layers the MambaInLlama mapping V->x, K->B, Q->C, O->out_proj (§7.3); MLP,
norms and embeddings are copied verbatim; ``lm_head`` is an independent copy of the
base head (for tied bases: of the embedding, §4.3 (a)).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hylo_bench.config.hylo_config import HyLoConfig
from hylo_bench.config.student import base_dims
from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.upcycle.init import gdn_init_from_attention, mamba2_init_from_attention, svd_init_mla

logger = logging.getLogger(__name__)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


@torch.no_grad()
def init_student(base_model: nn.Module, config: HyLoConfig, mixers: str = "attention") -> HyLoForCausalLM:
    """Build the hybrid student from an HF Llama / Qwen3 causal LM (paper §3.1; checkpoint-format.md §7).

    Args:
        base_model: the student base model (``LlamaForCausalLM`` / ``Qwen3ForCausalLM``), any dtype/device.
        config: from :func:`hylo_bench.config.student.hybrid_config_for`.
        mixers: ``"attention"`` initialises MLA / GDN / Mamba-2 from the attention weights; ``"random"`` keeps
            their fresh random init (embeddings, MLPs, norms and head are copied either way), the baseline that
            shows what the attention-derived init is worth.

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
        if mixers == "attention":
            init_mixer_from_attention(sl, bl.self_attn, config, d, layer_idx=i)
        elif mixers != "random":
            raise ValueError(f"mixers {mixers!r}: expected 'attention' or 'random'")
    return student


@torch.no_grad()
def init_mixer_from_attention(layer: nn.Module, att: nn.Module, config: HyLoConfig, dims: dict, *,
                              layer_idx: int) -> None:
    """Load ``layer.mixer`` (MLA, GDN or Mamba-2, by ``layer.mixer_type``) in place from a base attention module.

    Args:
        layer: a ``HyLoDecoderLayer`` whose mixer holds its fresh default init (the random parts are kept).
        att: the base layer's ``self_attn`` (``q_proj``/``k_proj``/``v_proj``/``o_proj``; Qwen3 ``q_norm``/``k_norm``).
        config: the hybrid config the layer was built from. dims: :func:`base_dims` of the base config.
        layer_idx: for error messages.

    Raises:
        ValueError: shapes that do not match the head settings (from the init functions).
    """
    d = dims
    q_w, k_w, v_w, o_w = (getattr(att, n).weight.float() for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if layer.mixer_type == "mla":
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
    elif layer.mixer_type == "mamba":
        dims_m = config.mamba_dims()
        new = mamba2_init_from_attention(q_w, k_w, v_w, o_w, layer.mixer.state_dict(), d_inner=dims_m["d_inner"],
                                         d_xb=dims_m["d_xb"])
    else:
        new = gdn_init_from_attention(q_w, k_w, v_w, o_w, layer.mixer.state_dict(), num_heads=d["num_heads"],
                                      num_kv_heads=d["num_kv_heads"], head_dim=d["head_dim"])
    missing, unexpected = layer.mixer.load_state_dict({k: v.float() for k, v in new.items()}, strict=False)
    assert not unexpected, f"layer {layer_idx}: init produced unknown keys {unexpected}"
    assert all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing), missing


def _check_norm_width(w: torch.Tensor, width: int) -> torch.Tensor:
    """Qwen3 q/k norm weights are [d_h]; MLA norms act on d_qk = d_N + d_R, which must equal d_h."""
    if w.numel() == width:
        return w
    raise ValueError(f"q/k norm width {w.numel()} != qk_nope_head_dim + qk_rope_head_dim = {width}; "
                     f"choose MLA head dims that add up to the base head_dim")
