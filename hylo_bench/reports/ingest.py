"""Recognise and parse result files for the results store: one :class:`RunRecord` per file, nothing written.

Kinds: ``ruler`` (our RULER results file), ``ruler-json`` (``hylo-bench ruler --json``), ``upcycle`` (manifest.json),
``benchmark`` (``benchmarks/results/*.json``), ``sweep`` (``hylo-bench sweep`` results: a benchmark JSON with
``"kind": "sweep"`` that grows point by point) and ``lm-eval`` (lm-eval 0.4 ``results_*.json``). Scores are 0-100.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from hylo_bench.config.units import LM_EVAL_PERCENT_METRICS
from hylo_bench.io_utils import utc_now
from hylo_bench.reports.results import parse_manifest, parse_ruler_run

KINDS = ("ruler", "ruler-json", "upcycle", "benchmark", "sweep", "lm-eval", "eval-json", "eval-summary")
# Keys a RULER results file / upcycle manifest gains while its run goes on; the natural key leaves them out so
# re-importing a grown file extends the same run instead of adding a new one.
_RULER_GROWING = ("records", "mean", "avg", "weighted_avg_inc", "weighted_avg_dec", "status")
_MANIFEST_GROWING = ("stages", "kl_init", "final_checkpoint", "finished_utc", "model_hash")
RUN_STATUSES = ("running", "complete")
"""``running``: the command was still writing the file (or was killed); ``complete``: it finished. Files written
before statuses existed are complete."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Metric:
    """One scalar result. ``seq_len`` is the context length in tokens (``None`` when it does not apply);
    ``n`` the number of scored samples, ``stderr`` the standard error in the units of ``value``."""

    task: str
    seq_len: int | None
    metric: str
    value: float
    n: int | None
    stderr: float | None
    flavor: str | None
    extra: dict[str, Any] | None = None


@dataclasses.dataclass(kw_only=True, slots=True)
class RunRecord:
    """Everything one source object puts into the store. ``natural_key`` makes re-imports idempotent."""

    natural_key: str
    kind: str
    source: str
    model: str
    checkpoint: str | None
    model_hash: str | None
    layout: str | None
    git_sha: str | None
    hylo_bench_version: str | None
    device: str | None
    config: dict[str, Any]
    created_utc: str
    metrics: list[Metric]
    train_log: list[dict[str, Any]]
    points: list[dict[str, Any]]
    status: str = "complete"  # one of RUN_STATUSES


def check_value(value: Any, where: str, scale: str) -> float:
    """A metric value checked by kind: ``scale`` is ``"proportion"`` (in [0, 1]), ``"score"`` (in [0, 100]) or
    ``"finite"`` (any finite number).

    Raises:
        ValueError: naming ``where`` (the field) and the value: not a number, NaN / infinite, or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    lo, hi = {"proportion": (0.0, 1.0), "score": (0.0, 100.0), "finite": (-math.inf, math.inf)}[scale]
    if not lo <= value <= hi:
        what = "a proportion in [0, 1]" if scale == "proportion" else "a score in [0, 100]"
        raise ValueError(f"{where}: expected {what}, got {value!r}")
    return float(value)


def _percent_metric(name: str) -> bool:
    """Whether a metric (``acc`` or ``exact_match,strict-match``) is an accuracy-like share (0-1 in lm-eval)."""
    return name.partition(",")[0] in LM_EVAL_PERCENT_METRICS


def content_hash(obj: Any) -> str:
    """Hex SHA-256 of ``obj`` as canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def detect_kind(obj: Any) -> str:
    """Name the kind of a parsed results object (one of :data:`KINDS`).

    Raises:
        ValueError: the object matches none of the known shapes; the message lists what was looked for.
    """
    if isinstance(obj, dict):
        if obj.get("kind") == "ruler":
            return "ruler"
        if obj.get("kind") == "upcycle":
            return "upcycle"
        if obj.get("kind") == "sweep" and "records" in obj:
            return "sweep"
        if "benchmark" in obj and "records" in obj:
            return "benchmark"
        if isinstance(obj.get("results"), dict) and ("n-samples" in obj or "config" in obj or "versions" in obj):
            return "lm-eval"
        if obj.get("kind") == "lm-eval-summary":
            return "eval-summary"
        if {"model", "scores", "mean"} <= obj.keys():
            return "ruler-json"
        if {"model", "scores"} <= obj.keys() and ("n_samples" in obj or "num_fewshot" in obj):
            return "eval-json"
        shown = ", ".join(sorted(obj)[:8])
        raise ValueError(f"unknown results format (top-level keys: {shown or 'none'}); expected a RULER results "
                         "file (\"kind\": \"ruler\"), `ruler --json` or `eval --json` output, an upcycle "
                         "manifest.json, a benchmark JSON (\"benchmark\" + \"records\"), an lm-eval results_*.json "
                         "or an `eval` summary (eval-*.json)")
    raise ValueError(f"unknown results format: top level is a {type(obj).__name__}, expected a JSON object")


