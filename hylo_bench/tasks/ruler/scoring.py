"""RULER scoring: prediction post-processing, string-match metrics, per-task scores on a 0-100 scale.

Source: lm-evaluation-harness 0.4.13 ``lm_eval/tasks/ruler/common_utils.py`` (``postprocess_pred``,
``string_match_all``, ``string_match_part``) and NVIDIA/RULER ``scripts/eval/synthetic/constants.py``
(ruler.md section 6).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

from hylo_bench.tasks.ruler.registry import FLAVORS, get_task
from hylo_bench.text.think import strip_think as _strip_think

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(prediction: str) -> str:
    """Strip, replace control characters ``\\x00-\\x1f`` by ``\\n``, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, golds: Sequence[str]) -> float:
    """Fraction of golds found in the prediction (case-insensitive substring), in [0, 1]; partial credit."""
    if not golds:
        raise ValueError("golds must hold at least one string")
    pred = prediction.lower()
    return sum(1.0 for gold in golds if gold.lower() in pred) / len(golds)


def string_match_part(prediction: str, golds: Sequence[str], flavor: str = "nvidia") -> float:
    """QA metric for one sample, in [0, 1].

    ``flavor="nvidia"`` (NVIDIA/RULER ``constants.py``): 1 if any gold occurs, else 0. ``flavor="lm-eval"``
    (0.4.13): lm-eval takes the max over *samples* of the per-sample fraction and calls it with one sample, so it
    equals
    :func:`string_match_all` (ruler.md sections 6 and 8 row 1).

    Raises:
        ValueError: unknown flavor or empty golds.
    """
    if flavor == "lm-eval":
        return string_match_all(prediction, golds)
    if flavor != "nvidia":
        raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}; got {flavor!r}")
    if not golds:
        raise ValueError("golds must hold at least one string")
    pred = prediction.lower()
    return 1.0 if any(gold.lower() in pred for gold in golds) else 0.0


def score_prediction(task: str, prediction: str, golds: Sequence[str], flavor: str = "nvidia",
                     strip_think: bool = False) -> float:
    """Score one raw model continuation against the gold list with the task's metric, in [0, 1].

    The prediction is post-processed first: ``<think>`` spans removed when ``strip_think``
    (:func:`hylo_bench.text.think.strip_think`), then :func:`postprocess_pred`.

    Raises:
        ValueError: unknown task or flavor.
    """
    spec = get_task(task)
    pred = postprocess_pred(_strip_think(prediction) if strip_think else prediction)
    if spec.metric == "string_match_all":
        return string_match_all(pred, golds)
    return string_match_part(pred, golds, flavor=flavor)


def task_score(task: str, predictions: Sequence[str], golds: Sequence[Sequence[str]], flavor: str = "nvidia",
               strip_think: bool = False) -> dict:
    """Aggregate one (task, length): ``score`` = 100 x mean per-sample score, ``n``, ``nulls`` (empty predictions).

    ``strip_think`` removes ``<think>`` spans before scoring and before counting nulls (see ``score_prediction``).
    For ``string_match_part`` tasks (QA) the result also holds ``score_by_flavor`` = ``{flavor: score}`` for both
    flavors, since the two QA metrics differ (ruler.md section 6).

    Raises:
        ValueError: length mismatch or no samples.
    """
    if len(predictions) != len(golds) or not predictions:
        raise ValueError(f"need equal, non-zero numbers of predictions and golds; got {len(predictions)}, {len(golds)}")
    scores = [score_prediction(task, p, g, flavor, strip_think) for p, g in zip(predictions, golds)]
    nulls = sum(1 for p in predictions if not postprocess_pred(_strip_think(p) if strip_think else p))
    out = {"score": 100.0 * sum(scores) / len(scores), "n": len(scores), "nulls": nulls}
    if get_task(task).metric == "string_match_part":
        pairs = list(zip(predictions, golds))
        out["score_by_flavor"] = {
            f: 100.0 * sum(score_prediction(task, p, g, f, strip_think) for p, g in pairs) / len(pairs) for f in FLAVORS
        }
    return out


def mean_score(scores: Iterable[float]) -> float:
    """Unweighted mean of task scores (the per-length RULER number, ruler.md section 7)."""
    values = list(scores)
    if not values:
        raise ValueError("no task scores to average")
    return sum(values) / len(values)


def weighted_averages(means: Mapping[str | int, float]) -> dict[str, float]:
    """RULER's length-weighted averages of per-length scores (arXiv:2404.06654, NVIDIA/RULER README tables).

    Lengths are ranked ascending (rank 1 = shortest); ``wAvg (inc)`` weights rank i by i (long contexts count
    more), ``wAvg (dec)`` by k + 1 - i for k lengths: ``sum(w_i * s_i) / sum(w_i)``. Scores keep their scale.

    Args:
        means: ``{length in tokens (int or digit string): score}``.

    Returns:
        ``{"avg": plain mean, "weighted_avg_inc": ..., "weighted_avg_dec": ...}``.

    Raises:
        ValueError: no lengths.
    """
    if not means:
        raise ValueError("no per-length scores to average")
    scores = [score for _, score in sorted(means.items(), key=lambda kv: int(kv[0]))]
    k = len(scores)
    inc = sum((i + 1) * s for i, s in enumerate(scores)) / (k * (k + 1) / 2)
    dec = sum((k - i) * s for i, s in enumerate(scores)) / (k * (k + 1) / 2)
    return {"avg": sum(scores) / k, "weighted_avg_inc": inc, "weighted_avg_dec": dec}
