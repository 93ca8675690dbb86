"""Decode-GEMV configs tuned inside the decode step, per device: ``tuned/<device name>.json``.

Triton's autotuner times each config of the row-block GEMV alone, one launch at a time, and its pick varies from
run to run by a few percent of the kernel's time. Inside a decode step's CUDA graph the GEMVs overlap their
neighbours (programmatic dependent launch), and what is fastest there is measured by
``benchmarks/gemv_step_tune.py``, which times every config as the whole step's TPOT and writes a table in this
format. A shape listed for the device launches its config directly; any other shape (another model, another device)
is autotuned as before. The vLLM project ships its fused-MoE configs the same way (one JSON per device name).

Table format::

    {"device": "NVIDIA H200", "source": "...", "rowblock": [
        {"N": 12288, "K": 2048, "M_PAD": 1, "PROLOGUE": 1, "GROUP": 1, "HAS_RES": false,
         "BLOCK_N": 2, "BLOCK_K": 1024, "PREFETCH": 1, "num_warps": 4}, ...]}

Keys as the kernel's (:mod:`hylo_bench.kernels.gemv.triton_kernel`): N output and K input features, M_PAD rows
padded to a power of two, PROLOGUE (0 none, 1 RMSNorm, 2 SwiGLU, 3 gated group norm), GROUP (the gated norm's group),
HAS_RES (residual epilogue); the rest is the config.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

__all__ = ["KEY_FIELDS", "CONFIG_FIELDS", "TABLE_DIR", "load_table", "table_path", "tuned_config"]

TABLE_DIR = Path(__file__).with_name("tuned")
KEY_FIELDS = ("N", "K", "M_PAD", "PROLOGUE", "GROUP", "HAS_RES")
CONFIG_FIELDS = ("BLOCK_N", "BLOCK_K", "PREFETCH", "num_warps")
_POW2 = ("BLOCK_N", "BLOCK_K", "num_warps")


def table_path(device_name: str, table_dir: Path = TABLE_DIR) -> Path:
    """``tuned/<name>.json`` with every run of characters other than letters and digits made one ``_``
    (``"NVIDIA H200"`` -> ``NVIDIA_H200.json``)."""
    return table_dir / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def load_table(path: Path) -> dict[tuple, dict[str, int]]:
    """The ``rowblock`` entries of a table file as {(N, K, M_PAD, PROLOGUE, GROUP, HAS_RES): config}.

    Raises:
        ValueError: the file is not JSON, has no ``rowblock`` list, or an entry lacks a field, has a non-integer or
            (for tiles and warps) non-power-of-two value, a PREFETCH outside 0-2, or repeats a key; the message
            names the file and the entry.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    entries = data.get("rowblock") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected an object with a 'rowblock' list of entries")
    table: dict[tuple, dict[str, int]] = {}
    for i, e in enumerate(entries):
        where = f"{path}: rowblock[{i}]"
        missing = [f for f in KEY_FIELDS + CONFIG_FIELDS if not isinstance(e, dict) or f not in e]
        if missing:
            raise ValueError(f"{where} lacks {missing}; every entry needs {list(KEY_FIELDS + CONFIG_FIELDS)}")
        for f in KEY_FIELDS[:-1] + CONFIG_FIELDS:
            v = e[f]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{where}: {f}={v!r}; expected a non-negative integer")
        if not isinstance(e["HAS_RES"], bool):
            raise ValueError(f"{where}: HAS_RES={e['HAS_RES']!r}; expected true or false")
        bad = [f for f in _POW2 if e[f] < 1 or e[f] & (e[f] - 1)]
        if bad:
            raise ValueError(f"{where}: {', '.join(f'{f}={e[f]}' for f in bad)}; expected powers of two")
        if e["PREFETCH"] not in (0, 1, 2):
            raise ValueError(f"{where}: PREFETCH={e['PREFETCH']}; expected 0, 1 or 2")
        key = tuple(e[f] for f in KEY_FIELDS)
        if key in table:
            raise ValueError(f"{where}: key {dict(zip(KEY_FIELDS, key))} listed twice")
        table[key] = {f: e[f] for f in CONFIG_FIELDS}
    return table


@functools.cache
def _device_table(device_name: str) -> dict[tuple, dict[str, int]]:
    path = table_path(device_name, TABLE_DIR)
    return load_table(path) if path.is_file() else {}


def tuned_config(device_name: str, key: tuple) -> dict[str, int] | None:
    """The tuned config for ``key`` (values of ``KEY_FIELDS``) on the device called ``device_name``
    (``torch.cuda.get_device_name``), or None when its table lacks the shape or the device has none.

    Raises:
        ValueError: the device's table file is malformed (:func:`load_table`).
    """
    return _device_table(device_name).get(tuple(key))
