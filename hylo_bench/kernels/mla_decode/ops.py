"""This package's decode kernels as ``torch.library`` custom ops (namespace ``hylo``), so ``torch.compile`` can trace
a whole decode step around them (Inductor fuses the small element-wise kernels between; these stay opaque calls).
Outside ``torch.compile`` the callers reach the implementations directly (a custom op costs a dispatcher round trip).

- ``hylo::mla_decode``: :func:`hylo_bench.kernels.mla_decode.mla_decode` with a resolved back end.
- ``hylo::mla_decode_prep``: an MLA decode token's query norm, RoPE and absorption and its cache row, one Triton
  kernel (:mod:`hylo_bench.kernels.mla_decode.prep_triton`); the cache and key scales written in place.
- ``hylo::mla_value_up``: the latent attention output times W_UV, one Triton kernel
  (:func:`hylo_bench.kernels.mla_decode.prep_triton.mla_value_up_triton`).
"""

from __future__ import annotations

import torch

__all__ = ["mla_decode_op", "mla_decode_prep_op", "mla_value_up_op"]


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
