"""Pure-torch chunked SSD scan (prefill / training, any device, autograd) and the one-token decode step.

Legend: B batch, T tokens, L chunk length, H heads, G groups of B/C, P head dim, N state size.
State layout: [B, H, P, N], float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from hylo_bench.kernels.precision import compute_dtype
from hylo_bench.kernels.ssd._common import check_inputs, prepare_dt, repeat_groups
from hylo_bench.kernels.varlen import (
    final_states,
    gather_padded,
    packed_layout,
    reset_states,
    scatter_back,
)

DEFAULT_CHUNK_SIZE = 256  # Zebra-Llama's mamba_chunk_scan_combined chunk (checkpoint-format.md sec. 4.5)


def ssd_scan_chunked(
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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD: quadratic (masked-decay attention) form inside each chunk, recurrence across chunks.

    Same contract as :func:`hylo_bench.kernels.ssd.reference.ssd_scan_reference`; equal to it up to rounding.
    Within a chunk with cumulative log decay c_t = sum_{k<=t} dt_k A:
    ``y_t = sum_{s<=t} exp(c_t - c_s) (C_t . B_s) dt_s x_s + exp(c_t) S_prev C_t + D x_t`` and
    ``S_next = exp(c_L) S_prev + sum_s exp(c_L - c_s) dt_s x_s B_s^T``.

    Args:
        x: [B, T, H, P]. dt: [B, T, H] raw. A: [H] (< 0). B, C: [B, T, G, N]. D, dt_bias: [H] or None.
        dt_softplus: apply softplus to dt + dt_bias.
        initial_state: [B, H, P, N] or None (zeros).
        chunk_size: L, tokens per chunk (>= 1); memory per chunk is B * L * L * H elements.
        cu_seqlens: [n_docs + 1] offsets of packed documents (B must be 1): the state restarts at each document
            (chunks are laid out per document, ``hylo_bench.kernels.varlen``); ``initial_state`` and the final
            state are then [n_docs, H, P, N].

    Returns:
        (y [B, T, H, P] in x's dtype, final state [B, H, P, N] ([n_docs, H, P, N] with cu_seqlens),
        float32 / float64).

    Raises:
        ValueError: on inconsistent shapes, chunk_size < 1, or bad ``cu_seqlens`` / B != 1 with it.

    Reference:
        arXiv 2405.21060 sec. 6 (SSD block decomposition); kernels.md sec. 9.
    """
    Bsz, T, H, P, N, G = check_inputs(x, dt, A, B, C, D, dt_bias, None if cu_seqlens is not None else initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    cdt = compute_dtype(x.dtype)
    dt_BTH = prepare_dt(dt, dt_bias, dt_softplus, cdt)
    x_c = x.to(cdt)
    B_c, C_c = repeat_groups(B.to(cdt), H // G), repeat_groups(C.to(cdt), H // G)
    layout = None
    if cu_seqlens is not None:
        chunk_size, layout = packed_layout(cu_seqlens, Bsz, T, chunk_size, initial_state, (H, P, N), "H, P, N",
                                           device=x.device)
        # padding slots: dt = 0 (no decay, no input), x = B = C = 0
        # the lanes are the batch from here on: [L, N * C, ...]
        dt_BTH, x_c, B_c, C_c = (gather_padded(t[0], layout) for t in (dt_BTH, x_c, B_c, C_c))
        Bsz, T = dt_BTH.shape[:2]

    a_BTH = dt_BTH * A.to(cdt)
    if layout is None and initial_state is not None:
        S = initial_state.to(cdt)
    else:
        S = x.new_zeros(Bsz, H, P, N, dtype=cdt)
    ys, finals = [], []
    for n, s0 in enumerate(range(0, T, chunk_size)):
        if layout is not None:
            S = reset_states(S, layout, n, initial_state)
        s1 = min(s0 + chunk_size, T)
        cum_BLH = torch.cumsum(a_BTH[:, s0:s1], dim=1)
        L = s1 - s0
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        diff_BLLH = cum_BLH[:, :, None, :] - cum_BLH[:, None, :, :]  # [b, t, s, h] = c_t - c_s
        decay_BLLH = torch.exp(diff_BLLH.masked_fill(~causal[None, :, :, None], float("-inf")))
        xdt_BLHP = x_c[:, s0:s1] * dt_BTH[:, s0:s1, :, None]
        scores_BLLH = torch.einsum("bthn,bshn->btsh", C_c[:, s0:s1], B_c[:, s0:s1]) * decay_BLLH
        y_BLHP = torch.einsum("btsh,bshp->bthp", scores_BLLH, xdt_BLHP)
        y_BLHP = y_BLHP + torch.exp(cum_BLH)[..., None] * torch.einsum("bthn,bhpn->bthp", C_c[:, s0:s1], S)
        last_BH = cum_BLH[:, -1]
        w_BLH = torch.exp(last_BH[:, None] - cum_BLH)
        S = torch.exp(last_BH)[..., None, None] * S + torch.einsum(
            "bsh,bshp,bshn->bhpn", w_BLH, xdt_BLHP, B_c[:, s0:s1]
        )
        ys.append(y_BLHP)
        if layout is not None and n in layout.ends:
            lanes, docs = layout.ends[n]
            finals.append((docs, S[lanes]))
    y_BTHP = torch.cat(ys, dim=1) if ys else x_c.new_zeros(Bsz, 0, H, P)
    if D is not None:
        y_BTHP = y_BTHP + D.to(cdt)[:, None] * x_c
    if layout is not None:
        y_BTHP, S = scatter_back(y_BTHP, layout)[None], final_states(finals, cu_seqlens.shape[0] - 1)
    return y_BTHP.to(x.dtype), S


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor | None,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token of the SSD recurrence (mamba_ssm ``selective_state_update`` semantics).

    Args:
        x: [B, H, P]. dt: [B, H] raw. A: [H]. B, C: [B, G, N]. state: [B, H, P, N] or None (zeros).
        D, dt_bias: [H] or None. dt_softplus: apply softplus to dt + dt_bias.

    Returns:
        (y [B, H, P] in x's dtype, new state [B, H, P, N] float32 / float64; the input state is not modified).

    Raises:
        ValueError: on inconsistent shapes.
    """
    Bsz, H, P = x.shape
    check_inputs(x[:, None], dt[:, None], A, B[:, None], C[:, None], D, dt_bias, state)
    cdt = compute_dtype(x.dtype)
    G = B.shape[1]
    dt_BH = prepare_dt(dt, dt_bias, dt_softplus, cdt)
    x_c = x.to(cdt)
    B_c = B.to(cdt).repeat_interleave(H // G, dim=1)
    C_c = C.to(cdt).repeat_interleave(H // G, dim=1)
    S = x.new_zeros(Bsz, H, P, B.shape[-1], dtype=cdt) if state is None else state.to(cdt)
    S = torch.exp(dt_BH * A.to(cdt))[..., None, None] * S + (dt_BH[..., None] * x_c)[..., None] * B_c[:, :, None, :]
    y = (S * C_c[:, :, None, :]).sum(-1)
    if D is not None:
        y = y + D.to(cdt)[:, None] * x_c
    return y.to(x.dtype), S
