"""The fused decode GEMV as a ``torch.library`` custom op, ``hylo::fused_gemv``
(:func:`hylo_bench.kernels.gemv.fused_gemv` on its Triton back end: RMSNorm / SwiGLU / gated-norm prologue, residual
epilogue), so ``torch.compile`` can trace a whole decode step around it; outside ``torch.compile`` the callers reach
the implementation directly (a custom op costs a dispatcher round trip). Also ``hylo::mlp_chain``: a batch-1 decode
layer's whole MLP in one persistent kernel (:mod:`hylo_bench.kernels.gemv.chain`, experimental).
"""

from __future__ import annotations

import torch

__all__ = ["fused_gemv_op", "mlp_chain_op"]


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


def _impl_chain(x, norm_weight, eps, gate_up, down):
    from hylo_bench.kernels.gemv import triton_serves
    from hylo_bench.kernels.gemv.reference import mlp_chain_reference

    if triton_serves(x.device, x.dtype, 1) and x.numel() == x.shape[-1]:
        from hylo_bench.kernels.gemv.chain import mlp_chain_triton

        return mlp_chain_triton(x, norm_weight, eps, gate_up, down)
    return mlp_chain_reference(x, norm_weight, eps, gate_up, down)


@torch.library.custom_op("hylo::mlp_chain", mutates_args=())
def _mlp_chain(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    return _impl_chain(x, norm_weight, eps, gate_up, down)


@_mlp_chain.register_fake
def _(x, norm_weight, eps, gate_up, down):
    return torch.empty_like(x)


def mlp_chain_op(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
    """A decode layer's MLP with its norm and residual, ``x + down(silu(gate) * up)`` over ``[gate ; up] =
    gate_up(rmsnorm(x))``: one persistent Triton kernel for one CUDA row (:mod:`hylo_bench.kernels.gemv.chain`),
    :func:`hylo_bench.kernels.gemv.reference.mlp_chain_reference` otherwise (several rows, CPU, float64). x [..., K],
    gate_up [2I, K], down [K, I] -> [..., K]; through the ``hylo::mlp_chain`` op while ``torch.compile`` traces."""
    if torch.compiler.is_compiling():
        return torch.ops.hylo.mlp_chain(x, norm_weight, eps, gate_up, down)
    return _impl_chain(x, norm_weight, eps, gate_up, down)
