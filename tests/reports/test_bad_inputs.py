"""Bad inputs found by break-testing: each fails cleanly (exit 2, the file / flag named) or is listed, and
nothing is stored that would break a later ``report``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hylo_bench.reports import store
from tests.reports.test_compare import ruler_record
from tests.reports.test_report import SCORES, ruler_run, write_json
from tests.reports.test_store import invoke, plain


@pytest.mark.parametrize("records, reason", [
    ([{"seq_len": "big", "status": "ok", "ttft_s": 1.0}], "records[0].seq_len: expected a positive number of tokens"),
    ([{"seq_len": 8192, "ttft_s": "fast"}], "records[0].ttft_s: expected a number (or null), got 'fast'"),
    ([{"seq_len": 8192, "peak_memory_gib": True}], "records[0].peak_memory_gib: expected a number"),
    ([], "records: expected at least one record"),
])
def test_benchmark_records_with_bad_measures_are_rejected(tmp_path: Path, records, reason):
    bad = write_json(tmp_path / "bench.json", {"benchmark": "x", "records": records})
    result = invoke("import", str(bad), "--db", str(tmp_path / "s.sqlite"))
    assert result.exit_code == 2 and reason in plain(result.output) and f"{bad}" in plain(result.output)
    assert store.table_counts(store.open_store(tmp_path / "s.sqlite")) == {"runs": 0, "metrics": 0, "train_log": 0,
                                                                          "points": 0}
    ok = write_json(tmp_path / "ok.json", {"benchmark": "x", "records": [{"seq_len": 8192, "ttft_s": None,
                                                                          "status": "oom", "note": "text is fine"}]})
    assert invoke("import", str(ok), "--db", str(tmp_path / "s.sqlite")).exit_code == 0


def test_report_lists_a_cut_off_results_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(store.DB_ENV, raising=False)
    res = tmp_path / "res"
    good = write_json(res / "ruler_a.json", ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00Z"))
    (res / "ruler_cut.json").write_text(good.read_text()[:300])
    result = invoke("report", "--results-dir", str(res), "-o", str(tmp_path / "r.html"))
    assert result.exit_code == 0, result.output
    page = (tmp_path / "r.html").read_text()
    assert str(res / "ruler_cut.json") in page and "not readable JSON" in page


def test_report_to_a_directory_and_unreachable_store_fail_cleanly(tmp_path: Path):
    write_json(tmp_path / "res" / "r.json", ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00Z"))
    result = invoke("report", "--results-dir", str(tmp_path / "res"), "-o", str(tmp_path))
    assert result.exit_code == 2 and "is a directory; give the HTML file to write" in plain(result.output)
    result = invoke("report", "--results-dir", str(tmp_path / "res"), "--db",
                    f"sqlite:///{tmp_path / 'res'}", "-o", str(tmp_path / "x.html"))  # a folder is no database
    assert result.exit_code == 2 and "cannot open it" in plain(result.output) and "--db" in plain(result.output)


def test_compare_with_nothing_in_common_does_not_pass(tmp_path: Path):
    engine = store.open_store(tmp_path / "s.sqlite")
    store.save_runs(engine, [ruler_record("a", {("vt", 4096): 80.0}, 100, "a"),
                             ruler_record("b", {("niah_single_1", 8192): 80.0}, 100, "b")])
    result = invoke("compare", "a", "b", "--db", str(tmp_path / "s.sqlite"))
    assert result.exit_code == 2 and "share no metric" in plain(result.output)


def test_memory_sizes_need_a_unit():
    from hylo_bench.config.units import parse_bytes

    assert parse_bytes("141GiB") == 141 * 2 ** 30 and parse_bytes("0") == 0 and parse_bytes("512B") == 512
    with pytest.raises(ValueError, match="expected a number with a unit such as 141GiB"):
        parse_bytes("80")


def test_unusable_device_is_refused_before_loading():
    import torch

    from hylo_bench.config.device import check_device

    assert check_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="--device 'tpu0': not a torch device"):
        check_device("tpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            check_device("cuda")
        result = invoke("sweep", "demo", "--contexts", "256", "--device", "cuda", "--no-store", "--out", "x.json")
        assert result.exit_code == 2 and "sees no CUDA device" in plain(result.output)


def _lm_eval_with(task: str, key: str, value) -> dict:
    from tests.reports.test_store import LM_EVAL

    obj = json.loads(json.dumps(LM_EVAL))
    obj["results"][task][key] = value
    return obj


@pytest.mark.parametrize("name, obj, field, shown", [
    ("nan-acc", _lm_eval_with("arc_easy", "acc,none", float("nan")), "results.arc_easy.acc,none", "nan"),
    ("inf-perplexity", _lm_eval_with("wikitext", "word_perplexity,none", float("inf")),
     "results.wikitext.word_perplexity,none", "inf"),
    ("acc-750-percent", _lm_eval_with("arc_easy", "acc,none", 7.5), "results.arc_easy.acc,none",
     "expected a proportion in [0, 1], got 7.5"),
    ("ruler-inf-score", ruler_run("hylo-a", {("vt", 4096): float("inf")}, "2026-05-01T10:00:00Z") | {
        "mean": {"4096": 50.0}}, "records[0].score", "inf"),
    ("ruler-nan-mean", ruler_run("hylo-a", {("vt", 4096): 50.0}, "2026-05-01T10:00:00Z") | {
        "mean": {"4096": float("nan")}}, "mean.4096", "nan"),
    ("eval-json-acc-over-100", {"model": "m", "scores": {"arc_easy": {"acc": 750.0}}, "n_samples": {}},
     "scores.arc_easy.acc", "expected a score in [0, 100], got 750.0"),
    ("eval-json-nan", {"model": "m", "scores": {"wikitext": {"word_perplexity": float("nan")}}, "n_samples": {}},
     "scores.wikitext.word_perplexity", "nan"),
    ("bench-inf", {"benchmark": "x", "records": [{"seq_len": 8192, "ttft_s": float("inf")}]}, "records[0].ttft_s",
     "inf"),
])
def test_non_finite_and_out_of_range_metrics_are_rejected_naming_file_field_value(tmp_path: Path, name, obj, field,
                                                                                   shown):
    """NaN once died in sqlite (IntegrityError traceback); inf and an accuracy of 7.5 were stored and drawn."""
    from tests.snapshot import changes, tree_snapshot

    work = tmp_path / "w"
    db = work / "s.sqlite"
    store.save_runs(store.open_store(db), [ruler_record("kept", {("vt", 4096): 80.0}, 100, "kept")])
    bad = work / f"{name}.json"
    bad.write_text(json.dumps(obj), encoding="utf-8")  # json writes NaN / Infinity, as Python's json reads them
    before = tree_snapshot(work)
    result = invoke("import", str(bad), "--db", str(db))
    out = plain(result.output)
    assert result.exit_code == 2, out
    assert str(bad) in out and field in out and shown in out and "nothing was imported" in out, out
    assert changes(before, tree_snapshot(work)) == []
    # into a store that does not exist yet: not even the store is created
    result = invoke("import", str(bad), "--db", str(tmp_path / "fresh" / "s.sqlite"))
    assert result.exit_code == 2 and not (tmp_path / "fresh").exists()


def test_manifest_with_a_nan_loss_is_rejected(tmp_path: Path):
    from tests.reports.test_store import MANIFEST

    obj = json.loads(json.dumps(MANIFEST))
    obj["stages"][0]["losses"][1]["loss"] = float("nan")
    bad = write_json(tmp_path / "manifest.json", obj)
    result = invoke("import", str(bad), "--db", str(tmp_path / "s.sqlite"))
    out = plain(result.output)
    assert result.exit_code == 2 and "stages[0].losses[1].loss: expected a finite number, got nan" in out, out
