"""``hylo-bench ruler`` adds its results to the results store after every (task, length), like its JSON file: the
runner hands every rewrite of the file to ``on_result``, the CLI's ``store.recorder``."""

from __future__ import annotations

import json
import logging

from hylo_bench.reports import store
from hylo_bench.tasks.ruler import evaluate_model
from hylo_bench.tasks.ruler.cache import GENERATOR_VERSION
from tests.tasks.test_ruler_runner import INFO, _cfg, _quiet, _scripted, tok  # noqa: F401 (tok is a fixture)


def test_ruler_results_land_in_the_default_store(tok, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.delenv(store.DB_ENV, raising=False)
    cfg = _cfg(tmp_path, tasks=["niah_single_1", "ruler_vt"])
    info = {**INFO, "kind": "transformer"}
    out = evaluate_model(_scripted(tok, cfg, oracle=True), tok, info, cfg, console=_quiet(),
                         on_result=store.recorder(None, cfg.results_dir))
    engine = store.open_store(tmp_path / store.DB_FILENAME)
    df = store.metrics_frame(engine)
    assert sorted(zip(df["task"], df["seq_len"], df["value"], df["n"])) == [
        ("niah_single_1", 1024, 100.0, 2), ("ruler_vt", 1024, 100.0, 2)]
    assert store.table_counts(engine)["runs"] == 1
    assert list(df["flavor"]) == ["nvidia", "nvidia"]
    assert [json.loads(e)["generator_version"] for e in df["extra_json"]] == [GENERATOR_VERSION] * 2
    (o,) = store.import_files(engine, [out["results_path"]])  # importing the finished file later is a no-op
    assert o.status == "unchanged"
    assert json.loads(store.runs_frame(engine)["config_json"][0])["model"] == info


def test_a_store_failure_only_warns(tok, tmp_path, monkeypatch, caplog):  # noqa: F811
    monkeypatch.setenv(store.DB_ENV, "nosuchdb://x")
    cfg = _cfg(tmp_path, tasks=["ruler_vt"], samples=1)
    with caplog.at_level(logging.WARNING):
        out = evaluate_model(_scripted(tok, cfg, oracle=True), tok, {**INFO, "kind": "transformer"}, cfg,
                             console=_quiet(), on_result=store.recorder(None, cfg.results_dir))
    assert out["scores"] == {"ruler_vt": {"1024": 100.0}}
    assert "results not added to the results store" in caplog.text
