"""Multi-process RULER: shard the samples of every (task, length) over N worker processes (one per GPU, or all on
CPU), each loading the model itself; rank 0 merges the per-sample predictions and scores. Started either by
``hylo-bench ruler --devices N`` (``torch.multiprocessing`` spawn) or by ``torchrun`` (``RANK`` / ``WORLD_SIZE``
/ ``LOCAL_RANK``); the process handling is :mod:`hylo_bench.tasks.workers`. Processes meet at
``torch.distributed`` (gloo) barriers only; no tensors are exchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from hylo_bench.io_utils import OnResult
from hylo_bench.tasks.ruler.runner import RulerConfig, Shard, evaluate_model
from hylo_bench.tasks.workers import launched_world_size, run_workers, worker_device

__all__ = ["launched_world_size", "run_parallel", "worker_device"]


def _evaluate_shard(cfg: RulerConfig, console: Any, on_result: OnResult | None, device: str, rank: int,
                    world_size: int) -> dict | None:
    """One worker: load the model on ``device`` and evaluate its shard; the summary on rank 0, None elsewhere."""
    import torch.distributed as dist

    from hylo_bench.models.loading import load_model

    model, tokenizer, info = load_model(cfg.model, device=device)
    shard = Shard(rank=rank, world_size=world_size, barrier=dist.barrier)
    return evaluate_model(model, tokenizer, info, cfg, console=console, shard=shard, on_result=on_result)


def run_parallel(cfg: RulerConfig, *, console: Any = None, on_result: OnResult | None = None) -> dict | None:
    """Evaluate ``cfg`` in several processes (:func:`hylo_bench.tasks.workers.run_workers`: this process is one
    torchrun worker, or ``cfg.devices`` workers are spawned). Scores and predictions equal a one-process run's
    (each sample is decoded alone with the same model). ``on_result`` runs on rank 0 (it must pickle to be
    spawned: the store's ``recorder`` does).

    Returns:
        Rank 0's summary (:func:`hylo_bench.tasks.ruler.runner.evaluate_model`); None on other torchrun ranks.

    Raises:
        ValueError: ``cfg.devices`` disagrees with torchrun's ``WORLD_SIZE``, or too few GPUs.
        torch.multiprocessing.ProcessRaisedException: a worker failed (its traceback is in the message).
    """
    # only a torchrun worker shows progress in this process's console; spawned workers get none (not picklable)
    work = functools.partial(_evaluate_shard, cfg, console if launched_world_size() > 1 else None, on_result)
    return run_workers(work, cfg.devices, cfg.device)

