"""Shared helpers for GPU benchmark scripts: the results envelope and an atomic writer."""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import json
from pathlib import Path

import torch

from hylo_bench.io_utils import atomic_write_text, git_sha


def result_envelope(benchmark: str) -> dict:
    """``{"benchmark", "git_sha", "device", "versions", "created_utc", "records": []}``."""
    versions = {"torch": torch.__version__}
    for pkg in ("transformers", "triton", "flash-linear-attention", "fla-core", "liger-kernel", "tilelang"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"benchmark": benchmark, "git_sha": git_sha(), "device": device, "versions": versions,
            "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "records": []}


def write_result(path: Path, obj: dict) -> None:
    """Write a benchmark result JSON atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")
