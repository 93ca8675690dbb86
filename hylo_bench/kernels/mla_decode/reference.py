"""Absorbed-weight MLA decode attention over the latent cache, in plain torch: the ground truth for the Triton
kernel and the CPU path of the serving engine.

Legend: B batch, T cache slots (max context), H query heads, G KV groups of ``kv_b_proj`` (n_kvm), R = kv_lora_rank,
P = qk_rope_head_dim. One cache row per token is ``[c_KV (R) ; rope key (P)]`` (checkpoint-format.md §6).
"""

from __future__ import annotations

import torch


def check_decode_inputs(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor,
                        key_scale: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """Validate shapes; returns (B, H, T, R, P).

    Raises:
        ValueError: naming the tensor, the expected and the received shape.
    """
    if q_lat.dim() != 3 or q_rope.dim() != 3 or q_lat.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_lat [B, H, R] and q_rope [B, H, P] must agree on B, H; got {tuple(q_lat.shape)} and "
                         f"{tuple(q_rope.shape)}")
    B, H, R = q_lat.shape
    P = q_rope.shape[-1]
    if cache.dim() != 3 or cache.shape[0] != B or cache.shape[2] != R + P:
        raise ValueError(f"cache must be [B={B}, T, R + P={R + P}]; got {tuple(cache.shape)}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B={B}] (valid cache rows per sequence); got {tuple(lengths.shape)}")
    if key_scale is not None:
        if key_scale.dim() != 3 or key_scale.shape[:2] != cache.shape[:2] or H % key_scale.shape[2]:
            raise ValueError(f"key_scale must be [B, T, G] with G dividing H={H}, B and T as the cache "
                             f"{tuple(cache.shape[:2])}; got {tuple(key_scale.shape)}")
    return B, H, cache.shape[1], R, P


def mla_decode_reference(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor,
                         scale: float, key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Latent attention output of one query token per sequence (checkpoint-format.md §6 steps 2-4).

    ``s[b, h, t] = scale * ks[b, t, g(h)] * (q_lat[b, h] . c[b, t] + q_rope[b, h] . kr[b, t])`` for t < lengths[b]
    (masked otherwise), ``out[b, h] = sum_t softmax_t(s[b, h]) c[b, t]``. ``ks`` = 1 without ``key_scale``; with
    Qwen3 q/k norms it holds the per-token, per-KV-group inverse RMS of the assembled key (see
    :mod:`hylo_bench.decode.mla_layer`). Head h belongs to group g(h) = h // (H / G).

    Args:
        q_lat: [B, H, R] absorbed queries ``W_UK[g(h)]^T q_nope[h]``.
        q_rope: [B, H, P] rotated rope queries.
        cache: [B, T, R + P] latent cache rows (only the first ``lengths[b]`` rows of row b are read).
        lengths: [B] int, valid rows per sequence (>= 1).
        scale: softmax scale 1 / sqrt(d_qk).
        key_scale: [B, T, G] per-token key scale, or None.

    Returns:
        [B, H, R] latent outputs in float32 (float64 for float64 inputs); multiply by ``W_UV`` for the values.

    Raises:
        ValueError: inconsistent shapes (see :func:`check_decode_inputs`).
    """
    B, H, T, R, P = check_decode_inputs(q_lat, q_rope, cache, lengths, key_scale)
    dt = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    c = cache[..., :R].to(dt)
    kr = cache[..., R:].to(dt)
    s_BHT = torch.einsum("bhr,btr->bht", q_lat.to(dt), c) + torch.einsum("bhp,btp->bht", q_rope.to(dt), kr)
    if key_scale is not None:
        G = key_scale.shape[-1]
        s_BHT = s_BHT * key_scale.to(dt).transpose(1, 2).repeat_interleave(H // G, dim=1)
    s_BHT = s_BHT * scale
    valid_BT = torch.arange(T, device=cache.device)[None] < lengths.to(cache.device)[:, None]
    s_BHT = s_BHT.masked_fill(~valid_BT[:, None], float("-inf"))
    return torch.einsum("bht,btr->bhr", torch.softmax(s_BHT, dim=-1), c)
