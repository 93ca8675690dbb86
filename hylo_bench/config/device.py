"""Torch dtypes and devices of the command line and the configs: ``--dtype`` names to ``torch.dtype``, the default
device and dtype, device checks. Torch is imported when a function is called, not at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hylo_bench.config.units import DTYPE_NAMES, check_dtype_name

if TYPE_CHECKING:
    import torch


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` / ``"bfloat16"`` / ``"fp16"`` / ``"float16"`` / ``"fp32"`` / ``"float32"`` / ``"fp64"`` /
    ``"float64"`` (any case) -> torch dtype; ``None`` and ``"auto"`` -> None (the loader's default: bf16 on GPU,
    fp32 on CPU, :func:`default_dtype`); a ``torch.dtype`` is returned as is.

    Raises:
        ValueError: any other name (the accepted ones listed).
    """
    import torch

    if name is None or isinstance(name, torch.dtype):
        return name
    check_dtype_name(name)
    if name.lower() == "auto":
        return None
    return getattr(torch, DTYPE_NAMES[name.lower()])


def default_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str) -> str:
    """Validate a ``--device`` value before any loading; returns it.

    Raises:
        ValueError: not a torch device name (``cpu``, ``cuda``, ``cuda:1``...), or CUDA asked for but not available.
    """
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"--device {device!r}: not a torch device ({exc}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device!r}: this torch ({torch.__version__}) sees no CUDA device; use "
                             f"--device cpu or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


def default_dtype(device: str) -> torch.dtype:
    """bf16 on GPU (as the released model cards say), fp32 on CPU (bf16 CPU matmuls are slow and inexact)."""
    import torch

    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
