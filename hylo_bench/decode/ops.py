"""The engine's two kernel calls as ``torch.library`` custom ops, so ``torch.compile`` can trace a whole decode step.

Inductor fuses the many small element-wise kernels of a decode step (RMSNorms, SwiGLU, RoPE, gates, the short
convolutions) into a few; the Triton MLA decode kernel and fla's recurrent GDN step stay opaque calls. Outside
``torch.compile`` the engine calls the implementations directly (a custom op costs a dispatcher round trip).

Ops (namespace ``hylo``):
- ``hylo::mla_decode``: :func:`hylo_bench.kernels.mla_decode.mla_decode` with a resolved back end.
- ``hylo::gdn_decode_step``: one gated-delta-rule token, the recurrent state updated in place.
- ``hylo::gdn_decode_prestep``: a GDN token's short convolutions (caches shifted in place), SiLU and gates in one
  Triton kernel (:mod:`hylo_bench.kernels.gated_delta.decode_prestep`).
- ``hylo::mla_decode_prep``: an MLA decode token's query norm, RoPE and absorption and its cache row, one Triton
  kernel (:mod:`hylo_bench.kernels.mla_decode.prep_triton`); the cache and key scales written in place.
- ``hylo::mla_value_up``: the latent attention output times W_UV, one Triton kernel
  (:func:`hylo_bench.kernels.mla_decode.prep_triton.mla_value_up_triton`).
- ``hylo::gdn_decode_token``: a whole GDN decode token (pre-step and recurrence) in one Triton kernel
  (:mod:`hylo_bench.kernels.gated_delta.decode_token_triton`); caches, state and counters updated in place.
- ``hylo::fused_gemv``: :func:`hylo_bench.kernels.gemv.fused_gemv` on its Triton back end (RMSNorm / SwiGLU
  prologue, residual epilogue).
"""

from __future__ import annotations

import torch

__all__ = ["fused_gemv_op", "gdn_decode_prestep_op", "gdn_decode_step", "gdn_decode_token_op", "mla_decode_op",
           "mla_decode_prep_op", "mla_value_up_op"]


def _impl_mla(q_lat, q_rope, cache, lengths, scale, key_scale, backend):
    from hylo_bench.kernels.mla_decode import mla_decode

    return mla_decode(q_lat, q_rope, cache, lengths, scale=scale, key_scale=key_scale, backend=backend)


@torch.library.custom_op("hylo::mla_decode", mutates_args=())
def _mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, scale: float,
                key_scale: torch.Tensor | None, backend: str) -> torch.Tensor:
    return _impl_mla(q_lat, q_rope, cache, lengths, scale, key_scale, backend)


@_mla_decode.register_fake
def _(q_lat, q_rope, cache, lengths, scale, key_scale, backend):
    dt = torch.float64 if q_lat.dtype == torch.float64 else torch.float32
    return q_lat.new_empty(q_lat.shape, dtype=dt)


def mla_decode_op(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, *,
                  scale: float, key_scale: torch.Tensor | None, backend: str) -> torch.Tensor:
    """Absorbed MLA decode attention; arguments and result as :func:`hylo_bench.kernels.mla_decode.mla_decode`
    (q_lat [B, H, R], q_rope [B, H, P], cache [B, T, R + P], lengths [B] -> [B, H, R] float32), through the
    ``hylo::mla_decode`` op while ``torch.compile`` traces, directly otherwise. ``backend``: "torch" or "triton"
    (resolve "auto" before tracing: :func:`hylo_bench.kernels.mla_decode.select_mla_decode_backend`)."""
    if torch.compiler.is_compiling():
        return torch.ops.hylo.mla_decode(q_lat, q_rope, cache, lengths, scale, key_scale, backend)
    return _impl_mla(q_lat, q_rope, cache, lengths, scale, key_scale, backend)


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


def _impl_gemv(x, weight, norm_weight, eps, glu, residual, gate):
    from hylo_bench.kernels.gemv import fused_gemv

    return fused_gemv(x, weight, norm_weight=norm_weight, eps=eps, glu=glu, residual=residual, gate=gate,
                      backend="triton")


@torch.library.custom_op("hylo::fused_gemv", mutates_args=())
def _fused_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, glu: bool,
                residual: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    return _impl_gemv(x, weight, norm_weight, eps, glu, residual, gate)


