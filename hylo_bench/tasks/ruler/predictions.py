"""Per-sample RULER predictions: JSONL files under ``RESULTS_DIR/predictions/``, one per (model, task, length and
every setting a prediction depends on), appended after each batch; read back to resume a run and merged from the
shards that worker processes write.

A line is ``{"index": int, "prompt_sha256": hex, "prediction": str}``; ``prediction`` is the raw decoded text
(before ``strip_think``, which is applied at scoring, so it is not part of the key). A line is used only when its
``prompt_sha256`` matches the sample's prompt, so a changed prompt is never scored with a stale prediction.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hylo_bench.io_utils import atomic_write_text
from hylo_bench.tasks.ruler.cache import GENERATOR_VERSION, text_hash

PREDICTIONS_DIR = "predictions"


def predictions_path(
    results_dir: str | Path, *, task: str, length_tokens: int, model_hash: str, dtype: str, tok_hash: str,
    data_hash: str, seed: int, flavor: str, chat_template: bool, max_gen_toks: int,
) -> Path:
    """``<results_dir>/predictions/<task>-<L>-<flavor>-model<12 hex>-<dtype>-tok<12 hex>-seed<seed>-hay<8 hex>
    [-chat]-gen<max_gen_toks>-v<GENERATOR_VERSION>.jsonl``.

    Args:
        model_hash: ``load_model``'s weights hash; dtype: parameter dtype (``float32``, ``bfloat16``, ...).
        data_hash: the essay text's sha256, or for QA tasks the data file's.
        max_gen_toks: the task's generation budget in tokens.
    """
    chat = "-chat" if chat_template else ""
    name = (f"{task}-{length_tokens}-{flavor}-model{model_hash[:12]}-{dtype}-tok{tok_hash[:12]}-seed{seed}"
            f"-hay{data_hash[:8]}{chat}-gen{max_gen_toks}-v{GENERATOR_VERSION}")
    return Path(results_dir) / PREDICTIONS_DIR / f"{name}.jsonl"


def shard_path(path: Path, rank: int, world_size: int) -> Path:
    """The file worker ``rank`` of ``world_size`` appends to (``path`` itself for a single process)."""
    return path if world_size == 1 else path.with_name(f"{path.stem}.rank{rank}of{world_size}.jsonl")


def shard_files(path: Path) -> list[Path]:
    """The per-worker files of ``path`` present now (``<stem>.rank<r>of<n>.jsonl``)."""
    return sorted(path.parent.glob(f"{path.stem}.rank*of*.jsonl"))



def prediction_row(sample: dict, prediction: str) -> dict:
    """The JSONL row of one prediction."""
    return {"index": sample["index"], "prompt_sha256": text_hash(sample["prompt"]), "prediction": prediction}


def append_predictions(path: Path, rows: list[dict]) -> None:
    """Append rows with one ``write`` on an ``O_APPEND`` descriptor, then fsync.

    A crash can leave at most a torn last line, which :func:`read_predictions` skips.
    """
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_predictions(path: Path, samples: list[dict], shards: bool = True) -> dict[int, str]:
    """Predictions of ``samples`` found in ``path`` and (``shards``) its shard files: ``{index: prediction}``.

    Unreadable lines (a torn append), indices beyond ``samples`` and lines whose prompt hash differs from the
    sample's are skipped; the first line of an index wins. ``shards=False`` reads the merged file only: what every
    worker of a run sees alike while the others append to their shards.
    """
    wanted = {s["index"]: text_hash(s["prompt"]) for s in samples}
    found: dict[int, str] = {}
    for file in [path, *(shard_files(path) if shards else [])]:
        if not file.is_file():
            continue
        for line in file.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                index, sha, pred = row["index"], row["prompt_sha256"], row["prediction"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if wanted.get(index) == sha and index not in found:
                found[index] = pred
    return found


def consolidate(path: Path, samples: list[dict]) -> dict[int, str]:
    """Rewrite ``path`` atomically with the valid predictions of ``samples`` from it and its shards (index
    order), delete the shards, and return them as :func:`read_predictions` does."""
    found = read_predictions(path, samples)
    by_index = {s["index"]: s for s in samples}
    rows = [prediction_row(by_index[i], found[i]) for i in sorted(found)]
    if rows or path.exists():
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    for shard in shard_files(path):
        shard.unlink()
    return found


def discard(path: Path) -> None:
    """Delete ``path`` and its shards (a run without ``resume`` starts from no predictions)."""
    for file in [path, *shard_files(path)]:
        file.unlink(missing_ok=True)
