"""Ground truth for the gated delta rule: a float64 per-token loop (kernels.md sec. 2).

Legend: B batch, T tokens, H q/k heads, HV value heads, K q/k head dim, V value head dim.
Slow by design; use it in tests at small T only.
"""

from __future__ import annotations

import torch

from hylo_bench.kernels.gated_delta._common import check_inputs, prepare_qk
from hylo_bench.kernels.precision import compute_dtype


def recurrent_update(
    q_BHK: torch.Tensor,
    k_BHK: torch.Tensor,
    v_BHV: torch.Tensor,
    g_BH: torch.Tensor,
    beta_BH: torch.Tensor,
    state_BHKV: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule, all tensors in one dtype (no casting here).

    Decay first, then the delta correction against the *decayed* state:
    S~ = exp(g) S;  u = beta (v - S~^T k);  S' = S~ + k u^T;  o = scale S'^T q.

    Args:
        q_BHK, k_BHK: [B, HV, K] query and key of this token (already expanded to HV heads).
        v_BHV: [B, HV, V].
        g_BH: [B, HV] log-space decay (<= 0).
        beta_BH: [B, HV] write strength (post-sigmoid).
        state_BHKV: [B, HV, K, V] state before the token.
        scale: output scale.

    Returns:
        (o [B, HV, V], new state [B, HV, K, V]).

    Reference:
        arXiv 2412.06464 (Gated DeltaNet), eq. 10; fla 0.6.0 ``fla/ops/gated_delta_rule/naive.py``.
    """
    state = state_BHKV * g_BH.exp()[..., None, None]
    v_old = torch.einsum("bhk,bhkv->bhv", k_BHK, state)
    u = beta_BH[..., None] * (v_BHV - v_old)
    state = state + k_BHK[..., :, None] * u[..., None, :]
    o = scale * torch.einsum("bhk,bhkv->bhv", q_BHK, state)
    return o, state


def gated_delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Naive gated delta rule, one token at a time, computed in float64.

    With ``cu_seqlens`` (packed documents, B = 1) each document is run on its own from its initial state
    (``initial_state`` [n_docs, HV, K, V] or zeros) and the final states are stacked per document.

    Args:
        q, k: [B, T, H, K].
        v: [B, T, HV, V]; HV % H == 0 (head h of v reads q/k head h // (HV // H)).
        g: [B, T, HV] log-space decay, g <= 0.
        beta: [B, T, HV] post-sigmoid write strength.
        scale: output scale; default K ** -0.5.
        initial_state: [B, HV, K, V] (K-first), any float dtype; zeros when None.
        output_final_state: return the state after the last token.
        use_qk_l2norm_in_kernel: l2-normalise q and k first (eps 1e-6, as fla).

    Returns:
        o [B, T, HV, V] in q's dtype, and the final state [B, HV, K, V] (float64 for float64 inputs, else
        float32) or None.

    Raises:
        ValueError: on inconsistent shapes.

    Reference:
        arXiv 2412.06464; kernels.md sec. 2; fla 0.6.0 ``naive_recurrent_gated_delta_rule`` (beta before g there).
    """
    if cu_seqlens is not None:
        from hylo_bench.kernels.varlen import check_cu_seqlens

        cu = check_cu_seqlens(cu_seqlens, q.shape[1])
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch size 1; got {q.shape[0]}")
        outs, finals = [], []
        for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
            h0 = None if initial_state is None else initial_state[i:i + 1]
            o_i, f_i = gated_delta_rule_reference(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale,
                                                  h0, True, use_qk_l2norm_in_kernel)
            outs.append(o_i)
            finals.append(f_i)
        return torch.cat(outs, dim=1), (torch.cat(finals) if output_final_state else None)
    B, T, _H, HV, K, V, group = check_inputs(q, k, v, g, beta, initial_state)
    f64 = torch.float64
    scale = K**-0.5 if scale is None else scale
    q64, k64 = prepare_qk(q, k, group, f64, use_qk_l2norm_in_kernel)
    v64, g64, b64 = v.to(f64), g.to(f64), beta.to(f64)
    state = q64.new_zeros(B, HV, K, V) if initial_state is None else initial_state.to(f64)
    outs = []
    for t in range(T):
        o_t, state = recurrent_update(q64[:, t], k64[:, t], v64[:, t], g64[:, t], b64[:, t], state, scale)
        outs.append(o_t)
    o = torch.stack(outs, dim=1) if outs else v64.new_zeros(B, 0, HV, V)
    final = state.to(compute_dtype(q.dtype)) if output_final_state else None
    return o.to(q.dtype), final
