"""Crash tests: ``upcycle`` and ``ruler --resume`` SIGKILLed at many points (inside optimizer steps, between a
step and its log line, in the middle of atomic writes, between a stage's checkpoint and its manifest entry, ...)
and re-run until they finish. The result must equal an uninterrupted run: bit-identical weights, every optimizer
step applied and logged exactly once, every RULER sample predicted once and the same scores.

Each command runs in a child forked from a forkserver that imported torch once (tests/fault_child.py); the child
kills itself at a named point (``HYLO_BENCH_FAULT=<point>:<n>``, ``io_utils.fault_point``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hylo_bench.reports import store
from tests import fault_child

SIGKILLED = -9


@pytest.fixture(scope="module")
def forkserver():
    return fault_child.context()


def _env(tmp_path: Path, fault: str = "") -> dict[str, str]:
    return {"HYLO_BENCH_DB": str(tmp_path / "store.sqlite"), "HYLO_BENCH_CACHE": str(tmp_path / "cache"),
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HYLO_BENCH_FAULT": fault}


def _log_steps(path: Path) -> list[tuple[int, int, float]]:
    return [(r["stage_index"], r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


# (kill point, n-th pass in that process): every child resumes what the killed ones left. Stages: ILD 7 steps, KD 3
# steps, 2 micro-batches per step, resume.pt every 2 steps.
UPCYCLE_KILLS = [
    ("train:micro_backward", 1),  # ILD step 1, between its two micro-batches (nothing saved yet)
    ("train:resume_saved", 1),  # ILD right after resume.pt at step 2
    ("train:micro_backward", 4),  # ILD step 4, both gradients in, optimizer step not taken
    ("train:optimizer_step", 1),  # ILD step 3 applied but not logged nor saved
    ("replace:resume.pt", 1),  # ILD step 4's resume.pt written to its temp file, not renamed
    ("train:logged", 3),  # ILD step 5 logged (then a torn half line is appended), resume.pt at step 4
    ("upcycle:stage_trained", 1),  # ILD trained to step 7, no held-out KL, no checkpoint
    ("replace:model.safetensors", 1),  # in the middle of writing the ILD stage checkpoint
    ("upcycle:stage_done", 1),  # ILD "done" in the manifest; its resume.pt not yet removed, not in the store
    ("train:micro_backward", 3),  # KD step 2, between its micro-batches
    ("train:logged", 2),  # KD step 2 logged, before its resume.pt
    ("replace:manifest.json", 3),  # the manifest update of KD step 2 cut before its rename
    ("upcycle:final_saved", 1),  # the final student written, the manifest not marked finished
]


def test_upcycle_killed_anywhere_resumes_to_the_uninterrupted_result(forkserver, tiny_base_dir, tmp_path):
    data = tmp_path / "data.txt"
    from hylo_bench.upcycle.documents import shipped_text

    data.write_text(shipped_text()[:60000], encoding="utf-8")
    args = ["upcycle", "--base", str(tiny_base_dir), "--data", str(data), "--stages", "64:ild@2k,128@2k",
            "--batch-size", "2", "--grad-accum", "2", "--save-every", "2", "--eval-windows", "1", "--device", "cpu",
            "--no-tensorboard", "--no-compile"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    ref_env = _env(tmp_path / "ref_store")
    assert fault_child.run(forkserver, [*args, "--out", str(ref)], ref_env, tmp_path / "ref.log") == 0, \
        (tmp_path / "ref.log").read_text()[-3000:]
    for k, (point, nth) in enumerate(UPCYCLE_KILLS):
        log = tmp_path / f"cut{k}.log"
        rc = fault_child.run(forkserver, [*args, "--out", str(cut)], _env(tmp_path, f"{point}:{nth}"),
                             log)
        assert rc == SIGKILLED, f"kill {k} at {point}:{nth} did not happen (exit {rc}): {log.read_text()[-3000:]}"
        if point == "train:logged":  # a kill in the middle of the next line's write
            with open(cut / "train_log.jsonl", "a", encoding="utf-8") as f:
                f.write('{"stage": "ild-64", "stage_index": 0, "st')
    log = tmp_path / "final.log"
    assert fault_child.run(forkserver, [*args, "--out", str(cut)], _env(tmp_path), log) == 0, \
        log.read_text()[-3000:]

    for rel in ("model.safetensors", "stages/0-ild-64/model.safetensors", "stages/1-kd-128/model.safetensors"):
        assert (cut / rel).read_bytes() == (ref / rel).read_bytes(), rel  # bit-identical weights
    want = _log_steps(ref / "train_log.jsonl")
    assert [(s, n) for s, n, _ in want] == [(0, i) for i in range(1, 8)] + [(1, i) for i in range(1, 4)]
    assert _log_steps(cut / "train_log.jsonl") == want  # each step once, in order, with the same loss
    m_ref, m_cut = (json.loads((d / "manifest.json").read_text()) for d in (ref, cut))
    def untimed(losses: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if k != "tokens_per_s"} for row in losses]

    for a, b in zip(m_ref["stages"], m_cut["stages"]):
        assert (b["status"], b["steps"], b["tokens_seen"]) == ("done", a["steps"], a["tokens_seen"])
        assert untimed(b["losses"]) == untimed(a["losses"])
    assert m_cut["model_hash"] == m_ref["model_hash"] and m_cut["kl_init"] == m_ref["kl_init"]
    assert not (cut / "resume.pt").exists()
    logged = store.train_log_frame(store.open_store(tmp_path / "store.sqlite", create=False))
    assert list(zip(logged["stage_index"], logged["step"], logged["loss"])) == want  # the store: no gap, no repeat


RULER_KILLS = [
    # writing the sample cache of the second (task, length): loaded before the first one decodes, so that its first
    # prompts are tokenised meanwhile
    ("replace:niah_single_2-1024-nvidia-tok*", 1),
    ("ruler:predictions_appended", 2),  # niah_single_1 @ 1024: samples 0, 1 predicted
    ("replace:niah_single_1-1024-nvidia-model*", 1),  # --resume merging that predictions file, cut before rename
    ("ruler:results_written", 1),  # the first (task, length) scored and written, not yet in the store
    ("ruler:predictions_appended", 4),  # the first sample of niah_single_1 @ 2048 appended
    ("ruler:stored", 3),  # three (task, length) pairs scored and stored
]


def test_ruler_resume_killed_anywhere_predicts_each_sample_once(forkserver, mini_base_dir, tmp_path):
    args = ["ruler", "--model", str(mini_base_dir), "--lengths", "1k,2k", "--tasks", "niah_single_1,niah_single_2",
            "--samples", "3", "--device", "cpu", "--resume"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert fault_child.run(forkserver, [*args, "--results-dir", str(ref)], _env(tmp_path / "ref_store"),
                           tmp_path / "ref.log") == 0, (tmp_path / "ref.log").read_text()[-3000:]
    for k, (point, nth) in enumerate(RULER_KILLS):
        log = tmp_path / f"cut{k}.log"
        rc = fault_child.run(forkserver, [*args, "--results-dir", str(cut)], _env(tmp_path, f"{point}:{nth}"), log)
        assert rc == SIGKILLED, f"kill {k} at {point}:{nth} did not happen (exit {rc}): {log.read_text()[-3000:]}"
    assert fault_child.run(forkserver, [*args, "--results-dir", str(cut)], _env(tmp_path), tmp_path / "f.log") == 0

    def predictions(d: Path) -> dict[str, list[dict]]:
        return {p.name: [json.loads(line) for line in p.read_text().splitlines()]
                for p in sorted((d / "predictions").glob("*.jsonl"))}

    got, want = predictions(cut), predictions(ref)
    assert len(want) == 4 and got == want  # every sample predicted once (indices 0, 1, 2), the same text
    assert all([r["index"] for r in rows] == [0, 1, 2] for rows in got.values())
    docs = [json.loads(p.read_text()) for p in sorted(cut.glob("ruler-*.json"))]
    (final,) = [d for d in docs if d["status"] == "complete"]
    (ref_doc,) = [json.loads(p.read_text()) for p in ref.glob("ruler-*.json")]
    key = ("task", "seq_len", "score", "n", "nulls", "prompt_tokens_mean")
    assert [[r[k] for k in key] for r in final["records"]] == [[r[k] for k in key] for r in ref_doc["records"]]
    assert len(final["records"]) == 4 and final["mean"] == ref_doc["mean"]
    assert len(docs) > 1 and all(d["status"] == "running" for d in docs if d is not final)  # killed: unfinished
    engine = store.open_store(tmp_path / "store.sqlite", create=False)
    from hylo_bench.reports import compare as C

    side = C.store_side(engine, str(mini_base_dir))  # by name: the finished run only, the others left out
    assert "left out unfinished run(s)" in side.description
    assert sorted(zip(side.metrics["task"], side.metrics["seq_len"], side.metrics["value"]))[:4] == sorted(
        (r["task"], r["seq_len"], r["score"]) for r in ref_doc["records"])
    assert os.path.isdir(cut / "cache")
