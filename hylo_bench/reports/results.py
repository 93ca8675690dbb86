"""Load and validate result files (RULER runs, upcycle manifests) from a results directory into tidy pandas frames.

Scores are on a 0-100 scale; lengths and token counts are in tokens. Never imports torch.
"""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

logger = logging.getLogger(__name__)

RULER_KIND = "ruler"
UPCYCLE_KIND = "upcycle"
MODEL_KINDS = ("hybrid", "transformer")
HASH_PREFIX_CHARS = 12

_NUMBER = (int, float)
_RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "hylo_bench_version": (str,),
    "git_sha": (str,),
    "created_utc": (str,),
    "model": (dict,),
    "tokenizer_hash": (str,),
    "seed": (int,),
    "samples_per_task": (int,),
    "chat_template": (bool,),
    "flavor": (str,),
    "records": (list,),
    "mean": (dict,),
}
_MODEL_FIELDS: dict[str, tuple[type, ...]] = {key: (str,) for key in ("name", "path", "hash", "layout", "kind")}
_RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "task": (str,),
    "seq_len": (int,),
    "score": _NUMBER,
    "n": (int,),
    "seed": (int,),
    "nulls": (int,),
    "prompt_tokens_mean": _NUMBER,
    "prompt_tokens_min": (int,),
    "prompt_tokens_max": (int,),
}
_STAGE_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "seq_len_tokens": (int,),  # what `hylo-bench upcycle` writes; manifests of 0.1.0 test fixtures said seq_len
    "kind": (str,),
    "tokens_seen": (int,),
    "losses": (list,),
}
_LOSS_FIELDS: dict[str, tuple[type, ...]] = {"step": (int,), "loss": _NUMBER, "tokens": (int,)}

RESULT_COLUMNS = [
    "model", "model_layout", "model_kind", "model_hash", "model_path", "task", "seq_len", "score", "n", "nulls",
    "seed", "prompt_tokens_mean", "prompt_tokens_min", "prompt_tokens_max", "samples_per_task", "chat_template",
    "flavor", "tokenizer_hash", "git_sha", "hylo_bench_version", "created_utc", "run_file",
]  # fmt: skip
LOSS_COLUMNS = [
    "run", "manifest_file", "stage_index", "stage", "stage_kind", "stage_seq_len", "tokens_seen", "step", "loss",
    "tokens",
]  # fmt: skip


def _fix_hint(kind: str) -> str:
    cmd = "hylo-bench ruler" if kind == RULER_KIND else "hylo-bench upcycle"
    return f"re-run `{cmd}` or move the file out of the results directory"


