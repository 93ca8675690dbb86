"""RULER (arXiv:2404.06654) for hylo-bench: the 11 synthetic tasks with lm-eval 0.4.13 prompts, generation sized
to each model's tokenizer, string-match scoring, and a cached, resumable runner.

Spec: /work/shared/reference/ruler.md. Public API: ``generate_sample``, ``score_prediction``, ``TASKS``,
``list_tasks``, ``RulerConfig``, ``run``, ``evaluate_model``, ``render_tables``.
"""

from hylo_bench.tasks.ruler.cache import load_or_generate, tokenizer_hash
from hylo_bench.tasks.ruler.registry import TASKS, RulerTask, get_task, list_tasks
from hylo_bench.tasks.ruler.runner import RulerConfig, evaluate_model, render_tables, run
from hylo_bench.tasks.ruler.sampling import generate_sample, sample_seed
from hylo_bench.tasks.ruler.scoring import (
    postprocess_pred,
    score_prediction,
    string_match_all,
    string_match_part,
    task_score,
)

__all__ = [
    "TASKS",
    "RulerConfig",
    "RulerTask",
    "evaluate_model",
    "generate_sample",
    "get_task",
    "list_tasks",
    "load_or_generate",
    "postprocess_pred",
    "render_tables",
    "run",
    "sample_seed",
    "score_prediction",
    "string_match_all",
    "string_match_part",
    "task_score",
    "tokenizer_hash",
]
