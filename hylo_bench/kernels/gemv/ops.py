"""The fused decode GEMV as a ``torch.library`` custom op, ``hylo::fused_gemv``
(:func:`hylo_bench.kernels.gemv.fused_gemv` on its Triton back end: RMSNorm / SwiGLU / gated-norm prologue, residual
epilogue), so ``torch.compile`` can trace a whole decode step around it; outside ``torch.compile`` the callers reach
the implementation directly (a custom op costs a dispatcher round trip).
"""

from __future__ import annotations

import torch

__all__ = ["fused_gemv_op"]


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
