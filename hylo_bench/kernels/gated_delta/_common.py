"""Shared input checks and small helpers of the gated delta rule ops (reference, torch chunked, step).

Legend: B batch, T tokens, H q/k heads, HV value heads (HV % H == 0; HV > H is fla's GVA), K q/k head dim,
V value head dim. Recurrent state layout everywhere in hylo-bench: [B, HV, K, V] (K-first, fla's default).
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6  # fla.modules.l2norm.l2norm_fwd default (fla 0.6.0)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """L2-normalise the last axis as fla does: ``x * rsqrt(sum(x**2) + eps)``.

    Args:
        x: [..., K] any float dtype; the result has the same dtype.
        eps: added to the squared norm (not to the norm).
    """
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int, int]:
    """Validate the op shapes and return (B, T, H, HV, K, V, group) with group = HV // H.

    Raises:
        ValueError: on any shape mismatch, naming the argument, the expected and the received shape.
    """
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K]; got q {tuple(q.shape)} and k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}; got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} must be a multiple of q/k heads H={H} (fla GVA rule)")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, HV):
            raise ValueError(f"{name} must be [B, T, HV] = {(B, T, HV)}; got {tuple(t.shape)}")
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        raise ValueError(
            f"initial_state must be [B, HV, K, V] = {(B, HV, K, V)} (K-first; transpose the last two axes of "
            f"an fla layer cache, which is V-first); got {tuple(initial_state.shape)}"
        )
    return B, T, H, HV, K, V, HV // H


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, group: int, dtype: torch.dtype, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast q, k [B, T, H, K] to ``dtype``, optionally l2-normalise them, and repeat heads to HV = H * group.

    Head h of the output uses input head h // group, as fla's GVA kernels do.
    """
    q, k = q.to(dtype), k.to(dtype)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    return q, k
