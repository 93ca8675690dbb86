"""Naive step-by-step Mamba-2 SSD recurrence: the ground truth for the chunked scan and the decode step.

Legend: B batch, T tokens, H heads, G groups of B/C (H % G == 0), P head dim, N state size.
State layout everywhere in hylo-bench: [B, H, P, N] (mamba_ssm's ``ssm_state`` layout).
"""

from __future__ import annotations

import torch

from hylo_bench.kernels.precision import compute_dtype
from hylo_bench.kernels.ssd._common import check_inputs, prepare_dt, repeat_groups


def ssd_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token SSD recurrence in float32 (float64 for float64 inputs). Slow: keep T small.

    With ``cu_seqlens`` (packed documents, B = 1) every document runs on its own from its initial state
    (``initial_state`` [n_docs, H, P, N] or zeros); the final states are stacked per document.

    Per head h and token t, with dt_t = softplus(dt_raw + dt_bias) if ``dt_softplus`` else dt_raw + dt_bias:
    ``S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T`` (S [P, N]); ``y_t = S_t C_t + D_h * x_t``.

    Args:
        x: [B, T, H, P] inputs (already repeated from KV groups to heads).
        dt: [B, T, H] raw step sizes (before bias and softplus).
        A: [H] negative decay rates (A = -exp(A_log)).
        B, C: [B, T, G, N] input / output projections; group g serves heads g*H/G ... (g+1)*H/G - 1.
        D: [H] skip weights, or None (no skip).
        dt_bias: [H] added to dt before the softplus, or None.
        dt_softplus: apply softplus to dt + dt_bias.
        initial_state: [B, H, P, N] or None (zeros).

    Returns:
        (y [B, T, H, P] in x's dtype, final state [B, H, P, N] in float32 / float64).

    Raises:
        ValueError: on inconsistent shapes (see ``check_inputs``).

    Reference:
        arXiv 2405.21060 (Mamba-2, SSD) eq. 1-2; checkpoint-format.md sec. 4.5 step 4.
    """
    if cu_seqlens is not None:
        from hylo_bench.kernels.varlen import check_cu_seqlens

        cu = check_cu_seqlens(cu_seqlens, x.shape[1])
        if x.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch size 1; got {x.shape[0]}")
        ys, finals = [], []
        for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
            y_i, f_i = ssd_scan_reference(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], D=D, dt_bias=dt_bias,
                                          dt_softplus=dt_softplus,
                                          initial_state=None if initial_state is None else initial_state[i:i + 1])
            ys.append(y_i)
            finals.append(f_i)
        return torch.cat(ys, dim=1), torch.cat(finals)
    Bsz, T, H, P, N, G = check_inputs(x, dt, A, B, C, D, dt_bias, initial_state)
    cdt = compute_dtype(x.dtype)
    dt_BTH = prepare_dt(dt, dt_bias, dt_softplus, cdt)
    x_c, A_c = x.to(cdt), A.to(cdt)
    B_c, C_c = repeat_groups(B.to(cdt), H // G), repeat_groups(C.to(cdt), H // G)
    S = x.new_zeros(Bsz, H, P, N, dtype=cdt) if initial_state is None else initial_state.to(cdt).clone()
    ys = []
    for t in range(T):
        decay_BH = torch.exp(dt_BTH[:, t] * A_c)
        S = decay_BH[..., None, None] * S + (dt_BTH[:, t, :, None] * x_c[:, t])[..., None] * B_c[:, t, :, None, :]
        y = (S * C_c[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + D.to(cdt)[:, None] * x_c[:, t]
        ys.append(y)
    y_BTHP = torch.stack(ys, dim=1) if ys else x_c.new_zeros(Bsz, 0, H, P)
    return y_BTHP.to(x.dtype), S
