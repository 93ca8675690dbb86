"""Tests for the results store: kind detection, import round trips, idempotency, all-or-nothing rejection,
schema migrations, ``HYLO_BENCH_DB`` URLs, ``report --db`` and the ``hylo-bench ruler`` hook."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from hylo_bench.cli import app
from hylo_bench.reports import build_report, store
from hylo_bench.reports.ingest import detect_kind
from tests.reports.test_report import SCORES, read_figures, ruler_run, write_json

BENCH_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "upcycle_real_size.json"
LM_EVAL = {
    "results": {
        "arc_easy": {"alias": "arc_easy", "acc,none": 0.625, "acc_stderr,none": 0.03125, "acc_norm,none": 0.5,
                     "acc_norm_stderr,none": "N/A"},
        "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.0625,
                  "exact_match,flexible-extract": 0.375, "exact_match_stderr,flexible-extract": 0.0625},
        "wikitext": {"alias": "wikitext", "word_perplexity,none": 17.5, "word_perplexity_stderr,none": "N/A"},
    },
    "versions": {"arc_easy": 1.0, "gsm8k": 3.0, "wikitext": 2.0},
    "n-shot": {"arc_easy": 0, "gsm8k": 0, "wikitext": 0},
    "n-samples": {"arc_easy": {"original": 2376, "effective": 64}, "gsm8k": {"original": 1319, "effective": 64},
                  "wikitext": {"original": 62, "effective": 62}},
    "config": {"model": "hf", "model_args": "pretrained=/ckpt/hylo-a,dtype=bfloat16", "device": "cuda:0"},
    "git_hash": "abc1234", "date": 1767225600.0, "model_name": "hylo-a",
}  # fmt: skip
MANIFEST = {
    "kind": "upcycle", "hylo_bench_version": "0.1.0", "git_sha": "0123abc", "created_utc": "2026-05-01T09:00:00Z",
    "settings": {"base": "demo"}, "config": {"out": "/runs/hylo-a", "base": "demo"}, "device": "cpu",
    "hybrid_config": {"layer_types": ["mla", "gdn", "gdn", "gdn"]}, "kl_init": 1.5,
    "stages": [
        {"name": "ild-2k", "seq_len_tokens": 2048, "kind": "ild", "status": "done", "tokens_seen": 3000,
         "losses": [{"step": 1, "loss": 4.5, "tokens": 1000}, {"step": 2, "loss": 3.25, "tokens": 2000}]},
        {"name": "kd-8k", "seq_len": 8192, "kind": "kd", "status": "pending", "tokens_seen": 0, "losses": []},
    ],
}  # fmt: skip
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def plain(text: str) -> str:
    """CLI output with rich's line wrapping undone."""
    return re.sub(r"\s+", " ", text)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "src"
    return {
        "ruler": write_json(src / "ruler_hylo-a.json", ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00Z")),
        "ruler-json": write_json(src / "ruler_stdout.json", {"model": "llama-b", "scores": {"vt": {"4096": 44.75}},
                                                             "mean": {"4096": 44.75}}),
        "lm-eval": write_json(src / "results_2026-05-01.json", LM_EVAL),
        "upcycle": write_json(src / "hylo-a" / "manifest.json", MANIFEST),
        "benchmark": BENCH_PATH,
    }  # fmt: skip


def test_detect_kind(files: dict[str, Path]):
    for kind, path in files.items():
        assert detect_kind(json.loads(path.read_text())) == kind


def test_import_query_round_trip(files: dict[str, Path], tmp_path: Path):
    db = tmp_path / "store.sqlite"
    result = invoke("import", *map(str, files.values()), "--db", str(db))
    assert result.exit_code == 0, result.output
    engine = store.open_store(db)
    runs = store.runs_frame(engine).set_index("kind")
    assert sorted(runs.index) == sorted(files)
    assert runs.loc["ruler", "model"] == "hylo-a" and runs.loc["ruler", "model_hash"] == "f" * 64
    assert runs.loc["lm-eval", "checkpoint"] == "/ckpt/hylo-a" and runs.loc["upcycle", "layout"] == "1MLA3GDN"
    df = store.metrics_frame(engine)
    ruler = df[df["kind"] == "ruler"]
    got = {(r.task, int(r.seq_len)): (r.value, r.n) for r in ruler.itertuples()}
    assert got == {key: (score, 8) for key, score in SCORES["hylo-a"].items()}
    lm = df[df["kind"] == "lm-eval"].set_index(["task", "metric"])
    assert lm.loc[("arc_easy", "acc"), "value"] == 62.5 and lm.loc[("arc_easy", "acc"), "stderr"] == 3.125
    assert lm.loc[("arc_easy", "acc"), "n"] == 64 and pd.isna(lm.loc[("arc_easy", "acc_norm"), "stderr"])
    assert lm.loc[("gsm8k", "exact_match,flexible-extract"), "value"] == 37.5
    assert lm.loc[("wikitext", "word_perplexity"), "value"] == 17.5  # not a percentage: kept as is
    assert df[df["kind"] == "ruler-json"][["task", "value"]].values.tolist() == [["vt", 44.75]]
    losses = store.train_log_frame(engine)
    assert losses[["stage", "step", "loss", "tokens"]].values.tolist() == [["ild-2k", 1, 4.5, 1000],
                                                                          ["ild-2k", 2, 3.25, 2000]]
    pts = store.points_frame(engine)
    bench = json.loads(BENCH_PATH.read_text())
    assert pts.drop(columns=["run_id", "benchmark"]).to_dict("records") == bench["records"]


def test_duplicate_import_is_a_noop(files: dict[str, Path], tmp_path: Path):
    db = tmp_path / "store.sqlite"
    assert invoke("import", *map(str, files.values()), "--db", str(db)).exit_code == 0
    before = store.table_counts(store.open_store(db))
    again = invoke("import", *map(str, files.values()), str(files["ruler"]), "--db", str(db))
    assert again.exit_code == 0, again.output
    assert store.table_counts(store.open_store(db)) == before
    assert plain(again.output).count("unchanged") == len(files) + 1


def test_growing_ruler_file_extends_its_run_and_conflicts_are_rejected(tmp_path: Path):
    doc = ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00Z")
    full = list(doc["records"])
    engine = store.open_store(tmp_path / "s.sqlite")
    doc["records"] = full[:2]
    path = write_json(tmp_path / "r.json", doc)
    assert [o.status for o in store.import_files(engine, [path])] == ["new"]
    doc["records"] = full
    write_json(path, doc)
    (out,) = store.import_files(engine, [path])
    assert (out.status, out.num_metrics) == ("extended", len(full) - 2)
    assert store.table_counts(engine)["runs"] == 1
    doc["records"][0] = {**full[0], "score": 1.0}
    write_json(path, doc)
    with pytest.raises(ValueError, match="append-only"):
        store.import_files(engine, [path])


@pytest.mark.parametrize("corrupt, reason", [
    ('{"kind": "ruler", "records": [', "not valid JSON"),
    (json.dumps({k: v for k, v in ruler_run("x", SCORES["hylo-a"], "2026-05-01T10:00:00Z").items() if k != "seed"}),
     "ruler object: seed: missing key"),
    (json.dumps({"rows": [1, 2]}), "unknown results format"),
    (json.dumps(LM_EVAL | {"results": {"arc_easy": 0.5}}), "results.arc_easy: expected an object"),
])  # fmt: skip
def test_corrupt_second_file_rejects_the_whole_command(files: dict[str, Path], tmp_path: Path, corrupt, reason):
    db = tmp_path / "store.sqlite"
    assert invoke("import", str(files["lm-eval"]), "--db", str(db)).exit_code == 0
    before = store.table_counts(store.open_store(db))
    bad = tmp_path / "bad.json"
    bad.write_text(corrupt)
    result = invoke("import", str(files["ruler"]), str(bad), "--db", str(db))
    assert result.exit_code == 2
    out = plain(result.output)
    assert f"{bad}: " in out and reason in out and "nothing was imported" in out
    assert store.table_counts(store.open_store(db)) == before


def test_failed_write_rolls_back_every_file(files: dict[str, Path], tmp_path: Path):
    engine = store.open_store(tmp_path / "s.sqlite")
    doc = ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00Z")
    doc["records"][0]["score"] = 12.5  # same run, other value: conflicts with files["ruler"] at write time
    other = write_json(tmp_path / "conflict.json", doc)
    with pytest.raises(ValueError, match="conflict.json: run 2 already stores"):
        store.import_files(engine, [files["lm-eval"], files["ruler"], other])
    assert store.table_counts(engine) == {"runs": 0, "metrics": 0, "train_log": 0, "points": 0}


V1_DDL = """
CREATE TABLE schema_version (version INTEGER NOT NULL PRIMARY KEY, applied_utc VARCHAR(40) NOT NULL);
CREATE TABLE runs (id INTEGER NOT NULL PRIMARY KEY, natural_key VARCHAR(64) NOT NULL UNIQUE, kind VARCHAR(32) NOT NULL,
  source TEXT NOT NULL, model TEXT NOT NULL, checkpoint TEXT, model_hash VARCHAR(128), layout VARCHAR(128),
  git_sha VARCHAR(64), hylo_bench_version VARCHAR(32), device TEXT, config_json TEXT NOT NULL,
  created_utc VARCHAR(40) NOT NULL, imported_utc VARCHAR(40) NOT NULL);
CREATE TABLE metrics (id INTEGER NOT NULL PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs (id), task TEXT NOT NULL,
  seq_len INTEGER, metric TEXT NOT NULL, value FLOAT NOT NULL, n INTEGER, stderr FLOAT, flavor TEXT);
INSERT INTO schema_version VALUES (1, '2026-01-01T00:00:00+00:00');
INSERT INTO runs VALUES (1, 'k1', 'ruler-json', 'old.json', 'old-model', NULL, NULL, NULL, NULL, NULL, NULL, '{}',
  '2026-01-01T00:00:00+00:00', '2026-01-01T00:00:00+00:00');
INSERT INTO metrics VALUES (1, 1, 'vt', 4096, 'score', 87.25, 50, NULL, 'lm-eval');
"""


def test_migrates_a_version_1_database(files: dict[str, Path], tmp_path: Path):
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as conn:
        conn.executescript(V1_DDL)
    engine = store.open_store(db)
    with engine.connect() as conn:
        assert store.current_version(conn) == store.SCHEMA_VERSION == 3
    old = store.metrics_frame(engine)
    assert old[["model", "task", "seq_len", "value", "n"]].values.tolist() == [["old-model", "vt", 4096, 87.25, 50]]
    store.import_files(engine, [files["ruler"], files["upcycle"], files["benchmark"]])
    assert store.table_counts(engine) == {"runs": 4, "metrics": 1 + len(SCORES["hylo-a"]), "train_log": 2,
                                          "points": 2}  # fmt: skip
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall() == [(1,), (2,), (3,)]
        # the old run: NULL (finished, from before statuses); the manifest has no finished_utc yet: running
        assert conn.execute("SELECT kind, status FROM runs ORDER BY id").fetchall() == [
            ("ruler-json", None), ("ruler", "complete"), ("upcycle", "running"), ("benchmark", "complete")]


def test_newer_schema_is_refused(tmp_path: Path):
    db = tmp_path / "new.sqlite"
    store.open_store(db)
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO schema_version VALUES (99, 'future')")
    with pytest.raises(ValueError, match="schema version 99.*upgrade hylo-bench"):
        store.open_store(db)


def test_hylo_bench_db_url(files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    db = tmp_path / "via-env" / "team.sqlite"
    monkeypatch.setenv(store.DB_ENV, f"sqlite:///{db}")
    monkeypatch.chdir(tmp_path)
    result = invoke("import", str(files["ruler"]))
    assert result.exit_code == 0, result.output
    assert db.is_file() and not (tmp_path / "hylo-results").exists()
    assert store.table_counts(store.open_store(f"sqlite:///{db}"))["metrics"] == len(SCORES["hylo-a"])
    assert store.resolve_url(tmp_path / "x.sqlite") == f"sqlite:///{tmp_path / 'x.sqlite'}"  # --db wins over env


def test_bad_url_is_actionable(tmp_path: Path):
    with pytest.raises(ValueError, match="results store URL 'nosuchdb://x'"):
        store.open_store("nosuchdb://x")


def test_report_from_store_matches_report_from_files(files: dict[str, Path], tmp_path: Path):
    src = files["ruler"].parent
    write_json(src / "llama" / "r.json", ruler_run("llama-b", SCORES["llama-b"], "2026-05-01T11:00:00Z"))
    db = tmp_path / "store.sqlite"
    assert invoke("import", str(files["ruler"]), str(src / "llama" / "r.json"), str(files["upcycle"]),
                  "--db", str(db)).exit_code == 0  # fmt: skip
    from_files = read_figures(build_report(src, tmp_path / "a.html", files_only=True).read_text())
    result = invoke("report", "--db", str(db), "-o", str(tmp_path / "b.html"))
    assert result.exit_code == 0, result.output
    from_store = read_figures((tmp_path / "b.html").read_text())
    assert from_store["fig-ruler-mean"]["data"] == from_files["fig-ruler-mean"]["data"]
    assert from_store["fig-ruler-tasks-0"]["data"] == from_files["fig-ruler-tasks-0"]["data"]
    losses = from_store["fig-upcycle-loss"]["data"]
    assert [(t["x"], t["y"]) for t in losses] == [([1000, 2000], [4.5, 3.25])]


def test_report_from_an_empty_or_missing_store_is_a_clear_error(tmp_path: Path):
    store.open_store(tmp_path / "empty.sqlite")
    result = invoke("report", "--db", str(tmp_path / "empty.sqlite"), "-o", str(tmp_path / "r.html"))
    assert result.exit_code == 2 and "no results in the store" in plain(result.output)
    result = invoke("compare", "a", "b", "--db", str(tmp_path / "missing.sqlite"))
    assert result.exit_code == 2 and f"no results store at {tmp_path / 'missing.sqlite'}" in plain(result.output)
    assert not (tmp_path / "missing.sqlite").exists()


def test_eval_json_and_eval_summary_import(tmp_path: Path):
    """``eval --json`` output and our eval-*.json summary store the same 0-100 scores; ``report`` skips a summary
    whose lm-eval results file exists (that file holds the same numbers with stderr)."""
    scores = {"arc_easy": {"acc": 62.5, "acc_norm": 50.0}, "gsm8k": {"exact_match,strict-match": 25.0}}
    printed = {"model": "hylo-a", "scores": scores, "n_samples": {"arc_easy": 64, "gsm8k": 64},
               "num_fewshot": {"arc_easy": 0, "gsm8k": 0}, "results_path": "x", "lm_eval_results_path": "y"}
    lm_file = write_json(tmp_path / "res" / "lm-eval" / "hylo-a" / "results_1.json", LM_EVAL)
    summary = {"kind": "lm-eval-summary", "hylo_bench_version": "0.1.0", "git_sha": "abc", "created_utc":
               "2026-05-01T10:00:00+00:00", "model": {"name": "hylo-b", "path": "/ck/b", "hash": "h", "layout": None,
                                                      "kind": "hylo"},
               "config": {"device": "cpu"}, "n-samples": {"arc_easy": {"original": 2376, "effective": 64}},
               "scores": scores, "lm_eval_results": str(lm_file)}
    assert detect_kind(printed) == "eval-json" and detect_kind(summary) == "eval-summary"
    engine = store.open_store(tmp_path / "s.sqlite")
    store.import_files(engine, [write_json(tmp_path / "printed.json", printed),
                                write_json(tmp_path / "summary.json", summary)])
    df = store.metrics_frame(engine)
    for model in ("hylo-a", "hylo-b"):
        got = {(r.task, r.metric): r.value for r in df[df["model"] == model].itertuples()}
        assert got == {(t, m): v for t, ms in scores.items() for m, v in ms.items()}
    assert df[(df["model"] == "hylo-a") & (df["task"] == "gsm8k")]["n"].tolist() == [64]
    assert df[(df["model"] == "hylo-b") & (df["task"] == "arc_easy")]["n"].tolist() == [64, 64]
    write_json(tmp_path / "res" / "eval-hylo-b.json", summary)
    fresh = store.open_store(tmp_path / "t.sqlite")
    outcomes, skipped = store.sync_dir(fresh, tmp_path / "res")
    assert skipped == [] and [o.source for o in outcomes] == [str(lm_file)]
    with pytest.raises(ValueError, match="scores.arc_easy.acc: expected a number"):
        store.import_files(engine, [write_json(tmp_path / "bad.json",
                                               printed | {"scores": {"arc_easy": {"acc": "x"}}})])
