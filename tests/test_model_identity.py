"""One model identity across commands: the weights hash (plus the names each command stored), so ``compare`` lines
up ``upcycle``'s run with the ``ruler`` / ``eval`` results of the same checkpoint (stored as ``tiny`` and
``runs/tiny`` before)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from hylo_bench.cli import app
from hylo_bench.reports import compare as C
from hylo_bench.reports import store
from hylo_bench.reports.ingest import Metric, RunRecord, parse_object


def _record(kind: str, model: str, model_hash: str | None, metrics: dict[tuple[str, int | None, str], float],
            key: str) -> RunRecord:
    return RunRecord(natural_key=key, kind=kind, source=f"{key}.json", model=model, checkpoint=f"/x/{model}",
                     model_hash=model_hash, layout=None, git_sha=None, hylo_bench_version=None, device=None,
                     config={}, created_utc="2026-05-01T10:00:00+00:00",
                     metrics=[Metric(task=t, seq_len=n, metric=m, value=v, n=20, stderr=None, flavor=None)
                              for (t, n, m), v in metrics.items()], train_log=[], points=[])


def test_runs_of_the_same_weights_are_one_model(tmp_path):
    engine = store.open_store(tmp_path / "s.sqlite")
    h = "ab" * 32
    store.save_runs(engine, [
        _record("upcycle", "tiny", h, {}, "up"),
        _record("ruler", "runs/tiny", h, {("niah_single_1", 1024, "score"): 80.0}, "ru"),
        _record("lm-eval", "runs/tiny/", h, {("arc_easy", None, "acc"): 55.0}, "ev"),
        _record("ruler", "tiny", "cd" * 32, {("vt", 1024, "score"): 10.0}, "other"),  # another checkpoint, same name
    ])
    by_upcycle_name, by_ruler_name = C.store_side(engine, "runs/tiny"), C.store_side(engine, "ab" * 6)
    want = [("arc_easy", "acc", 55.0), ("niah_single_1", "score", 80.0), ("ruler_mean", "score", 80.0)]
    for side in (by_upcycle_name, by_ruler_name):
        got = sorted(zip(side.metrics["task"], side.metrics["metric"], side.metrics["value"]))
        assert got == want, side.description
    assert "weights abababababab" in by_ruler_name.description
    assert "also stored as runs/tiny, runs/tiny/" in by_ruler_name.description
    # the name `tiny` also names the other checkpoint's run: both identities, each metric once
    both = C.store_side(engine, "tiny")
    assert sorted(both.metrics["task"]) == ["arc_easy", "niah_single_1", "ruler_mean", "vt"]
    assert "weights abababababab, cdcdcdcdcdcd" in both.description


def test_lm_eval_results_of_hylo_bench_eval_carry_the_weights_hash():
    obj = {"results": {"arc_easy": {"acc,none": 0.5}}, "config": {"model": "hylo", "model_args": "pretrained=x",
           "hylo_model": {"name": "x", "path": "/x", "hash": "ef" * 32, "layout": "2MLA2GDN", "kind": "hybrid"}},
           "n-samples": {"arc_easy": {"effective": 4}}}
    rec = parse_object(obj, "results_1.json")
    assert rec.model_hash == "ef" * 32 and rec.layout == "2MLA2GDN"


def test_upcycle_then_ruler_line_up_in_compare(tiny_base_dir, tmp_path):
    from hylo_bench.config.upcycle import UpcycleConfig
    from hylo_bench.upcycle.run import run

    out = tmp_path / "runs" / "tiny"
    manifest = run(UpcycleConfig(out=str(out), base=str(tiny_base_dir), data="demo", allow_demo_data=True,
                                 stages="128:ild@1k",
                                 batch_size=2, eval_windows=1, device="cpu", tensorboard=False),
                   on_result=store.recorder())
    runner = CliRunner()
    res = runner.invoke(app, ["ruler", "--model", str(out), "--lengths", "1k", "--tasks", "niah_single_1",
                              "--samples", "1", "--results-dir", str(tmp_path / "res"), "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(Path(json.loads(res.stdout)["results_path"]).read_text())
    assert doc["model"]["name"] == str(out) and doc["model"]["hash"] == manifest["model_hash"]
    db = os.environ["HYLO_BENCH_DB"]
    runs = store.runs_frame(store.open_store(db, create=False))
    assert sorted(zip(runs["kind"], runs["model"])) == [("ruler", str(out)), ("upcycle", "tiny")]
    assert set(runs["model_hash"]) == {manifest["model_hash"]}
    res = runner.invoke(app, ["compare", "tiny", str(out), "--db", db])  # the upcycle name vs the ruler name
    assert res.exit_code == 0, res.output
    assert "| niah_single_1 | 1024 | score | 0.00 | 0.00 | +0.00 |" in res.output
    assert "0 only in base, 0 only in candidate" in res.output