def _iso(text: str) -> str:
    ts = datetime.fromisoformat(text)
    ts = ts.replace(tzinfo=timezone.utc) if ts.tzinfo is None else ts.astimezone(timezone.utc)
    return ts.isoformat(timespec="seconds")


def _without(obj: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


def _ruler_file(obj: dict[str, Any], source: str) -> RunRecord:
    rows = parse_ruler_run(obj, source)  # validates; raises ValueError naming the field
    model = obj["model"]
    extra_keys = ("nulls", "seed", "prompt_tokens_mean", "prompt_tokens_min", "prompt_tokens_max")
    optional = ("generator_version", "score_by_flavor")  # newer files only; QA records carry both flavors' scores
    metrics = [Metric(task=r["task"], seq_len=r["seq_len"], metric="score", value=r["score"], n=r["n"], stderr=None,
                      flavor=r["flavor"],
                      extra={k: r[k] for k in extra_keys} | {k: rec[k] for k in optional if k in rec})
               for r, rec in zip(rows, obj["records"])]
    status = obj.get("status", "complete")
    if status not in RUN_STATUSES:
        raise ValueError(f"status: expected one of {RUN_STATUSES}, got {status!r}")
    header = _without(obj, _RULER_GROWING)
    return RunRecord(natural_key=content_hash(header), kind="ruler", source=source, model=model["name"],
                     checkpoint=model["path"], model_hash=model["hash"], layout=model["layout"], git_sha=obj["git_sha"],
                     hylo_bench_version=obj["hylo_bench_version"], device=(obj.get("config") or {}).get("device"),
                     config=header, created_utc=_iso(obj["created_utc"]), metrics=metrics, train_log=[], points=[],
                     status=status)


def _ruler_json(obj: dict[str, Any], source: str) -> RunRecord:
    if not isinstance(obj["model"], str) or not obj["model"]:
        raise ValueError(f"model: expected a non-empty string, got {obj['model']!r}")
    if not isinstance(obj["scores"], dict):
        raise ValueError(f"scores: expected {{task: {{length: score}}}}, got {type(obj['scores']).__name__}")
    metrics = []
    for task, by_len in obj["scores"].items():
        if not isinstance(by_len, dict):
            raise ValueError(f"scores.{task}: expected {{length: score}}, got {type(by_len).__name__}")
        for length, score in by_len.items():
            ok = str(length).isdigit() and isinstance(score, (int, float)) and not isinstance(score, bool)
            if not ok or not 0.0 <= score <= 100.0:
                raise ValueError(f"scores.{task}.{length}: expected an integer length and a score in 0-100, "
                                 f"got {length!r}: {score!r}")
            # `ruler --json` output written before flavors existed is lm-eval flavored
            metrics.append(Metric(task=task, seq_len=int(length), metric="score", value=float(score), n=None,
                                  stderr=None, flavor=str(obj.get("flavor", "lm-eval"))))
    if not metrics:
        raise ValueError("scores: expected at least one task score, got none")
    return RunRecord(natural_key=content_hash(obj), kind="ruler-json", source=source, model=obj["model"],
                     checkpoint=None, model_hash=None, layout=None, git_sha=None, hylo_bench_version=None, device=None,
                     config={k: v for k, v in obj.items() if k not in ("scores", "mean")},
                     created_utc=utc_now(), metrics=metrics, train_log=[], points=[])


def _manifest(obj: dict[str, Any], source: str) -> RunRecord:
    for key in ("created_utc", "config"):
        if key not in obj:
            raise ValueError(f"{key}: missing key")
    out = str((obj["config"] or {}).get("out") or Path(source).parent)
    label = Path(out).name or out
    rows = parse_manifest(obj, label, source)
    train = [{k: r[k] for k in ("stage_index", "stage", "stage_kind", "stage_seq_len", "tokens_seen", "step", "loss",
                                 "tokens")} for r in rows]
    hcfg = obj.get("hybrid_config") or {}
    header = _without(obj, _MANIFEST_GROWING)
    model_hash = obj.get("model_hash")
    if model_hash is not None and not isinstance(model_hash, str):
        raise ValueError(f"model_hash: expected a hex string, got {model_hash!r}")
    return RunRecord(natural_key=content_hash(header), kind="upcycle", source=source, model=label,
                     checkpoint=out, model_hash=model_hash, layout=_layout(hcfg), git_sha=obj.get("git_sha"),
                     hylo_bench_version=obj.get("hylo_bench_version"), device=obj.get("device"), config=header,
                     created_utc=_iso(obj["created_utc"]), metrics=[], train_log=train, points=[],
                     status="complete" if obj.get("finished_utc") else "running")


def _layout(hybrid_config: dict[str, Any]) -> str | None:
    types = hybrid_config.get("layer_types")
    if not isinstance(types, list) or not types:
        return None
    return "".join(f"{types.count(t)}{t.upper()}" for t in dict.fromkeys(types))


_MEASURE_SUFFIXES = ("_s", "_gib", "_bytes", "_tokens", "_per_s", "_pct", "_flops")


def _is_measure(key: str) -> bool:
    """Record keys that carry a measured quantity by the benchmark convention (unit in the name: ``ttft_s``,
    ``peak_memory_gib``, ``tokens_per_s``, ``mfu``, ``seq_len``...): they must be numbers (or null)."""
    return key in ("seq_len", "batch_size", "mfu", "n_gpus") or key.endswith(_MEASURE_SUFFIXES)


def _benchmark(obj: dict[str, Any], source: str, *, allow_empty: bool = False) -> RunRecord:
    if not isinstance(obj["benchmark"], str) or not obj["benchmark"]:
        raise ValueError(f"benchmark: expected a non-empty string, got {obj['benchmark']!r}")
    records = obj["records"]
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError("records: expected a list of flat objects")
    if not records and not allow_empty:  # a sweep file starts empty and grows point by point
        raise ValueError("records: expected at least one record, got none")
    for i, rec in enumerate(records):
        nested = [k for k, v in rec.items() if isinstance(v, (dict, list))]
        if nested:
            raise ValueError(f"records[{i}]: expected a flat record, but {nested} hold nested values")
        for key, value in rec.items():
            if value is None or key == "seq_len" or not _is_measure(key):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"records[{i}].{key}: expected a number (or null), got {value!r}")
            check_value(value, f"records[{i}].{key}", "finite")
        if "seq_len" in rec and rec["seq_len"] is not None and (
                not isinstance(rec["seq_len"], int) or isinstance(rec["seq_len"], bool) or rec["seq_len"] <= 0):
            raise ValueError(f"records[{i}].seq_len: expected a positive number of tokens, got {rec['seq_len']!r}")
    created = _iso(obj["created_utc"]) if isinstance(obj.get("created_utc"), str) else utc_now()
    points = [{"idx": i, "benchmark": obj["benchmark"], "record": rec} for i, rec in enumerate(records)]
    return RunRecord(natural_key=content_hash(obj), kind="benchmark", source=source, model=obj["benchmark"],
                     checkpoint=None, model_hash=None, layout=obj.get("student_layout"), git_sha=obj.get("git_sha"),
                     hylo_bench_version=None, device=obj.get("device"), config=_without(obj, ("records",)),
                     created_utc=created, metrics=[], train_log=[], points=points)


