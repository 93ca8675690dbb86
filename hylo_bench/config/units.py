"""Units of the command line and the configs: token lengths and budgets, byte sizes, dtype names, the 0-100 scale
of scores. Never imports torch (``hylo-bench info`` / ``kv`` and the reports use it); torch dtypes and devices:
:mod:`hylo_bench.config.device`.
"""

from __future__ import annotations

import re

_BYTE_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
               "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
               "float16": "float16", "fp16": "float16", "float64": "float64", "fp64": "float64"}
"""Accepted ``--dtype`` names (case-insensitive) -> ``torch`` attribute names."""
LM_EVAL_PERCENT_METRICS = frozenset({"acc", "acc_norm", "exact_match", "em", "f1", "mc1", "mc2", "mcc", "contains"})
"""lm-eval reports these on a 0-1 scale; ``eval`` and the results store keep every accuracy-like score on 0-100,
like RULER and the paper."""


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
    """Validate a dtype name without importing torch (see :func:`hylo_bench.config.device.parse_dtype`).

    Raises:
        ValueError: a name other than ``auto`` or one of :data:`DTYPE_NAMES`.
    """
    if name is not None and not isinstance(name, str):
        return
    if name is not None and name.lower() != "auto" and name.lower() not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r}: expected auto or one of {', '.join(DTYPE_NAMES)}")