def _check_fields(obj: Any, fields: dict[str, tuple[type, ...]], where: str) -> dict[str, Any]:
    """Check that ``obj`` is a dict holding every key of ``fields`` with an allowed type; return it.

    Raises:
        ValueError: naming ``where`` + key, the expected type and the received value.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where.rstrip('.') or 'top level'}: expected an object, got {type(obj).__name__}")
    for key, types in fields.items():
        if key not in obj:
            raise ValueError(f"{where}{key}: missing key")
        value = obj[key]
        # bool is a subclass of int; a JSON true/false is never a valid count or score.
        bad_bool = isinstance(value, bool) and bool not in types
        if bad_bool or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types)
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ValueError(f"{where}{key}: expected {expected}, got {shown} ({type(value).__name__})")
    return obj


def _parse_utc(text: str, where: str) -> datetime:
    """Parse an ISO 8601 timestamp; a naive timestamp is taken as UTC."""
    try:
        ts = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{where}: expected an ISO 8601 timestamp, got {text!r}") from None
    return ts.replace(tzinfo=timezone.utc) if ts.tzinfo is None else ts.astimezone(timezone.utc)


def parse_ruler_run(obj: dict[str, Any], run_file: str) -> list[dict[str, Any]]:
    """Validate one RULER results object and flatten it into tidy rows (one per record).

    Args:
        obj: The parsed JSON of a file with ``"kind": "ruler"``.
        run_file: How the file is named in the returned rows (path relative to the results directory).

    Returns:
        One dict per record with the keys of ``RESULT_COLUMNS``; scores 0-100, ``seq_len`` in tokens.

    Raises:
        ValueError: on a missing key, a wrong type, a score outside 0-100, a non-positive ``seq_len``, negative
            counts, or two records for the same task and length. The message names the field, not the file.
    """
    _check_fields(obj, _RUN_FIELDS, "")
    model = _check_fields(obj["model"], _MODEL_FIELDS, "model.")
    if not model["name"]:
        raise ValueError("model.name: expected a non-empty string, got ''")
    if model["kind"] not in MODEL_KINDS:
        raise ValueError(f"model.kind: expected one of {MODEL_KINDS}, got {model['kind']!r}")
    created = _parse_utc(obj["created_utc"], "created_utc")
    for key, value in obj["mean"].items():
        if not key.isdigit() or isinstance(value, bool) or not isinstance(value, _NUMBER):
            raise ValueError(f"mean: expected {{seq_len: score}} with integer keys, got {key!r}: {value!r}")
        if not 0.0 <= value <= 100.0:  # also rejects NaN
            raise ValueError(f"mean.{key}: expected a score in 0-100, got {value!r}")
    if not obj["records"]:
        raise ValueError("records: expected at least one record, got []")
    rows, seen = [], set()
    for i, rec in enumerate(obj["records"]):
        where = f"records[{i}]."
        _check_fields(rec, _RECORD_FIELDS, where)
        if not 0.0 <= rec["score"] <= 100.0:  # also rejects NaN
            raise ValueError(f"{where}score: expected a number in 0-100, got {rec['score']!r}")
        if rec["seq_len"] <= 0:
            raise ValueError(f"{where}seq_len: expected a positive token count, got {rec['seq_len']}")
        for key in ("n", "nulls"):
            if rec[key] < 0:
                raise ValueError(f"{where}{key}: expected a count >= 0, got {rec[key]}")
        if not math.isfinite(rec["prompt_tokens_mean"]) or rec["prompt_tokens_mean"] < 0:
            raise ValueError(f"{where}prompt_tokens_mean: expected a finite token count >= 0, got "
                             f"{rec['prompt_tokens_mean']!r}")
        if (rec["task"], rec["seq_len"]) in seen:
            raise ValueError(f"records[{i}]: duplicate record for task {rec['task']!r} at seq_len {rec['seq_len']}")
        seen.add((rec["task"], rec["seq_len"]))
        rows.append({
            "model": model["name"], "model_layout": model["layout"], "model_kind": model["kind"],
            "model_hash": model["hash"], "model_path": model["path"],
            **{key: rec[key] for key in _RECORD_FIELDS},
            "score": float(rec["score"]), "prompt_tokens_mean": float(rec["prompt_tokens_mean"]),
            "samples_per_task": obj["samples_per_task"], "chat_template": obj["chat_template"],
            "flavor": obj["flavor"], "tokenizer_hash": obj["tokenizer_hash"], "git_sha": obj["git_sha"],
            "hylo_bench_version": obj["hylo_bench_version"], "created_utc": created, "run_file": run_file,
        })  # fmt: skip
    return rows


def parse_manifest(obj: dict[str, Any], run: str, manifest_file: str) -> list[dict[str, Any]]:
    """Validate one upcycle manifest and flatten its loss logs into tidy rows (one per logged step).

    Args:
        obj: The parsed JSON of a file with ``"kind": "upcycle"``.
        run: Label of the upcycle run in the figure legend.
        manifest_file: Path of the manifest relative to the results directory.

    Returns:
        One dict per loss entry with the keys of ``LOSS_COLUMNS``; ``tokens`` and ``tokens_seen`` in tokens.

    Raises:
        ValueError: on a missing key or a wrong type, naming the field.
    """
    _check_fields(obj, {"stages": (list,)}, "")
    rows = []
    for i, stage in enumerate(obj["stages"]):
        if isinstance(stage, dict) and "seq_len_tokens" not in stage and "seq_len" in stage:
            stage = {**stage, "seq_len_tokens": stage["seq_len"]}
        _check_fields(stage, _STAGE_FIELDS, f"stages[{i}].")
        for j, entry in enumerate(stage["losses"]):
            _check_fields(entry, _LOSS_FIELDS, f"stages[{i}].losses[{j}].")
            if not math.isfinite(entry["loss"]):
                raise ValueError(f"stages[{i}].losses[{j}].loss: expected a finite number, got {entry['loss']!r}")
            rows.append({
                "run": run, "manifest_file": manifest_file, "stage_index": i, "stage": stage["name"],
                "stage_kind": stage["kind"], "stage_seq_len": stage["seq_len_tokens"],
                "tokens_seen": stage["tokens_seen"],
                "step": entry["step"], "loss": float(entry["loss"]), "tokens": entry["tokens"],
            })  # fmt: skip
    return rows


def _resolve_dir(results_dir: str | Path) -> Path:
    root = Path(results_dir)
    if not root.is_dir():
        raise ValueError(f"results_dir: expected an existing directory, got {str(root)!r}")
    return root


def _scan(root: Path, kind: str, warn: bool) -> tuple[list[tuple[Path, dict[str, Any]]], list[tuple[str, str]]]:
    """Find every ``*.json`` under ``root`` (recursively) whose top-level ``"kind"`` equals ``kind``.

    Returns:
        ``(files, skipped)``: parsed objects with their paths, and ``(path, reason)`` for unreadable JSON
        (logged as a warning when ``warn``).
    """
    found, skipped = [], []
    for path in sorted(root.rglob("*.json")):
        if not path.is_file():
            continue
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            # An unparseable file does not say its kind, so it is never an error; it is reported, not hidden.
            if warn:
                logger.warning("skipping %s: not readable JSON (%s)", path, exc)
            skipped.append((str(path), f"not readable JSON: {exc}"))
            continue
        if isinstance(obj, dict) and obj.get("kind") == kind:
            found.append((path, obj))
    return found, skipped


def _reject(path: Path, exc: ValueError, kind: str, strict: bool, skipped: list[tuple[str, str]]) -> None:
    """Raise (strict) or log and record a malformed file of a handled kind."""
    msg = f"malformed {kind} file {path}: {exc}"
    if strict:
        raise ValueError(f"{msg}; {_fix_hint(kind)}") from exc
    logger.warning("skipping %s (pass strict=True to fail instead)", msg)
    skipped.append((str(path), str(exc)))


def load_results(results_dir: str | Path, strict: bool = False) -> pd.DataFrame:
    """Load every RULER result file under ``results_dir`` (recursively) into one tidy frame.

    Files whose ``"kind"`` is not ``"ruler"`` are ignored. When several runs hold the same model (by name), task
    and length, the row from the run with the latest ``created_utc`` is kept (ties: the later file path).
    A file's own ``"mean"`` is checked for shape only; means are recomputed from the kept rows (:func:`ruler_means`).

    Args:
        results_dir: Directory written by ``hylo-bench ruler``.
        strict: Raise on a malformed RULER file instead of skipping it with a logged warning.

    Returns:
        One row per model x task x seq_len with columns ``RESULT_COLUMNS``, sorted by model, seq_len, task.
        ``score`` is 0-100, ``seq_len`` in tokens, ``created_utc`` a UTC timestamp, ``run_file`` the path
        relative to ``results_dir``. ``df.attrs["skipped"]`` lists ``(path, reason)`` of skipped files.

    Raises:
        ValueError: if ``results_dir`` is not a directory, if no valid RULER results are found, or (strict) if
            a file with ``"kind": "ruler"`` is malformed; the message names the file and the problem.
    """
    root = _resolve_dir(results_dir)
    found, skipped = _scan(root, RULER_KIND, warn=True)
    rows = []
    for path, obj in found:
        if obj.get("status") == "running":  # a run still writing, or killed: not mixed with finished ones
            done, planned = len(obj.get("records") or []), obj.get("planned")
            of = f" of {len(planned)} planned" if isinstance(planned, list) else ""
            logger.warning("skipping %s: unfinished run (%d%s results)", path, done, of)
            reason = f"unfinished run (it holds {done}{of} results; the command was interrupted or is still running)"
            skipped.append((str(path), f"{reason}: left out"))
            continue
        try:
            rows.extend(parse_ruler_run(obj, path.relative_to(root).as_posix()))
        except ValueError as exc:
            _reject(path, exc, RULER_KIND, strict, skipped)
    if not rows:
        extra = f" ({len(skipped)} file(s) skipped as malformed, see warnings)" if skipped else ""
        raise ValueError(f"no RULER results found in {root}{extra}; run `hylo-bench ruler ...` first")
    return results_frame(rows, skipped)


def results_frame(rows: list[dict[str, Any]], skipped: list[tuple[str, str]]) -> pd.DataFrame:
    """Tidy frame from parsed RULER rows (:func:`parse_ruler_run` output or ``store.ruler_rows``).

    Keeps the latest run per model, task and length (ties: the later ``run_file``); see :func:`load_results`.
    """
    df = pd.DataFrame(rows, columns=RESULT_COLUMNS)
    df["created_utc"] = pd.to_datetime(df["created_utc"], utc=True)
    df = df.sort_values(["created_utc", "run_file"], kind="stable")
    df = df.drop_duplicates(["model", "task", "seq_len"], keep="last")
    df = df.sort_values(["model", "seq_len", "task"], kind="stable").reset_index(drop=True)
    for model, hashes in df.groupby("model")["model_hash"].unique().items():
        hashes = [h for h in hashes if isinstance(h, str)]  # `ruler --json` objects carry no checkpoint hash
        if len(hashes) > 1:
            logger.warning("model %r: kept rows come from runs of %d different checkpoints (hashes %s)",
                           model, len(hashes), ", ".join(h[:HASH_PREFIX_CHARS] for h in hashes))  # fmt: skip
    df.attrs["skipped"] = skipped
    return df


def load_manifests(results_dir: str | Path, strict: bool = False) -> pd.DataFrame:
    """Load the training-loss logs of every upcycle manifest under ``results_dir`` (recursively).

    The run label is the manifest's folder relative to ``results_dir`` (its file stem at the top level).
    Unreadable JSON files are skipped silently here; :func:`load_results` reports them.

    Args:
        results_dir: Directory to search.
        strict: Raise on a malformed manifest instead of skipping it with a logged warning.

    Returns:
        One row per logged step with columns ``LOSS_COLUMNS`` (empty when there is no manifest);
        ``df.attrs["skipped"]`` lists ``(path, reason)`` of skipped manifests.

    Raises:
        ValueError: if ``results_dir`` is not a directory, or (strict) on a malformed ``"kind": "upcycle"`` file.
    """
    root = _resolve_dir(results_dir)
    found, _ = _scan(root, UPCYCLE_KIND, warn=False)
    rows, skipped = [], []
    for path, obj in found:
        rel = path.relative_to(root)
        run = rel.parent.as_posix() if rel.parent != Path(".") else rel.stem
        try:
            rows.extend(parse_manifest(obj, run, rel.as_posix()))
        except ValueError as exc:
            _reject(path, exc, UPCYCLE_KIND, strict, skipped)
    df = pd.DataFrame(rows, columns=LOSS_COLUMNS)
    df.attrs["skipped"] = skipped
    return df


def ruler_means(df: pd.DataFrame) -> pd.DataFrame:
    """RULER mean per model and length: the plain mean of that model's task scores at that length.

    Args:
        df: Output of :func:`load_results`.

    Returns:
        Columns ``model, seq_len, score, num_tasks`` (score 0-100, seq_len in tokens), sorted by model, seq_len.
    """
    grouped = df.groupby(["model", "seq_len"], sort=True)["score"]
    out = grouped.agg(score=lambda s: math.fsum(s) / len(s), num_tasks="count").reset_index()
    return out


def task_tables(df: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """Per-length score tables: rows are tasks plus a final ``"mean"`` row, columns are models.

    Args:
        df: Output of :func:`load_results`.

    Returns:
        ``{seq_len: table}`` in increasing length; a cell is NaN where a model has no score for that task.
    """
    means = ruler_means(df)
    tables = {}
    for seq_len, part in df.groupby("seq_len", sort=True):
        table = part.pivot(index="task", columns="model", values="score").sort_index()
        mean_row = means[means["seq_len"] == seq_len].set_index("model")["score"].rename("mean")
        table = pd.concat([table, mean_row.to_frame().T]).reindex(columns=table.columns)
        table.index.name, table.columns.name = "task", None
        tables[int(seq_len)] = table
    return tables


def models_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per model, described by its latest run.

    Args:
        df: Output of :func:`load_results`.

    Returns:
        Columns ``model, layout, kind, hash, path, git_sha, samples_per_task, flavor, chat_template, runs,
        latest_run_utc``; ``hash`` is the first ``HASH_PREFIX_CHARS`` hex digits, ``runs`` the number of files
        contributing rows.
    """
    latest = df.sort_values(["created_utc", "run_file"], kind="stable").groupby("model").tail(1).set_index("model")
    out = pd.DataFrame({
        "layout": latest["model_layout"], "kind": latest["model_kind"],
        "hash": latest["model_hash"].str.slice(0, HASH_PREFIX_CHARS), "path": latest["model_path"],
        "git_sha": latest["git_sha"].str.slice(0, HASH_PREFIX_CHARS), "samples_per_task": latest["samples_per_task"],
        "flavor": latest["flavor"], "chat_template": latest["chat_template"],
        "runs": df.groupby("model")["run_file"].nunique(),
        "latest_run_utc": latest["created_utc"].dt.strftime("%Y-%m-%d %H:%M:%SZ"),
    })  # fmt: skip
    return out.sort_index().reset_index()