def _sweep(obj: dict[str, Any], source: str) -> RunRecord:
    """A ``hylo-bench sweep`` file: benchmark records, but the run is keyed on everything except the growing
    ``records`` (and ``device``, filled in by the first point), so re-importing a grown file adds only new points."""
    rec = _benchmark(obj, source, allow_empty=True)
    rec.kind = "sweep"
    rec.natural_key = content_hash(_without(obj, ("records", "device")))
    rec.model = str(obj.get("model") or obj["benchmark"])
    return rec


def _lm_eval(obj: dict[str, Any], source: str) -> RunRecord:
    cfg = obj.get("config") or {}
    n_samples = obj.get("n-samples") or {}
    metrics = []
    for task, res in obj["results"].items():
        if not isinstance(res, dict):
            raise ValueError(f"results.{task}: expected an object of metrics, got {type(res).__name__}")
        n = (n_samples.get(task) or {}).get("effective")
        for key, value in res.items():
            name, _, filt = key.partition(",")
            if not filt or "_stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            stderr = res.get(f"{name}_stderr,{filt}")
            stderr = float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr) else None
            percent = name in LM_EVAL_PERCENT_METRICS
            value = check_value(value, f"results.{task}.{key}", "proportion" if percent else "finite")
            scale = 100.0 if percent else 1.0
            metrics.append(Metric(task=task, seq_len=None, metric=name if filt == "none" else f"{name},{filt}",
                                  value=value * scale, n=n if isinstance(n, int) else None,
                                  stderr=None if stderr is None else stderr * scale, flavor="lm-eval"))
    if not metrics:
        raise ValueError("results: no numeric 'metric,filter' entries found")
    model_args = str(cfg.get("model_args") or "")
    args = dict(a.split("=", 1) for a in model_args.split(",") if "=" in a)
    checkpoint = args.get("pretrained") or cfg.get("model_name")
    model = obj.get("model_name") or checkpoint or str(cfg.get("model") or "")
    if not model:
        raise ValueError("model_name / config.model_args: cannot tell which model was evaluated")
    date = obj.get("date")
    created = datetime.fromtimestamp(date, timezone.utc).isoformat(timespec="seconds") \
        if isinstance(date, (int, float)) else utc_now()
    ours = cfg.get("hylo_model") if isinstance(cfg.get("hylo_model"), dict) else {}  # `hylo-bench eval` adds it
    model_hash = ours.get("hash") if isinstance(ours.get("hash"), str) else None
    return RunRecord(natural_key=content_hash(obj), kind="lm-eval", source=source, model=str(model),
                     checkpoint=None if checkpoint is None else str(checkpoint), model_hash=model_hash,
                     layout=ours.get("layout") if isinstance(ours.get("layout"), str) else None,
                     git_sha=obj.get("git_hash"), hylo_bench_version=None,
                     device=None if cfg.get("device") is None else str(cfg.get("device")),
                     config={k: obj[k] for k in ("config", "versions", "n-shot", "n-samples") if k in obj},
                     created_utc=created, metrics=metrics, train_log=[], points=[])


