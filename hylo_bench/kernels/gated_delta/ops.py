"""This package's GDN decode kernels as ``torch.library`` custom ops (namespace ``hylo``), so ``torch.compile`` can
trace a whole decode step around them; outside ``torch.compile`` the callers reach the implementations directly.

- ``hylo::gdn_decode_step``: one gated-delta-rule token, the recurrent state updated in place (fla or torch).
- ``hylo::gdn_decode_prestep``: a GDN token's short convolutions (caches shifted in place), SiLU and gates in one
  Triton kernel (:mod:`hylo_bench.kernels.gated_delta.decode_prestep`).
- ``hylo::gdn_decode_token``: a whole GDN decode token (pre-step and recurrence) in one Triton kernel
  (:mod:`hylo_bench.kernels.gated_delta.decode_token_triton`); caches, state and counters updated in place.
"""

from __future__ import annotations

import torch

__all__ = ["gdn_decode_prestep_op", "gdn_decode_step", "gdn_decode_token_op"]

_FLA_INPLACE = {"ok": True}


def _fla_step_inplace(q, k, v, g, beta, state):
    """fla 0.6.0's ``fused_recurrent_gated_delta_rule_fwd_kernel`` launched as its wrapper does, with the final state
    written over the initial one (each program reads its [K, BV] block of ``state`` first and writes the same block
    last, so aliasing is safe): saves the wrapper's new state tensor and the copy back. q, k, v, g, beta, state
    contiguous; returns o [B, 1, H, Vd]."""
    import triton
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd_kernel as kernel

    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[-1]
    BV = min(8, triton.next_power_of_2(V))
    o = torch.empty_like(v)
    kernel[(triton.cdiv(V, BV) * B * HV,)](
        q=q, k=k, v=v, g=g, gk=None, gv=None, beta=beta, A_log=None, dt_bias=None, o=o, h0=state, ht=state,
        cu_seqlens=None, scale=K ** -0.5, T=T, H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        IS_BETA_HEADWISE=beta.ndim != v.ndim, USE_QK_L2NORM_IN_KERNEL=True, STATE_V_FIRST=False,
        APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False, num_warps=1, num_stages=3)
    return o


def _impl_gdn(q, k, v, g, beta, state, backend):
    if backend == "fla":
        g, beta = g.float().contiguous(), beta.to(q.dtype).contiguous()
        if _FLA_INPLACE["ok"] and state.is_contiguous() and state.dtype == torch.float32:
            try:
                return _fla_step_inplace(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, state).to(q.dtype)
            except (ImportError, TypeError, KeyError, AttributeError):  # another fla version: its public API
                _FLA_INPLACE["ok"] = False
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        o, new = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    else:
        from hylo_bench.kernels.gated_delta import gated_delta_rule_step

        o, new = gated_delta_rule_step(q, k, v, g, beta, state, use_qk_l2norm_in_kernel=True)
    state.copy_(new)
    return o.to(q.dtype)


@torch.library.custom_op("hylo::gdn_decode_step", mutates_args=("state",))
def _gdn_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, backend: str) -> torch.Tensor:
    return _impl_gdn(q, k, v, g, beta, state, backend)


@_gdn_decode_step.register_fake
def _(q, k, v, g, beta, state, backend):
    return v.new_empty(v.shape, dtype=q.dtype)


def gdn_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, backend: str) -> torch.Tensor:
    """One GDN decode token with q/k L2-normalised in the kernel; ``state`` updated in place.

    Args:
        q, k: [B, 1, H, K]. v: [B, 1, H, Vd]. g: [B, 1, H] log decay (float32). beta: [B, 1, H] in (0, 1).
        state: [B, H, K, Vd] K-first recurrent state (float32; float64 for float64 models), overwritten.
        backend: "fla" (fla's ``fused_recurrent_gated_delta_rule``, CUDA) or "torch"
            (:func:`hylo_bench.kernels.gated_delta.gated_delta_rule_step`).

    Returns:
        o [B, 1, H, Vd] in q's dtype.

    Reference: arXiv 2412.06464 eq. 10; fla 0.6.0 ``fla/ops/gated_delta_rule/fused_recurrent.py``.
    """
    if torch.compiler.is_compiling():
        return torch.ops.hylo.gdn_decode_step(q, k, v, g, beta, state, backend)
    return _impl_gdn(q, k, v, g, beta, state, backend)


