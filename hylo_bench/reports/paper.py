"""The paper's numbers (arXiv:2604.24715, Tables 2-4) as shipped in ``hylo_bench/data/hylo_paper_tables.json``.

Owns finding and parsing the tables file and matching a stored model name to a paper row. Scores are 0-100.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pandas as pd

PAPER_ENV = "HYLO_BENCH_PAPER_TABLES"
PAPER_TABLES = ("table2_llama3.2-1B", "table3_llama3.2-3B", "table4_qwen3-1.7B")
COMMONSENSE_COLUMNS = ("ARC", "ARE", "HS", "OB", "PI", "RA", "WG")
RULER_COLUMNS = {"R8K": 8192, "R16K": 16384, "R32K": 32768, "R64K": 65536}
# Released names look like "amd/HyLo-Llama-4MLA12GDN-64K-SFT"; the paper row is ("HyLo-Llama-4MLA12GDN", "64K").
_RELEASED = re.compile(r"^(HyLo-(?:Llama|Qwen)-\d+MLA\d+(?:M2|GDN))-(\d+K)(?:-SFT)?$", re.IGNORECASE)


def paper_tables_path() -> Path:
    """``$HYLO_BENCH_PAPER_TABLES`` when set, else the copy shipped in the package."""
    if os.environ.get(PAPER_ENV):
        return Path(os.environ[PAPER_ENV])
    return Path(__file__).resolve().parents[1] / "data" / "hylo_paper_tables.json"


def load_paper_tables(path: str | Path | None = None) -> dict[str, Any]:
    """The parsed tables file (default :func:`paper_tables_path`).

    Raises:
        ValueError: the file is missing or not valid JSON; names the path and the environment variable.
    """
    path = Path(path) if path is not None else paper_tables_path()
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"paper tables {path} not found; set {PAPER_ENV} to hylo_paper_tables.json") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"paper tables {path}: not valid JSON ({exc})") from None


def paper_frame(tables: dict[str, Any]) -> pd.DataFrame:
    """One row per model row of Tables 2-4, the paper's columns as printed plus ``table`` and ``ruler_mean``.

    ``ruler_mean`` is the plain mean of R8K..R64K (the x axis of the paper's Figure 1), recomputed here.
    """
    rows = []
    for table in PAPER_TABLES:
        for row in tables.get(table, []):
            ruler = [row.get(c) for c in RULER_COLUMNS]
            mean = math.fsum(ruler) / len(ruler) if all(v is not None for v in ruler) else None
            rows.append({"table": table, **row, "ruler_mean": mean})
    return pd.DataFrame(rows)


def match_paper_row(model: str, paper: pd.DataFrame) -> pd.Series | None:
    """The paper row of a stored model name, or None.

    A released checkpoint name (hub id or path ending in e.g. ``HyLo-Qwen-7MLA21GDN-8K-SFT``) matches the row of
    that model and training context; any other name matches only a row whose ``model`` equals its last path part
    exactly and uniquely (e.g. ``Llamba-1B``).
    """
    name = model.rstrip("/").rsplit("/", 1)[-1]
    found = _RELEASED.match(name)
    if found:
        want, ctx = found.group(1).lower(), found.group(2).upper()
        hits = paper[(paper["model"].str.lower() == want) & (paper["train_ctx"] == ctx)]
    else:
        hits = paper[paper["model"] == name]
    return hits.iloc[0] if len(hits) == 1 else None
