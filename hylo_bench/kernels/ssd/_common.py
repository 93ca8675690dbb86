"""Shared input checks and helpers of the SSD (Mamba-2) ops: reference loop, torch chunked scan, decode step.

Legend: B batch, T tokens, H heads, G groups of B/C (H % G == 0), P head dim, N state size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate the op shapes; return (B, T, H, P, N, G).

    Raises:
        ValueError: naming the argument, the expected and the received shape.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [B, T, H, P]; got {tuple(x.shape)}")
    Bsz, T, H, P = x.shape
    if dt.shape != (Bsz, T, H):
        raise ValueError(f"dt must be [B, T, H] = {(Bsz, T, H)}; got {tuple(dt.shape)}")
    if A.shape != (H,):
        raise ValueError(f"A must be [H] = [{H}]; got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (Bsz, T) or C.shape != B.shape:
        raise ValueError(f"B and C must both be [B, T, G, N] with B={Bsz}, T={T}; got B {tuple(B.shape)}, "
                         f"C {tuple(C.shape)}")
    G, N = B.shape[2], B.shape[3]
    if H % G:
        raise ValueError(f"heads H={H} must be a multiple of the B/C groups G={G}")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None and t.shape != (H,):
            raise ValueError(f"{name} must be [H] = [{H}] (one per head); got {tuple(t.shape)}")
    if initial_state is not None and initial_state.shape != (Bsz, H, P, N):
        raise ValueError(f"initial_state must be [B, H, P, N] = {(Bsz, H, P, N)}; got {tuple(initial_state.shape)}")
    return Bsz, T, H, P, N, G


def prepare_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dtype: torch.dtype) -> torch.Tensor:
    """dt [..., H] -> softplus(dt + dt_bias) (or dt + dt_bias) in ``dtype``, as mamba_ssm's ``dt_softplus``."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    return F.softplus(dt) if dt_softplus else dt


def repeat_groups(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, T, G, N] -> [B, T, G * n_rep, N]; head h uses group h // n_rep (mamba_ssm / GQA convention)."""
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=2)
