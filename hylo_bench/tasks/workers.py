"""Data-parallel evaluation workers shared by ``ruler --devices`` and ``eval --devices``: one process per GPU (or
all on CPU), started by ``torchrun`` (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``) or spawned with
``torch.multiprocessing``; each joins a gloo process group (barriers and small exchanges only) and loads the
model itself. Rank 0's result is returned.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from hylo_bench.io_utils import atomic_write_json

BARRIER_TIMEOUT_S = 24 * 3600
"""Longest wait at a barrier: one piece of work on the slowest worker, or rank 0 preparing shared data."""

Work = Callable[[str, int, int], Any]
"""``work(device, rank, world_size) -> JSON-ready result`` (rank 0's is returned); must be picklable to be spawned
(a top-level function or a ``functools.partial`` of one)."""


def launched_world_size() -> int:
    """``WORLD_SIZE`` set by torchrun (1 when unset)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def worker_device(device: str | None, local_rank: int) -> str:
    """The device of worker ``local_rank``: ``cpu`` for ``device="cpu"``, else ``cuda:<local_rank>``.

    Raises:
        ValueError: an indexed CUDA device (``cuda:1``), another device type, or fewer GPUs than workers.
    """
    if device == "cpu":
        return "cpu"
    if device not in (None, "cuda"):
        raise ValueError(f"--device {device!r} with several processes: pass --device cuda (worker i uses cuda:i) "
                         f"or --device cpu")
    import torch

    found = torch.cuda.device_count()
    if local_rank >= found:
        raise ValueError(f"worker {local_rank} needs cuda:{local_rank} but {found} GPU(s) are visible; lower "
                         f"--devices, or pass --device cpu")
    return f"cuda:{local_rank}"


def free_port() -> int:
    """A free TCP port on localhost (for a spawned group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def worker_group(device: str | None, rank: int, world_size: int, local_rank: int, init_method: str) -> Iterator[str]:
    """Join the gloo group as ``rank`` of ``world_size`` and yield this worker's device (:func:`worker_device`);
    CPU workers split the cores, GPU workers make their GPU current (Triton / fla kernels launch there). The group
    is destroyed on exit."""
    import torch
    import torch.distributed as dist

    dev = worker_device(device, local_rank)
    if dev == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    else:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=BARRIER_TIMEOUT_S))
    try:
        yield dev
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, work: Work, world_size: int, device: str | None, init_method: str, result_path: str) -> None:
    with worker_group(device, rank, world_size, rank, init_method) as dev:
        result = work(dev, rank, world_size)
    if rank == 0:
        atomic_write_json(result_path, result)


def run_workers(work: Work, devices: int, device: str | None) -> Any:
    """Run ``work`` data-parallel. Under torchrun (``WORLD_SIZE`` > 1) this process is one worker (rendezvous
    through ``MASTER_ADDR`` / ``MASTER_PORT``); otherwise ``devices`` workers are spawned and this process waits.

    Returns:
        Rank 0's result; None on other torchrun ranks.

    Raises:
        ValueError: ``devices`` disagrees with torchrun's ``WORLD_SIZE``, or fewer GPUs than workers.
        torch.multiprocessing.ProcessRaisedException: a spawned worker failed (its traceback is in the message).
    """
    world = launched_world_size()
    if world > 1:
        if devices not in (1, world):
            raise ValueError(f"--devices {devices} under torchrun with WORLD_SIZE={world}: drop --devices (the "
                             f"torchrun processes are the workers) or make them equal")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        with worker_group(device, rank, world, local_rank, "env://") as dev:
            result = work(dev, rank, world)
        return result if rank == 0 else None
    import torch.multiprocessing as mp

    for rank in range(devices):
        worker_device(device, rank)  # fail here, before spawning, when GPUs are missing
    with tempfile.TemporaryDirectory(prefix="hylo-workers-") as tmp:
        result_path = Path(tmp) / "result.json"
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.spawn(_spawned, args=(work, devices, device, init_method, str(result_path)), nprocs=devices, join=True)
        return json.loads(result_path.read_text())
