"""The hybrid config for a base model: released and default mixer dimensions, :func:`hybrid_config_for` (pure
Python: no torch or modeling imports, so ``hylo-bench info`` on a recipe stays fast).
"""

from __future__ import annotations

import math

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


def hybrid_config_for(base_config, mla_layers: list[int], linear_type: str = "gdn", *, config_cls=None,
                      **overrides):
    """``HyLoConfig`` for upcycling ``base_config`` (an HF ``PretrainedConfig``) with the given MLA layers.

    ``config_cls``: the class to build (default ``HyLoConfig``; ``HybridSpec`` keeps transformers unimported).

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
    if config_cls is None:
        from hylo_bench.config.hylo_config import HyLoConfig as config_cls
    return config_cls(
        vocab_size=base_config.vocab_size, hidden_size=b["hidden_size"],
        intermediate_size=base_config.intermediate_size, hidden_act=getattr(base_config, "hidden_act", "silu"),
        n_layer=b["n_layer"], mla_layers=mla_layers, rms_norm_eps=base_config.rms_norm_eps,
        num_attention_heads=b["num_heads"], num_key_value_heads=b["num_kv_heads"],
        max_position_embeddings=getattr(base_config, "max_position_embeddings", 4096), rope_theta=rope_theta,
        linear_type=linear_type, use_qk_norm=model_type == "qwen3", base_model_type=model_type,
        base_num_key_value_heads=b["num_kv_heads"], base_head_dim=b["head_dim"], base_config=base_dict,
        bos_token_id=base_config.bos_token_id, eos_token_id=base_config.eos_token_id,
        pad_token_id=getattr(base_config, "pad_token_id", None), **dims)
