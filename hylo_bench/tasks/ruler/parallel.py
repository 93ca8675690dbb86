"""Multi-process RULER: shard the samples of every (task, length) over N worker processes (one per GPU, or all on
CPU), each loading the model itself; rank 0 merges the per-sample predictions and scores. Started either by
``hylo-bench ruler --devices N`` (``torch.multiprocessing`` spawn) or by ``torchrun`` (``RANK`` / ``WORLD_SIZE``
/ ``LOCAL_RANK``). Processes meet at ``torch.distributed`` (gloo) barriers only; no tensors are exchanged.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

from hylo_bench.io_utils import atomic_write_json
from hylo_bench.tasks.ruler.runner import RulerConfig, Shard, evaluate_model

BARRIER_TIMEOUT_S = 24 * 3600
"""Longest wait at a barrier: one (task, length) on the slowest worker, or rank 0 generating its samples."""


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


def run_rank(cfg: RulerConfig, rank: int, world_size: int, local_rank: int, init_method: str,
             console: Any = None) -> dict | None:
    """One worker: join the gloo group, load the model on its device, evaluate its shard.

    Returns:
        The summary of :func:`hylo_bench.tasks.ruler.runner.evaluate_model` on rank 0, None elsewhere.
    """
    import torch
    import torch.distributed as dist

    from hylo_bench.models.loading import load_model

    device = worker_device(cfg.device, local_rank)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    else:  # Triton / FLA kernels launch on the current device
        torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=BARRIER_TIMEOUT_S))
    try:
        model, tokenizer, info = load_model(cfg.model, device=device)
        shard = Shard(rank=rank, world_size=world_size, barrier=dist.barrier)
        return evaluate_model(model, tokenizer, info, cfg, console=console, shard=shard)
    finally:
        dist.destroy_process_group()


def _worker(rank: int, cfg: RulerConfig, world_size: int, init_method: str, summary_path: str) -> None:
    summary = run_rank(cfg, rank, world_size, rank, init_method)
    if rank == 0:
        atomic_write_json(summary_path, summary)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_parallel(cfg: RulerConfig, *, console: Any = None) -> dict | None:
    """Evaluate ``cfg`` in several processes.

    Under torchrun (``WORLD_SIZE`` > 1) this process is one worker (``RANK``, ``LOCAL_RANK``; rendezvous through
    ``MASTER_ADDR`` / ``MASTER_PORT``). Otherwise ``cfg.devices`` workers are spawned and this process waits for
    them. Scores and predictions equal a one-process run's (each sample is decoded alone with the same model).

    Returns:
        Rank 0's summary (:func:`hylo_bench.tasks.ruler.runner.evaluate_model`); None on other torchrun ranks.

    Raises:
        ValueError: ``cfg.devices`` disagrees with torchrun's ``WORLD_SIZE``, or too few GPUs.
        torch.multiprocessing.ProcessRaisedException: a worker failed (its traceback is in the message).
    """
    world = launched_world_size()
    if world > 1:
        if cfg.devices not in (1, world):
            raise ValueError(f"--devices {cfg.devices} under torchrun with WORLD_SIZE={world}: drop --devices (the "
                             f"torchrun processes are the workers) or make them equal")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        return run_rank(cfg, rank, world, local_rank, "env://", console)
    import torch.multiprocessing as mp

    for rank in range(cfg.devices):
        worker_device(cfg.device, rank)  # fail here, before spawning, when GPUs are missing
    with tempfile.TemporaryDirectory(prefix="hylo-ruler-") as tmp:
        summary_path = Path(tmp) / "summary.json"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        mp.spawn(_worker, args=(cfg, cfg.devices, init_method, str(summary_path)), nprocs=cfg.devices, join=True)
        return json.loads(summary_path.read_text())
