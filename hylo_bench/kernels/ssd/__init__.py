"""Mamba-2 SSD scan: one public entry with back ends, plus the naive reference and the decode step.

Back ends: "torch" (pure-torch chunked, any device, autograd) and "fla" (fla 0.6.0 ``chunk_simple_gla`` on
CUDA, forward only, imported lazily). "auto" picks torch on CPU, for float64 and whenever gradients are
needed; fla on CUDA when it is installed (kernel registry choice ``ssd``, ``$HYLO_BENCH_SSD_BACKEND``). State layout
everywhere: [B, H, P, N] (mamba_ssm ``ssm_state``).
"""

from __future__ import annotations

import torch

from hylo_bench.kernels.registry import KernelChoice, fla_installed, register
from hylo_bench.kernels.ssd.chunk import DEFAULT_CHUNK_SIZE, ssd_scan_chunked, ssd_step
from hylo_bench.kernels.ssd.gpu import fla_ssd_scan
from hylo_bench.kernels.ssd.reference import ssd_scan_reference

__all__ = ["DEFAULT_CHUNK_SIZE", "ssd_scan", "ssd_scan_chunked", "ssd_scan_reference", "ssd_step"]

BACKENDS = ("auto", "torch", "fla")


def select_ssd_backend(device: torch.device, needs_grad: bool, dtype: torch.dtype) -> tuple[str, str]:
    """("torch" | "fla", reason) for backend="auto"."""
    if device.type != "cuda":
        return "torch", f"device {device.type}"
    if dtype == torch.float64:
        return "torch", "float64 inputs"
    if needs_grad:
        return "torch", "gradients needed; fla chunk_simple_gla backward is blocked on Hopper (kernels.md 9.3)"
    if not fla_installed():
        return "torch", "fla not installed"
    return "fla", "CUDA, forward only"


CHOICE = register(KernelChoice("ssd", "SSD backend", ("fla", "torch"), select_ssd_backend))


@torch.compiler.disable  # environment and logging: plain Python, never traced
def _select_and_log(device: torch.device, needs_grad: bool, dtype: torch.dtype) -> str:
    backend, reason = CHOICE.choose(device, needs_grad, dtype)
    CHOICE.log(backend, reason)
    return backend


def ssd_scan(
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
    backend: str = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD scan over a whole sequence (prefill / training). Contract: ``ssd_scan_reference``.

    Args:
        x: [B, T, H, P]. dt: [B, T, H] raw step sizes. A: [H] (< 0). B, C: [B, T, G, N].
        D, dt_bias: [H] or None. dt_softplus: softplus(dt + dt_bias).
        initial_state: [B, H, P, N] or None. chunk_size: torch back end chunk length.
        backend: "auto", "torch" or "fla".
        cu_seqlens: [n_docs + 1] offsets of packed documents (B = 1): the state restarts at each document.

    Returns:
        (y [B, T, H, P] in x's dtype, final state [B, H, P, N] float32 / float64).

    Raises:
        ValueError: unknown backend, "fla" on non-CUDA tensors, inconsistent shapes.
        ImportError: backend="fla" without fla installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, dt, A, B, C, D, dt_bias, initial_state))
        backend = _select_and_log(x.device, needs_grad, x.dtype)
    kwargs = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if backend == "fla":
        return fla_ssd_scan(x, dt, A, B, C, **kwargs)
    return ssd_scan_chunked(x, dt, A, B, C, chunk_size=chunk_size, **kwargs)
