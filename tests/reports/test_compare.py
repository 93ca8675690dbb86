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


def _wilson_by_hand(x: float, n: int) -> tuple[float, float]:
    """Wilson (1927) as printed in Newcombe (1998), eq. for method 3, written out anew for the test."""
    z2 = 1.959963984540054 ** 2
    p = x / n
    root = math.sqrt(4 * n * p * (1 - p) + z2)
    return ((2 * n * p + z2 - 1.959963984540054 * root) / (2 * (n + z2)),
            (2 * n * p + z2 + 1.959963984540054 * root) / (2 * (n + z2)))


def test_wilson_interval_against_published_values():
    # Newcombe (1998), Stat. Med. 17:857, Table II, Wilson score method without continuity correction
    for (x, n), want in {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605), (0, 20): (0.0, 0.1611),
                         (1, 29): (0.0061, 0.1718)}.items():
        assert C.wilson_interval(x / n, n) == pytest.approx(want, abs=5e-5)
        assert C.wilson_interval(x / n, n) == pytest.approx(_wilson_by_hand(x, n), abs=1e-12)


def test_threshold_and_interval_arithmetic(db: Path):
    engine = store.open_store(db)
    cmp = C.compare_sides(C.store_side(engine, "noisy-base"), C.store_side(engine, "noisy"), threshold=0.5)
    row = cmp.rows.set_index("task").loc["niah"]
    lb, ub = _wilson_by_hand(45, 50)  # base 90 % of 50
    lc, uc = _wilson_by_hand(44.5, 50)  # candidate 89 % of 50
    d = 0.89 - 0.90  # Newcombe (1998) method 10 from the two Wilson intervals
    want = (d - math.sqrt((0.89 - lc) ** 2 + (ub - 0.90) ** 2), d + math.sqrt((uc - 0.89) ** 2 + (0.90 - lb) ** 2))
    assert row["delta"] == pytest.approx(-1.0)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((100 * want[0], 100 * want[1]))
    assert not row["regression"]  # beyond the 0.5 threshold, but not beyond the interval


def _share_side(label: str, value: float, n: int, stderr: float | None = None, metric: str = "acc") -> C.Side:
    df = C._frame([{"task": "arc_easy", "seq_len": None, "metric": metric, "value": value, "n": n,
                    "stderr": stderr}])  # fmt: skip
    return C.Side(label=label, description=label, metrics=df)


def test_intervals_respect_the_score_range_and_small_samples():
    # a 4-sample swing, 4/4 -> 0/4, with lm-eval's stored stderr of 0 at 0 % and 100 % (a zero-width interval
    # before): Wilson gives [0.5101, 1] and [0, 0.4899], so the delta's interval is [-100, -100 + 69.28]
    row = C.compare_sides(_share_side("a", 100.0, 4, 0.0), _share_side("b", 0.0, 4, 0.0)).rows.iloc[0]
    lb, _ = _wilson_by_hand(4, 4)
    _, uc = _wilson_by_hand(0, 4)
    assert row["delta"] == -100.0 and row["has_ci"]
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((-100.0, -100.0 + 100 * math.hypot(uc, 1 - lb)))
    assert row["ci_high"] - row["ci_low"] > 60 and row["regression"]
    # a stderr-only share (no n) near the ends: each side's normal interval is clipped to [0, 100] first
    # (98 -+ 39.2 -> [58.8, 100], 3 -+ 39.2 -> [0, 42.2]), so the delta's stays inside [-100, 100]
    row = C.compare_sides(_share_side("a", 98.0, None, 20.0, "score"), _share_side("b", 3.0, None, 20.0,
                                                                                 "score")).rows.iloc[0]
    half = C.Z_95 * 20.0
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((-95.0 - math.hypot(3.0, 2.0),
                                                             -95.0 + math.hypot(half, half)))
    # every interval of every compared row lies in the range of a difference of 0-100 scores
    for n in (1, 2, 4, 20):
        for a in (0.0, 25.0, 100.0):
            for b in (0.0, 50.0, 100.0):
                r = C.compare_sides(_share_side("a", a, n), _share_side("b", b, n)).rows.iloc[0]
                assert -100.0 <= r["ci_low"] < r["delta"] + 1e-9 and r["delta"] - 1e-9 < r["ci_high"] <= 100.0


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
    assert mean["n"] == 300 and pd.isna(mean["stderr"])  # the mean's interval: Wilson on the 300 samples


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
