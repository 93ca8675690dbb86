"""Tests for ``hylo-bench compare``: exit codes on planted regressions and on noise, metrics on one side only,
the paper's numbers as a side, and the Markdown / HTML outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from hylo_bench.reports import compare as C
from hylo_bench.reports import store
from hylo_bench.reports.ingest import Metric, RunRecord
from tests.reports.test_store import invoke, plain

PAPER_PATH = C.default_paper_path()
needs_paper = pytest.mark.skipif(not PAPER_PATH.is_file(), reason=f"paper tables not found at {PAPER_PATH}")


def ruler_record(model: str, scores: dict[tuple[str, int], float], n: int, key: str) -> RunRecord:
    metrics = [Metric(task=t, seq_len=L, metric="score", value=s, n=n, stderr=None, flavor="lm-eval")
               for (t, L), s in scores.items()]  # fmt: skip
    return RunRecord(natural_key=key, kind="ruler", source=f"{key}.json", model=model, checkpoint=None,
                     model_hash=None, layout=None, git_sha=None, hylo_bench_version=None, device=None, config={},
                     created_utc="2026-05-01T10:00:00+00:00", metrics=metrics, train_log=[], points=[])


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "store.sqlite"
    engine = store.open_store(path)
    store.save_runs(engine, [
        ruler_record("base", {("niah", 4096): 90.0, ("vt", 4096): 80.0, ("qa", 4096): 60.0}, 100, "b"),
        ruler_record("regressed", {("niah", 4096): 70.0, ("vt", 4096): 80.0, ("qa", 4096): 60.0}, 100, "r"),
        ruler_record("noisy-base", {("niah", 4096): 90.0}, 50, "nb"),
        ruler_record("noisy", {("niah", 4096): 89.0}, 50, "n"),
        ruler_record("partial", {("niah", 4096): 90.0, ("cwe", 4096): 55.0}, 100, "p"),
    ])  # fmt: skip
    return path


def test_planted_regression_exits_1(db: Path, tmp_path: Path):
    md, page = tmp_path / "out" / "cmp.md", tmp_path / "cmp.html"
    result = invoke("compare", "base", "regressed", "--db", str(db), "--md", str(md), "--html", str(page))
    assert result.exit_code == 1, result.output
    text = md.read_text()
    assert "**1 regression(s)**" in text and "| **REGRESSION** | niah | 4096 | score | 90.00 | 70.00 | -20.00 |" in text
    assert "background:#fdd" in page.read_text() and "niah" in page.read_text()


def test_noise_within_the_interval_exits_0(db: Path):
    result = invoke("compare", "noisy-base", "noisy", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert "no regression" in plain(result.output)


def test_threshold_and_interval_arithmetic(db: Path):
    engine = store.open_store(db)
    cmp = C.compare_sides(C.store_side(engine, "noisy-base"), C.store_side(engine, "noisy"), threshold=0.5)
    row = cmp.rows.set_index("task").loc["niah"]
    se_b = 100 * math.sqrt((47 / 54) * (7 / 54) / 54)  # Agresti-Coull: (0.90 * 50 + 2) / (50 + 4)
    p_c = (0.89 * 50 + 2) / 54
    se_c = 100 * math.sqrt(p_c * (1 - p_c) / 54)
    half = C.Z_95 * math.sqrt(se_b**2 + se_c**2)
    assert row["delta"] == pytest.approx(-1.0)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((-1.0 - half, -1.0 + half))
    assert not row["regression"]  # beyond the 0.5 threshold, but not beyond the interval


def test_metrics_on_one_side_are_reported(db: Path):
    result = invoke("compare", "base", "partial", "--db", str(db))
    out = plain(result.output)
    assert result.exit_code == 0, result.output
    assert "2 only in base, 1 only in candidate" in out
    assert "**Only in base** (2): `qa@4096:score` = 60.00, `vt@4096:score` = 80.00" in out
    assert "**Only in candidate** (1): `cwe@4096:score` = 55.00" in out


def test_run_ids_and_derived_ruler_mean(db: Path):
    engine = store.open_store(db)
    side = C.store_side(engine, "1")
    assert side.label == "1" and "run 1" in side.description
    mean = side.metrics.set_index("task").loc[C.RULER_MEAN_TASK]
    assert mean["value"] == pytest.approx((90 + 80 + 60) / 3) and mean["num_tasks"] == 3
    ses = [C._stderr(v, 100, None) for v in (90.0, 80.0, 60.0)]
    assert mean["stderr"] == pytest.approx(math.sqrt(sum(s * s for s in ses)) / 3)


def test_unknown_side_lists_stored_models(db: Path):
    result = invoke("compare", "base", "nope", "--db", str(db))
    assert result.exit_code == 2
    assert "'nope' is neither a stored run id nor a stored model name; stored models: base" in plain(result.output)


def test_lower_is_better_metrics_flip_the_sign():
    def side(value: float) -> C.Side:
        df = C._frame([{"task": "wikitext", "seq_len": None, "metric": "word_perplexity", "value": value, "n": None,
                        "stderr": None}])  # fmt: skip
        return C.Side(label=str(value), description="", metrics=df)

    assert C.compare_sides(side(10.0), side(15.0)).num_regressions == 1
    assert C.compare_sides(side(15.0), side(10.0)).num_regressions == 0


@needs_paper
def test_paper_side_equals_the_json():
    rows = json.loads(PAPER_PATH.read_text())["table2_llama3.2-1B"]
    want = next(r for r in rows if r["model"] == "HyLo-Llama-4MLA12GDN" and r["train_ctx"] == "64K")
    side = C.paper_side("HyLo-Llama-4MLA12GDN@64K")
    got = {(r.task, None if pd.isna(r.seq_len) else int(r.seq_len), r.metric): r.value
           for r in side.metrics.itertuples()}  # fmt: skip
    assert got == {C.PAPER_COLUMNS[col]: want[col] for col in C.PAPER_COLUMNS}
    with pytest.raises(ValueError, match="2 rows.*HyLo-Llama-4MLA12GDN@64K, HyLo-Llama-4MLA12GDN@8K"):
        C.paper_side("HyLo-Llama-4MLA12GDN")


@needs_paper
def test_compare_against_the_paper(tmp_path: Path):
    paper = {r["model"]: r for r in json.loads(PAPER_PATH.read_text())["table2_llama3.2-1B"] if r["train_ctx"] == "8K"}
    want = paper["HyLo-Llama-4MLA12M2"]
    engine = store.open_store(tmp_path / "s.sqlite")
    ours = {(t, 8192): want["R8K"] for t in ("niah", "vt")} | {("niah", 16384): want["R16K"] - 30.0}
    store.save_runs(engine, [ruler_record("mine", ours, 100, "m")])
    md = tmp_path / "cmp.md"
    result = invoke("compare", "paper:HyLo-Llama-4MLA12M2@8K", "mine", "--db", str(tmp_path / "s.sqlite"),
                    "--md", str(md))  # fmt: skip
    assert result.exit_code == 1, result.output
    cmp = C.compare_sides(C.paper_side("HyLo-Llama-4MLA12M2@8K"), C.store_side(engine, "mine"))
    by_len = cmp.rows.set_index("seq_len")
    assert by_len.loc[8192, "base"] == want["R8K"] and by_len.loc[8192, "delta"] == pytest.approx(0.0)
    assert by_len.loc[16384, "regression"] and not by_len.loc[8192, "regression"]
    assert len(cmp.only_base) == len(C.PAPER_COLUMNS) - 2  # commonsense, GSM8K, 32K, 64K: reported, not dropped
    assert "`gsm8k@-:exact_match,strict-match` = 49.20" in md.read_text()
