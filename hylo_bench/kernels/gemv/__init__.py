"""Decode GEMV with its RMSNorm / SwiGLU prologue and residual epilogue fused: one public entry with back ends.

Back ends: "torch" (:func:`fused_gemv_reference`, any device; under ``torch.compile`` Inductor fuses the element-wise
parts and calls cuBLAS for the product) and "triton" (one kernel per GEMV, CUDA only, at most
``triton_kernel.MAX_ROWS`` rows; imported lazily). The serving engine picks one per engine
(``Engine(gemv_backend=...)``; "auto" through the kernel registry, choice ``gemv``: :func:`select_gemv_backend`).
"""

from __future__ import annotations

import torch

from hylo_bench.kernels.gemv.reference import check_gemv_inputs, fused_gemv_reference
from hylo_bench.kernels.registry import KernelChoice, register, triton_available

__all__ = ["GEMV_BACKENDS", "MAX_TRITON_ROWS", "fused_gemv", "fused_gemv_reference", "select_gemv_backend",
           "triton_serves"]

GEMV_BACKENDS = ("torch", "triton")
MAX_TRITON_ROWS = 16  # = triton_kernel.MAX_ROWS (kept here so the CPU path need not import Triton)


def _auto_gemv(device: torch.device, dtype: torch.dtype, merged_projections: bool) -> tuple[str, str]:
    """The engine's ``gemv_backend="auto"``: triton with merged projections on CUDA (not float64) when Triton
    imports, torch otherwise."""
    if not merged_projections:
        return "torch", "projections not merged"
    if device.type != "cuda":
        return "torch", f"device {device.type}"
    if dtype == torch.float64:
        return "torch", "float64 weights"
    if not triton_available():
        return "torch", "triton not installed"
    return "triton", "CUDA, merged projections"


CHOICE = register(KernelChoice("gemv", "decode GEMV backend", ("triton", "torch"), _auto_gemv))


def select_gemv_backend(device: torch.device, dtype: torch.dtype, merged_projections: bool) -> str:
    """The decode GEMV back end for ``gemv_backend="auto"`` (kernel registry choice ``gemv``; logged once)."""
    backend, reason = CHOICE.choose(device, dtype, merged_projections)
    CHOICE.log(backend, reason)
    return backend


def triton_serves(device: torch.device, dtype: torch.dtype, rows: int) -> bool:
    """Whether ``fused_gemv(..., backend="triton")`` runs the Triton kernel for ``rows`` input rows of ``dtype`` on
    ``device``: CUDA, 1 to ``MAX_TRITON_ROWS`` rows, and not float64 (the kernel accumulates in float32, which would
    break the float64 reference's precision)."""
    return device.type == "cuda" and dtype != torch.float64 and 0 < rows <= MAX_TRITON_ROWS


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               glu: bool = False, residual: torch.Tensor | None = None, gate: torch.Tensor | None = None,
               backend: str = "torch") -> torch.Tensor:
    """``residual + prologue(x) @ weight.T``: arguments as :func:`fused_gemv_reference` (x [..., K] or [..., 2K]
    with ``glu``, weight [N, K], norm_weight [K] (or [G] with ``gate`` [..., K]: GDN's gated group norm),
    residual [..., N]), result [..., N] in x's dtype.

    ``backend="triton"`` runs the Triton kernel when :func:`triton_serves` (CUDA, not float64, 1 to 16 rows), and
    the torch path otherwise (a prefill-sized input is a GEMM, not a GEMV; the kernel accumulates in float32), and
    for a gated norm whose group is not a power of two <= 1024. On Hopper+ CUDA the kernel starts before the
    previous kernel ends and reads ``weight`` early (programmatic dependent launch): the weight must not be
    written by the kernel just before (decode weights are constant; a non-contiguous weight is copied and then
    waited for).

    Raises:
        ValueError: unknown backend, inconsistent shapes or dtypes.
    """
    if backend not in GEMV_BACKENDS:
        raise ValueError(f"GEMV backend {backend!r}; expected one of {GEMV_BACKENDS}")
    M, _, _ = check_gemv_inputs(x, weight, norm_weight, glu, residual, gate)
    group_ok = gate is None or (norm_weight.numel() & (norm_weight.numel() - 1) == 0 and norm_weight.numel() <= 1024)
    if backend == "triton" and triton_serves(x.device, x.dtype, M) and group_ok:
        from hylo_bench.kernels.gemv.triton_kernel import fused_gemv_triton

        return fused_gemv_triton(x, weight, norm_weight, eps, glu, residual, gate)
    return fused_gemv_reference(x, weight, norm_weight=norm_weight, eps=eps, glu=glu, residual=residual, gate=gate)
