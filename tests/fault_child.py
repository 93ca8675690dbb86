"""Child processes of the crash tests (tests/test_faults.py): one ``hylo-bench`` command per process, forked from
a multiprocessing forkserver that has imported torch, transformers and hylo-bench once (a fresh interpreter per
command would spend most of the test importing them), killed by ``io_utils.fault_point`` with SIGKILL."""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

PRELOAD = ["torch", "transformers", "hylo_bench.cli", "hylo_bench.upcycle.run", "hylo_bench.upcycle.train.trainer",
           "hylo_bench.upcycle.transfer", "hylo_bench.models.hybrid", "hylo_bench.tasks.ruler.runner",
           "hylo_bench.reports.store"]


def _main(argv: list[str], env: dict[str, str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)  # the same reductions in every child: bit-identical weights need it
    from hylo_bench.cli import app

    try:
        app(argv, prog_name="hylo-bench")
    except SystemExit as e:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    os._exit(0)


def context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run(ctx, argv: list[str], env: dict[str, str], log: Path, timeout_s: float = 300.0) -> int:
    """Run one command in a forked child; its exit code (-9 when ``fault_point`` killed it)."""
    proc = ctx.Process(target=_main, args=(argv, env, str(log)))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"{argv}: still running after {timeout_s} s; log {log}")
    return proc.exitcode