def _impl_prestep(proj, cq, ck, cv, conv_weight, A_log, dt_bias, backend):
    if backend == "triton":
        from hylo_bench.kernels.gated_delta.decode_prestep_triton import gdn_decode_prestep_triton

        return gdn_decode_prestep_triton(proj, (cq, ck, cv), conv_weight, A_log, dt_bias)
    from hylo_bench.kernels.gated_delta.decode_prestep import gdn_decode_prestep_reference

    return gdn_decode_prestep_reference(proj, (cq, ck, cv), conv_weight, A_log, dt_bias)


@torch.library.custom_op("hylo::gdn_decode_prestep", mutates_args=("cq", "ck", "cv"))
def _gdn_decode_prestep(proj: torch.Tensor, cq: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                        conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl_prestep(proj, cq, ck, cv, conv_weight, A_log, dt_bias, backend)


@_gdn_decode_prestep.register_fake
def _(proj, cq, ck, cv, conv_weight, A_log, dt_bias, backend):
    B, H = proj.shape[0], A_log.shape[0]
    gdt = torch.float64 if proj.dtype == torch.float64 else torch.float32
    return (proj.new_empty(B, cq.shape[1] + ck.shape[1] + cv.shape[1]), proj.new_empty(B, H, dtype=gdt),
            proj.new_empty(B, H, dtype=gdt))


def gdn_decode_prestep_op(proj: torch.Tensor, conv_caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                          conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, backend: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GDN decode token's convolutions, SiLU and gates: arguments and results as
    :func:`hylo_bench.kernels.gated_delta.decode_prestep.gdn_decode_prestep_reference` (conv caches shifted in
    place). ``backend`` "triton" (one kernel, CUDA) runs through the ``hylo::gdn_decode_prestep`` op while
    ``torch.compile`` traces; "torch" is traced as plain torch ops (Inductor fuses them)."""
    cq, ck, cv = conv_caches
    if backend == "triton" and torch.compiler.is_compiling():
        return torch.ops.hylo.gdn_decode_prestep(proj, cq, ck, cv, conv_weight, A_log, dt_bias, backend)
    return _impl_prestep(proj, cq, ck, cv, conv_weight, A_log, dt_bias, backend)


def _impl_token(proj, cq, ck, cv, conv_weight, A_log, dt_bias, state, counters):
    from hylo_bench.kernels.gated_delta.decode_token_triton import gdn_decode_token_triton

    return gdn_decode_token_triton(proj, (cq, ck, cv), conv_weight, A_log, dt_bias, state, counters)


@torch.library.custom_op("hylo::gdn_decode_token", mutates_args=("cq", "ck", "cv", "state", "counters"))
def _gdn_decode_token(proj: torch.Tensor, cq: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                      conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                      counters: torch.Tensor) -> torch.Tensor:
    return _impl_token(proj, cq, ck, cv, conv_weight, A_log, dt_bias, state, counters)


@_gdn_decode_token.register_fake
def _(proj, cq, ck, cv, conv_weight, A_log, dt_bias, state, counters):
    return proj.new_empty(proj.shape[0], cv.shape[1])


def gdn_decode_token_op(proj: torch.Tensor, conv_caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                        counters: torch.Tensor) -> torch.Tensor:
    """A whole GDN decode token in one Triton kernel (CUDA): arguments and result as
    :func:`hylo_bench.kernels.gated_delta.decode_token_triton.gdn_decode_token_triton` (o [B, H * Vd] in proj's
    dtype; conv caches, ``state`` and ``counters`` updated in place), through the ``hylo::gdn_decode_token`` op
    while ``torch.compile`` traces, directly otherwise."""
    cq, ck, cv = conv_caches
    if torch.compiler.is_compiling():
        return torch.ops.hylo.gdn_decode_token(proj, cq, ck, cv, conv_weight, A_log, dt_bias, state, counters)
    return _impl_token(proj, cq, ck, cv, conv_weight, A_log, dt_bias, state, counters)


