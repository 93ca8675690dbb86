"""Shared helpers for GPU benchmark scripts: the results envelope, an atomic writer and CUDA-event timing."""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import json
import time
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


def call_times(fn, reps: int, cuda: bool) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn``: between two CUDA events on the current stream (``cuda``), else
    by the wall clock. No warm-up here: call ``fn`` first where it compiles or tunes."""
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times
