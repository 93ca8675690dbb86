"""Rotary embedding of the MLA rope dims: DeepSeek/Zebra-Llama convention with YaRN.

Legend: B batch, T tokens, H heads, R = qk_rope_head_dim (d_R).

Convention (checkpoint-format.md §5.2): adjacent pairs (2i, 2i+1) of the rope slice are rotated by
pos * theta_i with theta_i = base^(-2i/R). We keep the interleaved output order (GPT-J style, vLLM
``is_neox_style=False``); only the pairing matters for the logits, and cached keys use the same order as q.

YaRN (checkpoint-format.md §5.3; DeepSeek-V2 ``yarn_find_correction_range``): frequencies blend between the
original and the interpolated (theta / F) ones over a linear ramp between the correction dims of
``beta_fast`` and ``beta_slow``; cos and sin are both multiplied by the attention factor of
:func:`hylo_bench.config.hybrid.yarn_attention_factor` (``0.1 ln F + 1`` for F > 1 in every released config;
transformers' ``attention_factor`` when given). A factor <= 1 has the plain RoPE frequencies. The softmax scale
(``mscale_all_dim``) is :func:`hylo_bench.config.hybrid.mla_softmax_scale`.
"""

from __future__ import annotations

import math

import torch

from hylo_bench.config.hybrid import yarn_attention_factor, yarn_get_mscale  # noqa: F401  (yarn_get_mscale re-exported)


def yarn_correction_range(rope_dim: int, base: float, original_max_pos: int, beta_fast: float = 32,
                          beta_slow: float = 1) -> tuple[int, int]:
    """(low, high) correction dims: dim(r) = R ln(L0 / (2 pi r)) / (2 ln base), floored/ceiled and clamped."""
    def dim(r: float) -> float:
        return rope_dim * math.log(original_max_pos / (r * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim(beta_fast)), 0)
    high = min(math.ceil(dim(beta_slow)), rope_dim - 1)
    return low, high


def rope_inv_freq_and_mscale(rope_dim: int, base: float, rope_scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [R/2] (float64) and the cos/sin multiplier for the given scaling dict.

    Raises:
        ValueError: on an unsupported ``rope_type`` (supported: yarn, default/none; linear), and as
            :func:`hylo_bench.config.hybrid.yarn_attention_factor` (mscale settings the references disagree on).
    """
    idx = torch.arange(0, rope_dim, 2, dtype=torch.float64, device="cpu")  # never on meta
    inv_extra = 1.0 / (base ** (idx / rope_dim))
    if not rope_scaling:
        return inv_extra, 1.0
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "yarn"))
    factor = float(rope_scaling.get("factor", 1.0))
    if kind not in ("default", "none", "linear", "yarn"):
        raise ValueError(f"rope_scaling.rope_type = {kind!r} is not supported for MLA layers; expected 'yarn' "
                         f"(or 'linear'); legacy 'llama3' dicts are converted when hybrid_config.json is read")
    mscale = yarn_attention_factor(rope_scaling)
    if kind in ("default", "none") or factor <= 1.0:
        return inv_extra, mscale
    if kind == "linear":
        return inv_extra / factor, 1.0
    original = int(rope_scaling.get("original_max_position_embeddings", 4096))
    low, high = yarn_correction_range(rope_dim, base, original, rope_scaling.get("beta_fast", 32),
                                      rope_scaling.get("beta_slow", 1))
    if low == high:
        high += 0.001  # DeepSeek: avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    inv_inter = inv_extra / factor
    # ramp = 0 below `low`: keep the original frequency; ramp = 1 above `high`: fully interpolated.
    inv_freq = inv_inter * ramp + inv_extra * (1 - ramp)
    return inv_freq, mscale


class MLARotary:
    """Cos/sin provider for the MLA rope dims (no parameters, nothing saved in checkpoints).

    Args:
        rope_dim: R (even). base: ``rope_theta``. rope_scaling: YaRN dict or None.
    """

    def __init__(self, rope_dim: int, base: float, rope_scaling: dict | None):
        self.rope_dim = rope_dim
        inv_freq, self.mscale = rope_inv_freq_and_mscale(rope_dim, base, rope_scaling)
        self.inv_freq = inv_freq.float()

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, T, R/2] for integer positions [B, T], multiplied by mscale, in ``dtype``."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.mscale).to(dtype), (freqs.sin() * self.mscale).to(dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of ``x`` [..., P] by cos / sin [..., P/2] (broadcast against x's leading
    dims): ``(x0, x1) -> (x0 c - x1 s, x0 s + x1 c)`` (checkpoint-format.md §5.2), in float32 (float64 for float64
    x); x's dtype out. The one RoPE of the package: the model's MLA layers and the decode engine's use it."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    x2 = x.to(dt).unflatten(-1, (-1, 2))
    x0, x1 = x2[..., 0], x2[..., 1]
    c, s = cos.to(dt), sin.to(dt)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rope_interleaved` for x [B, H, T, R] and cos / sin [B, T, R/2] (shared by the heads)."""
    return rope_interleaved(x, cos[:, None], sin[:, None])
