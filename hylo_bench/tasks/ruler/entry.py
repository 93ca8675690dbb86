"""``hylo-bench ruler``'s entry point: one process, several (:mod:`hylo_bench.tasks.ruler.parallel`), or lm-eval's
own RULER tasks (:mod:`hylo_bench.tasks.ruler.lm_eval_backend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hylo_bench.io_utils import OnResult
from hylo_bench.tasks.ruler.parallel import run_parallel
from hylo_bench.tasks.ruler.runner import RulerConfig, evaluate_model
from hylo_bench.tasks.workers import launched_world_size

if TYPE_CHECKING:
    from rich.console import Console


def run(cfg: RulerConfig, *, console: Console | None = None, on_result: OnResult | None = None) -> dict | None:
    """Load ``cfg.model`` with ``hylo_bench.models.loading.load_model`` and evaluate it, in one process or, with
    ``cfg.devices`` > 1 or under ``torchrun``, in several (:func:`hylo_bench.tasks.ruler.parallel.run_parallel`).

    ``on_result(doc, path)`` is called with the results file's content each time it is rewritten (after every
    (task, length)); the CLI passes the results store's ``record`` (None: files only).

    Returns:
        The summary of :func:`evaluate_model` (the ``--json`` object); None on torchrun ranks other than 0.
    """
    if cfg.backend == "lm-eval":
        if launched_world_size() > 1:
            raise ValueError("--backend lm-eval runs in one process; launch it without torchrun")
        from hylo_bench.tasks.ruler.lm_eval_backend import run_lm_eval  # lm-eval loads only for this backend

        return run_lm_eval(cfg, console=console, on_result=on_result)
    if cfg.devices > 1 or launched_world_size() > 1:
        return run_parallel(cfg, console=console, on_result=on_result)
    from hylo_bench.models.loading import load_model

    model, tokenizer, info = load_model(cfg.model, device=cfg.device)
    return evaluate_model(model, tokenizer, info, cfg, console=console, on_result=on_result)