def _eval_scores(obj: dict[str, Any], n_samples: dict[str, Any]) -> list[Metric]:
    """Metrics of ``{"scores": {task: {metric: value}}}`` (``hylo-bench eval`` output: already 0-100)."""
    if not isinstance(obj["scores"], dict) or not obj["scores"]:
        raise ValueError("scores: expected {task: {metric: value}} with at least one task")
    metrics = []
    for task, by_metric in obj["scores"].items():
        if not isinstance(by_metric, dict):
            raise ValueError(f"scores.{task}: expected {{metric: value}}, got {type(by_metric).__name__}")
        n = n_samples.get(task)
        n = n.get("effective") if isinstance(n, dict) else n
        for metric, value in by_metric.items():
            value = check_value(value, f"scores.{task}.{metric}", "score" if _percent_metric(metric) else "finite")
            metrics.append(Metric(task=task, seq_len=None, metric=metric, value=value,
                                  n=n if isinstance(n, int) else None, stderr=None, flavor="lm-eval"))
    return metrics


def _eval_json(obj: dict[str, Any], source: str) -> RunRecord:
    """``hylo-bench eval --json`` output: ``{"model", "scores", "n_samples", "num_fewshot", ...}``."""
    if not isinstance(obj["model"], str) or not obj["model"]:
        raise ValueError(f"model: expected a non-empty string, got {obj['model']!r}")
    metrics = _eval_scores(obj, obj.get("n_samples") or {})
    return RunRecord(natural_key=content_hash(obj), kind="eval-json", source=source, model=obj["model"],
                     checkpoint=None, model_hash=None, layout=None, git_sha=None, hylo_bench_version=None, device=None,
                     config={k: v for k, v in obj.items() if k != "scores"}, created_utc=utc_now(), metrics=metrics,
                     train_log=[], points=[])


def _eval_summary(obj: dict[str, Any], source: str) -> RunRecord:
    """Our ``eval-<model>-<time>.json`` (``kind: lm-eval-summary``): model block, config, scores 0-100."""
    model = obj["model"]
    if not isinstance(model, dict) or not model.get("name"):
        raise ValueError(f"model: expected an object with a name, got {model!r}")
    metrics = _eval_scores(obj, obj.get("n-samples") or {})
    return RunRecord(natural_key=content_hash(obj), kind="eval-summary", source=source, model=str(model["name"]),
                     checkpoint=model.get("path"), model_hash=model.get("hash"), layout=model.get("layout"),
                     git_sha=obj.get("git_sha"), hylo_bench_version=obj.get("hylo_bench_version"),
                     device=(obj.get("config") or {}).get("device"), config=_without(obj, ("scores",)),
                     created_utc=_iso(obj["created_utc"]), metrics=metrics, train_log=[], points=[])




_PARSERS = {"ruler": _ruler_file, "ruler-json": _ruler_json, "upcycle": _manifest, "benchmark": _benchmark,
            "sweep": _sweep, "lm-eval": _lm_eval, "eval-json": _eval_json, "eval-summary": _eval_summary}


def parse_object(obj: Any, source: str) -> RunRecord:
    """Detect the kind of ``obj`` and turn it into a :class:`RunRecord` (``source`` names it in the store).

    Raises:
        ValueError: unknown kind or invalid content; the message names the field (not the file).
    """
    kind = detect_kind(obj)
    try:
        return _PARSERS[kind](obj, source)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{kind} object: malformed ({type(exc).__name__}: {exc})") from None
    except ValueError as exc:
        raise ValueError(f"{kind} object: {exc}") from None


def parse_file(path: str | Path) -> RunRecord:
    """Read and parse one results file.

    Raises:
        ValueError: ``"<path>: <reason>"`` for an unreadable file, invalid JSON (e.g. truncated), an unknown
            format or invalid content.
    """
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the file ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); the file may be truncated") from None
    try:
        return parse_object(obj, str(path))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
