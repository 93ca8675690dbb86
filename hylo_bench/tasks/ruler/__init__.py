"""RULER (arXiv:2404.06654) for hylo-bench: the 13 tasks (11 synthetic, 2 QA from local SQuAD / HotpotQA files)
in two flavors (NVIDIA/RULER's prompts or lm-eval 0.4.13's port), generation sized to each model's tokenizer,
string-match scoring, length-weighted averages, and a cached runner that stores per-sample predictions (resumable
mid-(task, length)), shards samples over processes (``parallel``) and decodes through ``generate()`` or the native
serving engine (:mod:`hylo_bench.decode.greedy`); ``backend="lm-eval"`` runs lm-eval 0.4.13's own ruler tasks instead
(``lm_eval_backend``).

Spec: docs/ruler.md §1-11; differences between flavors: docs/ruler.md §12. Public API: ``generate_sample``,
``score_prediction``, ``TASKS``, ``list_tasks``, ``select_tasks``, ``RulerConfig``, ``run``, ``evaluate_model``,
``render_tables``, ``weighted_averages``, ``load_qa``.
"""

from hylo_bench.tasks.ruler.cache import load_or_generate, tokenizer_hash
from hylo_bench.tasks.ruler.entry import run
from hylo_bench.tasks.ruler.qa import QA_SOURCES, load_qa, locate_qa_file
from hylo_bench.tasks.ruler.registry import FLAVORS, TASKS, RulerTask, get_task, list_tasks
from hylo_bench.tasks.ruler.runner import BACKENDS, RulerConfig, evaluate_model, render_tables, select_tasks
from hylo_bench.tasks.ruler.sampling import generate_sample, sample_seed
from hylo_bench.tasks.ruler.scoring import (
    postprocess_pred,
    score_prediction,
    string_match_all,
    string_match_part,
    task_score,
    weighted_averages,
)

__all__ = [
    "BACKENDS",
    "FLAVORS",
    "QA_SOURCES",
    "TASKS",
    "RulerConfig",
    "RulerTask",
    "evaluate_model",
    "generate_sample",
    "get_task",
    "list_tasks",
    "load_or_generate",
    "load_qa",
    "locate_qa_file",
    "postprocess_pred",
    "render_tables",
    "run",
    "sample_seed",
    "score_prediction",
    "select_tasks",
    "string_match_all",
    "string_match_part",
    "task_score",
    "tokenizer_hash",
    "weighted_averages",
]
