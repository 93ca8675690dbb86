"""``ruler`` refuses what it cannot do before it decodes anything (lengths beyond the model's context or the memory
sizing needs, (task, length) pairs that cannot be sized), and an interrupted run is marked unfinished in its file
and in the store, so ``report`` and ``compare`` do not mix it with finished runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hylo_bench.reports import store
from hylo_bench.tasks.ruler import runner as R
from hylo_bench.tasks.ruler.runner import evaluate_model
from tests.reports.test_store import invoke, plain
from tests.snapshot import changes, tree_snapshot
from tests.tasks.test_ruler_runner import INFO, DyingLM, _cfg, _half_oracle, _quiet, tok  # noqa: F401 (fixture)


def test_every_task_and_length_is_sized_before_anything_is_decoded(tok, tmp_path):  # noqa: F811
    """A multi-length run once scored 1024 (file and store written), then died at the length it could not size."""
    cfg = _cfg(tmp_path / "res", lengths=[1024, 60], tasks=["niah_single_1", "ruler_vt"], samples=2)
    model = DyingLM(tok, {})
    with pytest.raises(ValueError) as err:
        evaluate_model(model, tok, INFO, cfg, console=_quiet())
    msg = str(err.value)
    assert msg.startswith("2 of 4 (task, length) pairs cannot be sized; nothing was decoded")
    assert "niah_single_1 @ 60: length_tokens=60 is too small for RULER task 'niah_single_1'" in msg
    assert "ruler_vt @ 60: length_tokens=60 is too small for RULER task 'ruler_vt'" in msg
    assert model.seen == [] and not (tmp_path / "res").exists()
    assert not Path(os.environ["HYLO_BENCH_DB"]).exists()


def test_lengths_beyond_the_model_context_are_refused_at_once(tiny_base_dir, tmp_path):
    """`--lengths 100m` on a 2048-token model once ran until the kernel killed it (sizing a 100M-token prompt)."""
    work = tmp_path / "w"
    work.mkdir()
    before = tree_snapshot(work)
    res = subprocess.run([sys.executable, "-m", "hylo_bench", "ruler", "--model", str(tiny_base_dir), "--lengths",
                          "1k,100m", "--tasks", "niah_single_1", "--samples", "1", "--device", "cpu",
                          "--results-dir", str(work / "res")], capture_output=True, text=True, timeout=120, cwd=work,
                         check=False)
    assert res.returncode == 2, res.stderr
    assert ("--lengths 104857600 tokens: longer than the model's context of 2048 tokens (config "
            "max_position_embeddings); use lengths <= 2048") in plain(res.stderr)
    assert changes(before, tree_snapshot(work)) == []


def test_lengths_whose_sizing_would_not_fit_in_memory_are_refused(tok, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(R, "_available_memory_bytes", lambda: 2 ** 30)  # 1 GiB free: 1.34M tokens at most
    model = DyingLM(tok, {})  # no config: no context limit to check
    with pytest.raises(ValueError, match=r"--lengths 4000000 tokens: sizing one prompt of that length needs about "
                                         r"1\.5 GiB \(400 bytes/token while tokenizing\), more than half of the 1\.0 "
                                         r"GiB available; use lengths <= 1342177"):
        evaluate_model(model, tok, INFO, _cfg(tmp_path / "res", lengths=[4_000_000]), console=_quiet())
    assert model.seen == [] and not (tmp_path / "res").exists()


def test_an_interrupted_run_is_marked_unfinished_and_kept_out_of_report_and_compare(tok, tmp_path):  # noqa: F811
    info = INFO | {"kind": "transformer"}  # a kind the store accepts
    res = tmp_path / "res"
    cfg = _cfg(res, tasks=["niah_single_1", "ruler_vt"], samples=2)
    answers = _half_oracle(tok, cfg)
    with pytest.raises(RuntimeError, match="killed"):  # niah_single_1 is scored, ruler_vt never
        evaluate_model(DyingLM(tok, answers, die_after=2), tok, info, cfg, console=_quiet(),
                       on_result=store.recorder(None, res))
    (cut,) = res.glob("ruler-*.json")
    doc = json.loads(cut.read_text())
    assert doc["status"] == "running" and len(doc["records"]) == 1
    assert doc["planned"] == [{"task": "niah_single_1", "seq_len": 1024}, {"task": "ruler_vt", "seq_len": 1024}]
    db = os.environ["HYLO_BENCH_DB"]
    engine = store.open_store(db, create=False)
    assert store.runs_frame(engine)[["id", "status"]].values.tolist() == [[1, "running"]]

    result = invoke("compare", info["name"], info["name"], "--db", db)
    assert result.exit_code == 2 and "only unfinished runs (1: interrupted or still running)" in plain(result.output)
    result = invoke("report", "--results-dir", str(res), "--db", db, "-o", str(tmp_path / "r.html"))
    assert result.exit_code == 0, result.output
    page = (tmp_path / "r.html").read_text()
    assert "unfinished run 1 (it holds 1 of 2 planned results" in page and str(cut) in page
    result = invoke("report", "--results-dir", str(res), "--files-only", "-o", str(tmp_path / "f.html"))
    assert result.exit_code == 2 and "no RULER results found" in plain(result.output)  # the only file: left out

    full = evaluate_model(DyingLM(tok, answers), tok, info, cfg, console=_quiet(), on_result=store.recorder(None, res))
    assert json.loads(Path(full["results_path"]).read_text())["status"] == "complete"
    assert store.runs_frame(engine)[["id", "status"]].values.tolist() == [[1, "running"], [2, "complete"]]
    from hylo_bench.reports import compare as C

    side = C.store_side(engine, info["name"])
    assert "run 2" in side.description and "left out unfinished run(s) 1" in side.description
    assert sorted(side.metrics["task"]) == ["niah_single_1", "ruler_mean", "ruler_vt"]
    assert "UNFINISHED run" in C.store_side(engine, "1").description  # by id: compared as it is, and said so
    result = invoke("report", "--results-dir", str(res), "--files-only", "-o", str(tmp_path / "f.html"))
    assert result.exit_code == 0 and "unfinished run (it holds 1 of 2 planned results" in \
        (tmp_path / "f.html").read_text()
