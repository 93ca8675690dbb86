"""Pure-PyTorch gated delta rule: chunked (WY form + triangular solve) for prefill/training, one-token step for
decode. Both run on any device, support autograd, and compute in float32 (float64 for float64 inputs).

Legend: B batch, T tokens, N chunks, C chunk size, H q/k heads, HV value heads, K q/k head dim, V value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylo_bench.kernels.gated_delta._common import check_inputs, prepare_qk
from hylo_bench.kernels.gated_delta.reference import recurrent_update
from hylo_bench.kernels.precision import compute_dtype
from hylo_bench.kernels.varlen import (
    final_states,
    gather_padded,
    packed_layout,
    reset_states,
    scatter_back,
)


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule in pure torch (same result as the per-token recurrence up to rounding).

    Within a chunk, with G_t the cumulative log decay from the chunk start and S0 the state entering it,
    the corrected values are U = (I + A)^-1 (beta V) - (I + A)^-1 (beta exp(G) K) S0 where
    A[t, j] = beta_t exp(G_t - G_j) k_t.k_j for j < t (unit lower-triangular solve). Outputs and the
    chunk's final state then follow from S0 and U with matmuls; only the state pass loops over chunks.
    Every exponent is <= 0, so nothing overflows for any g <= 0. T need not be a multiple of
    ``chunk_size``: the tail is padded with g = beta = 0, k = v = 0 tokens, which leave the state unchanged.

    Args:
        q, k: [B, T, H, K].
        v: [B, T, HV, V]; HV % H == 0 (fla's GVA).
        g: [B, T, HV] log-space decay, g <= 0.
        beta: [B, T, HV] post-sigmoid write strength.
        scale: output scale; default K ** -0.5.
        initial_state: [B, HV, K, V] (K-first), any float dtype; zeros when None.
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: l2-normalise q and k first (eps 1e-6, as fla's in-kernel flag).
        chunk_size: tokens per chunk (any positive int; fla uses 64).
        cu_seqlens: [n_docs + 1] document offsets of packed sequences (fla's varlen convention, B must be 1):
            the state restarts at every document (``hylo_bench.kernels.varlen``); ``initial_state`` is then
            [n_docs, HV, K, V] and the final state one per document.

    Returns:
        o [B, T, HV, V] in q's dtype, and the final state [B, HV, K, V] ([n_docs, HV, K, V] with
        ``cu_seqlens``) in float32 (float64 for float64 inputs) or None.

    Raises:
        ValueError: on inconsistent shapes, chunk_size < 1, or bad ``cu_seqlens`` / B != 1 with it.

    Reference:
        arXiv 2412.06464 sec. 3.3 (chunkwise WY form); fla 0.6.0 ``fla/ops/gated_delta_rule/chunk.py``.
    """
    B, T, _H, HV, K, V, group = check_inputs(q, k, v, g, beta, None if cu_seqlens is not None else initial_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    dt = compute_dtype(q.dtype)
    scale = K**-0.5 if scale is None else scale
    q_, k_ = prepare_qk(q, k, group, dt, use_qk_l2norm_in_kernel)

    C = chunk_size
    layout = None
    if cu_seqlens is not None:
        C, layout = packed_layout(cu_seqlens, B, T, C, initial_state, (HV, K, V), "HV, K, V", device=q.device)
        N, B = layout.num_chunks, layout.num_lanes  # the lanes are the batch from here on
    else:
        N = max(1, -(-T // C))
    pad = 0 if layout is not None else N * C - T

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, HV, ...] -> [B, HV, N, C, ...], zero-padded at the end of the sequence (of each document)
        x = x.to(dt)
        if layout is not None:
            x = gather_padded(x[0], layout)  # [L, N * C, HV, ...]
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(B, HV, N, C, *x.shape[3:])

    q_c, k_c, v_c = to_chunks(q_), to_chunks(k_), to_chunks(v)  # [B, HV, N, C, K|V]
    g_c, b_c = to_chunks(g), to_chunks(beta)  # [B, HV, N, C]

    G = g_c.cumsum(dim=-1)  # [B, HV, N, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    diff = G[..., :, None] - G[..., None, :]  # [B, HV, N, C, C], G_t - G_j
    # masking before exp keeps the upper triangle (positive exponents) out of both passes
    decay_causal = diff.masked_fill(~causal, float("-inf")).exp()
    decay_strict = diff.masked_fill(~strict, float("-inf")).exp()

    kk = k_c @ k_c.transpose(-1, -2)  # [B, HV, N, C, C]
    A = b_c[..., :, None] * decay_strict * kk
    eye = torch.eye(C, dtype=dt, device=q.device)
    lhs = eye + A
    rhs = torch.cat([b_c[..., None] * v_c, (b_c * G.exp())[..., None] * k_c], dim=-1)  # [B, HV, N, C, V+K]
    sol = torch.linalg.solve_triangular(lhs, rhs, upper=False, unitriangular=True)
    u_c, w_c = sol[..., :V], sol[..., V:]  # U = u_c - w_c @ S0

    qk = scale * (q_c @ k_c.transpose(-1, -2)) * decay_causal  # [B, HV, N, C, C]
    q_decayed = scale * q_c * G.exp()[..., None]  # [B, HV, N, C, K]
    G_last = G[..., -1]  # [B, HV, N]
    k_to_end = k_c * (G_last[..., None] - G).exp()[..., None]  # [B, HV, N, C, K]

    if layout is None:
        state = q_c.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(dt)
    else:
        state = q_c.new_zeros(B, HV, K, V)
    outs, finals = [], []
    for n in range(N):
        if layout is not None:
            state = reset_states(state, layout, n, initial_state)
        u = u_c[:, :, n] - w_c[:, :, n] @ state  # [B, HV, C, V]
        outs.append(q_decayed[:, :, n] @ state + qk[:, :, n] @ u)
        state = G_last[:, :, n].exp()[..., None, None] * state + k_to_end[:, :, n].transpose(-1, -2) @ u
        if layout is not None and output_final_state and n in layout.ends:
            lanes, docs = layout.ends[n]
            finals.append((docs, state[lanes]))
    o = torch.stack(outs, dim=2).reshape(B, HV, N * C, V).transpose(1, 2)  # [B, N * C, HV, V]
    if layout is not None:
        o = scatter_back(o, layout)[None]
        state = final_states(finals, cu_seqlens.shape[0] - 1) if output_final_state else None
    else:
        o = o[:, :T]
    return o.to(q.dtype), (state if output_final_state else None)


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token of the gated delta rule (recurrent form, pure torch, autograd-safe).

    Args:
        q, k: [B, 1, H, K].
        v: [B, 1, HV, V].
        g: [B, 1, HV] log-space decay.
        beta: [B, 1, HV] post-sigmoid write strength.
        state: [B, HV, K, V] K-first state before the token, any float dtype; zeros when None.
        scale: output scale; default K ** -0.5.
        use_qk_l2norm_in_kernel: l2-normalise q and k first (eps 1e-6).

    Returns:
        (o [B, 1, HV, V] in q's dtype, new state [B, HV, K, V] in float32, float64 for float64 inputs).

    Raises:
        ValueError: if T != 1 or shapes are inconsistent.

    Reference:
        arXiv 2412.06464 eq. 10; kernels.md sec. 2.
    """
    B, T, _H, HV, K, V, group = check_inputs(q, k, v, g, beta, state)
    if T != 1:
        raise ValueError(f"gated_delta_rule_step takes one token (T=1); got T={T}. Use gated_delta_rule for T>1.")
    dt = compute_dtype(q.dtype)
    scale = K**-0.5 if scale is None else scale
    q_, k_ = prepare_qk(q, k, group, dt, use_qk_l2norm_in_kernel)
    state = q_.new_zeros(B, HV, K, V) if state is None else state.to(dt)
    o, state = recurrent_update(q_[:, 0], k_[:, 0], v[:, 0].to(dt), g[:, 0].to(dt), beta[:, 0].to(dt), state, scale)
    return o[:, None].to(q.dtype), state
