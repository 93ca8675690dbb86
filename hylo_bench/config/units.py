"""Units of the command line and the configs: token lengths and budgets, byte sizes, dtypes, devices.

Torch-free at import (``hylo-bench info`` / ``kv`` parse sizes without it); the dtype and device helpers import
torch when called.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_BYTE_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
               "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "float64": "float64", "fp64": "float64"}
"""Accepted ``--dtype`` names (case-insensitive) -> ``torch`` attribute names."""


def parse_length(text: str) -> int:
    """``"8k"`` -> 8192, ``"1m"`` -> 1048576, ``"1000"`` -> 1000 (tokens).

    Raises:
        ValueError: when the text is not a positive length.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise ValueError(f"length {text!r}: expected a token count such as 1024, 8k or 1m")
    value = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]
    if value < 1 or value != int(value):
        raise ValueError(f"length {text!r}: must be a positive whole number of tokens")
    return int(value)


def format_length(tokens: int) -> str:
    """8192 -> ``"8k"``, 1048576 -> ``"1m"``, 1000 -> ``"1000"``."""
    if tokens % (1024 ** 2) == 0:
        return f"{tokens // 1024 ** 2}m"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}k"
    return str(tokens)


def parse_token_count(text: str) -> int:
    """``"20M"`` -> 20_000_000, ``"500k"`` -> 500_000, ``"1.5B"`` -> 1_500_000_000 tokens (decimal units).

    Raises:
        ValueError: on a malformed count.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMbB]?)\s*", text)
    if not m:
        raise ValueError(f"token budget {text!r}: expected e.g. 500k, 20M or 1B")
    return int(float(m.group(1)) * {"": 1, "k": 10 ** 3, "m": 10 ** 6, "b": 10 ** 9}[m.group(2).lower()])


def parse_bytes(text: str) -> int:
    """``"141GiB"`` -> 151397597184, ``"80GB"`` -> 80e9, ``"512MiB"``, ``"1024B"``; ``"0"`` is 0. A bare non-zero
    number is refused (is ``80`` bytes or GiB?).

    Raises:
        ValueError: on an unknown unit or a malformed number.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if m and not m.group(2) and float(m.group(1)) == 0:
        return 0
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"memory size {text!r}: expected a number with a unit such as 141GiB, 80GB or 512MiB")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> ``"1.50 KiB"``."""
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def check_dtype_name(name: str | None) -> None:
    """Validate a dtype name without importing torch (see :func:`parse_dtype`).

    Raises:
        ValueError: a name other than ``auto`` or one of :data:`DTYPE_NAMES`.
    """
    if name is not None and not isinstance(name, str):
        return
    if name is not None and name.lower() != "auto" and name.lower() not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r}: expected auto or one of {', '.join(DTYPE_NAMES)}")


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