@_fused_gemv.register_fake
def _(x, weight, norm_weight, eps, glu, residual, gate):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def fused_gemv_op(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, glu: bool = False, residual: torch.Tensor | None = None,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + prologue(x) @ weight.T`` on the Triton GEMV (CUDA, <= 16 rows; the torch reference otherwise):
    arguments and result as :func:`hylo_bench.kernels.gemv.fused_gemv`, through the ``hylo::fused_gemv`` op while
    ``torch.compile`` traces, directly otherwise."""
    if torch.compiler.is_compiling():
        return torch.ops.hylo.fused_gemv(x, weight, norm_weight, eps, glu, residual, gate)
    return _impl_gemv(x, weight, norm_weight, eps, glu, residual, gate)


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


def _impl_prep(q, lat, positions, cache, key_scale, w_uk, kv_b_weight, inv_freq, mscale, H, N, P, V, q_norm_weight,
               q_eps, k_norm_weight, k_eps, kv_a_norm_weight, kv_a_eps):
    from hylo_bench.kernels.mla_decode.prep_triton import mla_decode_prep_triton

    return mla_decode_prep_triton(q, lat, positions, cache, key_scale, w_uk, kv_b_weight, inv_freq, mscale,
                                  num_heads=H, nope_dim=N, rope_dim=P, v_dim=V, q_norm_weight=q_norm_weight,
                                  q_eps=q_eps, k_norm_weight=k_norm_weight, k_eps=k_eps,
                                  kv_a_norm_weight=kv_a_norm_weight, kv_a_eps=kv_a_eps)


@torch.library.custom_op("hylo::mla_decode_prep", mutates_args=("cache", "key_scale"))
def _mla_decode_prep(q: torch.Tensor, lat: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
                     key_scale: torch.Tensor | None, w_uk: torch.Tensor, kv_b_weight: torch.Tensor,
                     inv_freq: torch.Tensor, mscale: float, H: int, N: int, P: int, V: int,
                     q_norm_weight: torch.Tensor | None, q_eps: float, k_norm_weight: torch.Tensor | None,
                     k_eps: float, kv_a_norm_weight: torch.Tensor | None,
                     kv_a_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl_prep(q, lat, positions, cache, key_scale, w_uk, kv_b_weight, inv_freq, mscale, H, N, P, V,
                      q_norm_weight, q_eps, k_norm_weight, k_eps, kv_a_norm_weight, kv_a_eps)


@_mla_decode_prep.register_fake
def _(q, lat, positions, cache, key_scale, w_uk, kv_b_weight, inv_freq, mscale, H, N, P, V, q_norm_weight, q_eps,
      k_norm_weight, k_eps, kv_a_norm_weight, kv_a_eps):
    B, R = q.shape[0], w_uk.shape[-1]
    return q.new_empty(B, H, R), q.new_empty(B, H, P), positions.new_empty(B)


def mla_decode_prep_op(q, lat, positions, cache, key_scale, w_uk, kv_b_weight, inv_freq, mscale: float, H: int,
                       N: int, P: int, V: int, q_norm_weight=None, q_eps: float = 1e-6, k_norm_weight=None,
                       k_eps: float = 1e-6, kv_a_norm_weight=None, kv_a_eps: float = 1e-6
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MLA decode token's absorbed query and cache row in one Triton kernel: arguments and results as
    :func:`hylo_bench.kernels.mla_decode.prep_triton.mla_decode_prep_triton` (positional), through the
    ``hylo::mla_decode_prep`` op while ``torch.compile`` traces, directly otherwise."""
    args = (q, lat, positions, cache, key_scale, w_uk, kv_b_weight, inv_freq, mscale, H, N, P, V, q_norm_weight,
            q_eps, k_norm_weight, k_eps, kv_a_norm_weight, kv_a_eps)
    if torch.compiler.is_compiling():
        return torch.ops.hylo.mla_decode_prep(*args)
    return _impl_prep(*args)


@torch.library.custom_op("hylo::mla_value_up", mutates_args=())
def _mla_value_up(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    from hylo_bench.kernels.mla_decode.prep_triton import mla_value_up_triton

    return mla_value_up_triton(o_lat, w_uv)


@_mla_value_up.register_fake
def _(o_lat, w_uv):
    return w_uv.new_empty(o_lat.shape[0], o_lat.shape[1] * w_uv.shape[1])


def mla_value_up_op(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [B, H, R] float32, w_uv [G, V, R] -> [B, H * V] in w_uv's dtype on the Triton kernel
    (:func:`hylo_bench.kernels.mla_decode.prep_triton.mla_value_up_triton`), through the ``hylo::mla_value_up`` op
    while ``torch.compile`` traces, directly otherwise."""
    if torch.compiler.is_compiling():
        return torch.ops.hylo.mla_value_up(o_lat, w_uv)
    from hylo_bench.kernels.mla_decode.prep_triton import mla_value_up_triton

    return mla_value_up_triton(o_lat, w_uv)
