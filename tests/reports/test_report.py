"""Tests for hylo_bench.reports: loading/validating RULER result files and the self-contained HTML report."""

from __future__ import annotations

import copy
import html
import json
import logging
import re
import statistics
from pathlib import Path

import pytest

from hylo_bench.reports import build_report, load_manifests, load_results, task_tables
from hylo_bench.reports.figures import format_tokens

TASKS = ("niah_single_1", "qa_squad", "vt")
# Quarter-point scores are exact in binary floating point, so means compare with ==.
SCORES = {
    "hylo-a": {(t, n): s for (t, n), s in zip([(t, n) for n in (1024, 4096) for t in TASKS],
                                             [90.0, 80.5, 70.25, 60.0, 50.75, 40.5])},
    "llama-b": {(t, n): s for (t, n), s in zip([(t, n) for n in (1024, 4096) for t in TASKS],
                                              [99.0, 88.25, 77.5, 66.0, 55.0, 44.75])},
}  # fmt: skip


def ruler_run(model: str, scores: dict[tuple[str, int], float], created_utc: str, kind: str = "hybrid") -> dict:
    """A RULER results object in the schema `hylo-bench ruler` writes."""
    records = [
        {"task": t, "seq_len": n, "score": s, "n": 8, "seed": 0, "nulls": 0, "prompt_tokens_mean": n * 0.9,
         "prompt_tokens_min": n - 200, "prompt_tokens_max": n - 10}
        for (t, n), s in scores.items()
    ]  # fmt: skip
    lengths = sorted({n for _, n in scores})
    return {
        "kind": "ruler", "hylo_bench_version": "0.1.0", "git_sha": "0123456789abcdef0123", "created_utc": created_utc,
        "model": {"name": model, "path": f"/ckpt/{model}", "hash": "f" * 64, "layout": "mla,gdn,gdn,gdn",
                  "kind": kind},
        "tokenizer_hash": "a" * 64, "seed": 0, "samples_per_task": 8, "chat_template": False, "flavor": "lm-eval",
        "records": records,
        "mean": {str(n): statistics.mean(s for (_, m), s in scores.items() if m == n) for n in lengths},
    }  # fmt: skip


def write_json(path: Path, obj: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


MANIFEST = {
    "kind": "upcycle", "created_utc": "2026-05-01T09:00:00Z", "config": {"out": "/runs/hylo-a"},
    "stages": [
        {"name": "ild", "seq_len_tokens": 2048, "kind": "ild", "tokens_seen": 3000,
         "losses": [{"step": 1, "loss": 4.5, "tokens": 1000}, {"step": 2, "loss": 3.25, "tokens": 2000}]},
        {"name": "long", "seq_len": 65536, "kind": "distill", "tokens_seen": 9000,
         "losses": [{"step": 1, "loss": 2.5, "tokens": 5000}]},
    ],
}  # fmt: skip


@pytest.fixture
def results_dir(tmp_path: Path) -> Path:
    """Two valid runs (one nested), an upcycle manifest, a malformed RULER file and unrelated files."""
    root = tmp_path / "results"
    write_json(root / "ruler_hylo-a.json", ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00+00:00"))
    write_json(root / "llama" / "ruler_llama-b.json",
               ruler_run("llama-b", SCORES["llama-b"], "2026-05-01T11:00:00Z", kind="transformer"))  # fmt: skip
    bad = ruler_run("broken", SCORES["hylo-a"], "2026-05-02T00:00:00Z")
    del bad["seed"]
    write_json(root / "broken" / "ruler_broken.json", bad)
    write_json(root / "hylo-a" / "manifest.json", MANIFEST)
    write_json(root / "sweep.json", {"kind": "sweep", "rows": []})
    write_json(root / "list.json", [1, 2, 3])
    (root / "cache").mkdir()
    (root / "cache" / "samples.jsonl").write_text('{"kind": "ruler"}\n')
    return root


def read_figures(page: str) -> dict[str, dict]:
    found = re.findall(r'<script type="application/json" id="(fig-[^"]+)">(.*?)</script>', page, flags=re.DOTALL)
    return {fig_id: json.loads(text) for fig_id, text in found}


def test_format_tokens():
    assert [format_tokens(n) for n in (1024, 4096, 65536, 131072, 1 << 20, 1000)] == [
        "1K", "4K", "64K", "128K", "1M", "1000"]  # fmt: skip


def test_load_results_is_tidy_and_skips_malformed(results_dir: Path, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING):
        df = load_results(results_dir)
    assert len(df) == 2 * 2 * 3
    assert not df.duplicated(["model", "task", "seq_len"]).any()
    got = {(r.model, r.task, r.seq_len): r.score for r in df.itertuples()}
    assert got == {(m, t, n): s for m, scores in SCORES.items() for (t, n), s in scores.items()}
    assert set(df["run_file"]) == {"ruler_hylo-a.json", "llama/ruler_llama-b.json"}
    assert str(df["created_utc"].dt.tz) == "UTC"
    assert "ruler_broken.json" in caplog.text and "seed" in caplog.text
    assert [Path(p).name for p, _ in df.attrs["skipped"]] == ["ruler_broken.json"]


def test_strict_raises_naming_file_and_problem(results_dir: Path):
    with pytest.raises(ValueError, match=r"ruler_broken\.json.*seed: missing key"):
        load_results(results_dir, strict=True)
    with pytest.raises(ValueError, match=r"ruler_broken\.json"):
        build_report(results_dir, results_dir / "report.html", strict=True, files_only=True)


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda o: o["model"].pop("layout"), r"model\.layout: missing key"),
        (lambda o: o["records"][1].update(score="55"), r"records\[1\]\.score: expected int or float, got '55'"),
        (lambda o: o["records"][0].update(score=110.0), r"records\[0\]\.score: expected a number in 0-100"),
        (lambda o: o["records"][0].update(seq_len=True), r"records\[0\]\.seq_len: expected int"),
        (lambda o: o["records"].append(copy.deepcopy(o["records"][0])), r"records\[6\]: duplicate record for task"),
        (lambda o: o.update(records=[]), r"records: expected at least one record"),
        (lambda o: o.update(created_utc="yesterday"), r"created_utc: expected an ISO 8601 timestamp"),
        (lambda o: o["model"].update(kind="moe"), r"model\.kind: expected one of"),
    ],
    ids=["missing-model-key", "score-str", "score-range", "seq-len-bool", "duplicate", "empty", "bad-ts", "kind"],
)
def test_strict_validation_messages(tmp_path: Path, mutate, problem: str):
    obj = ruler_run("m", SCORES["hylo-a"], "2026-05-01T10:00:00Z")
    mutate(obj)
    write_json(tmp_path / "bad_run.json", obj)
    with pytest.raises(ValueError, match=r"bad_run\.json: " + problem):
        load_results(tmp_path, strict=True)
    with pytest.raises(ValueError, match=r"no RULER results found .*1 file\(s\) skipped"):
        load_results(tmp_path, strict=False)


def test_latest_run_wins(tmp_path: Path):
    newer = {k: v / 2 for k, v in SCORES["hylo-a"].items() if k[1] == 1024}
    # The older run sorts last by file name, so only created_utc can pick the newer one.
    write_json(tmp_path / "z_old.json", ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00Z"))
    write_json(tmp_path / "a_new.json", ruler_run("hylo-a", newer, "2026-05-03T09:00:00+02:00"))
    df = load_results(tmp_path)
    assert len(df) == 6
    at_1k = df[df["seq_len"] == 1024].set_index("task")
    assert at_1k["score"].to_dict() == {t: s for (t, n), s in newer.items()}
    assert set(at_1k["run_file"]) == {"a_new.json"}
    assert set(df[df["seq_len"] == 4096]["run_file"]) == {"z_old.json"}
    means = task_tables(df)[1024].loc["mean", "hylo-a"]
    assert means == statistics.mean(newer.values())


@pytest.mark.parametrize("only_unrelated", [False, True], ids=["empty", "unrelated-only"])
def test_no_results_is_a_clear_error(tmp_path: Path, only_unrelated: bool):
    if only_unrelated:
        write_json(tmp_path / "manifest.json", MANIFEST)
    with pytest.raises(ValueError, match=re.escape(f"no RULER results found in {tmp_path}; run `hylo-bench ruler")):
        build_report(tmp_path, tmp_path / "report.html", files_only=True)
    assert not (tmp_path / "report.html").exists()


def test_missing_dir_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match="expected an existing directory"):
        load_results(tmp_path / "nope")


def test_build_report_is_self_contained_and_carries_the_data(results_dir: Path, tmp_path: Path):
    out = build_report(results_dir, tmp_path / "out" / "report.html", tables_dir=tmp_path / "tables", files_only=True)
    assert out == tmp_path / "out" / "report.html" and out.is_file()
    page = out.read_text(encoding="utf-8")
    assert "plotly.js v" in page and "Plotly.newPlot" in page and len(page) > 1_000_000
    assert not re.search(r"<script[^>]*\bsrc=", page)
    assert "cdn.plot.ly" not in page.split("</head>")[1]
    assert "hylo-a" in page and "llama-b" in page
    assert "ruler_broken.json" in page  # skipped files are listed, not hidden

    figures = read_figures(page)
    # the store report's builder (one pipeline): Figure 1 is drawn with the paper's points even without GSM8K here
    assert set(figures) == {"fig-figure1", "fig-ruler-mean", "fig-ruler-tasks-0", "fig-ruler-tasks-1",
                            "fig-upcycle-loss"}
    mean_fig = figures["fig-ruler-mean"]
    assert mean_fig["layout"]["xaxis"]["type"] == "log"
    assert mean_fig["layout"]["xaxis"]["ticktext"] == ["1K", "4K"]
    for trace in mean_fig["data"]:
        scores = SCORES[trace["meta"]["model"]]
        assert trace["x"] == [1024, 4096]
        assert trace["y"] == [statistics.mean(s for (_, n), s in scores.items() if n == m) for m in (1024, 4096)]
    assert {t["meta"]["model"] for t in mean_fig["data"]} == set(SCORES)

    for fig_id in ("fig-ruler-tasks-0", "fig-ruler-tasks-1"):
        (heat,) = figures[fig_id]["data"]
        scores = SCORES[heat["meta"]["model"]]
        assert heat["y"] == sorted(TASKS) and heat["x"] == ["1K", "4K"]
        assert heat["z"] == [[scores[(t, n)] for n in (1024, 4096)] for t in sorted(TASKS)]

    loss = {t["meta"]["stage"]: t for t in figures["fig-upcycle-loss"]["data"]}
    assert loss["ild"]["x"] == [1000, 2000] and loss["ild"]["y"] == [4.5, 3.25] and loss["long"]["y"] == [2.5]

    for name in ("ruler_records.csv", "ruler_mean.csv", "ruler_1024.csv", "ruler_4096.csv", "models.csv"):
        assert (tmp_path / "tables" / name).is_file()
    assert "mean" in (tmp_path / "tables" / "ruler_1024.csv").read_text().splitlines()[-1]


def test_tables_have_mean_row_and_models(results_dir: Path, tmp_path: Path):
    page = build_report(results_dir, tmp_path / "r.html", title="My report",
                        files_only=True).read_text(encoding="utf-8")
    assert "<title>My report</title>" in page
    for seq_len in (1024, 4096):
        assert f"({seq_len} tokens)" in page
    assert '<tr class="mean"><th class="row">mean</th>' in page
    models = page.split("<h2>Models</h2>")[1]
    for text in ("hylo-a", "llama-b", "transformer", "hybrid", "mla,gdn,gdn,gdn", "f" * 12, "/ckpt/llama-b"):
        assert text in models
    assert "f" * 13 not in models  # hash prefix only


def test_model_names_are_escaped(tmp_path: Path):
    evil = '<img src=x onerror="alert(1)">'
    write_json(tmp_path / "run.json", ruler_run(evil, SCORES["hylo-a"], "2026-05-01T10:00:00Z"))
    page = build_report(tmp_path, tmp_path / "r.html", files_only=True).read_text(encoding="utf-8")
    body = page.split("</head>")[1]
    assert "<img" not in body
    assert html.escape(evil) in body
    assert read_figures(page)["fig-ruler-mean"]["data"][0]["meta"]["model"] == evil


def test_load_manifests(results_dir: Path):
    losses = load_manifests(results_dir)
    assert losses["run"].unique().tolist() == ["hylo-a"]
    assert losses.groupby("stage")["loss"].apply(list).to_dict() == {"ild": [4.5, 3.25], "long": [2.5]}


def test_mean_over_missing_tasks_is_flagged(tmp_path: Path):
    partial = {k: v for k, v in SCORES["llama-b"].items() if k != ("vt", 4096)}
    write_json(tmp_path / "a.json", ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00Z"))
    write_json(tmp_path / "b.json", ruler_run("llama-b", partial, "2026-05-01T10:00:00Z"))
    page = build_report(tmp_path, tmp_path / "r.html", files_only=True).read_text(encoding="utf-8")
    at_4k = page.split("(4096 tokens)")[1].split("</table>")[0]
    assert at_4k.count("*</td>") == 1 and "<td>-</td>" in at_4k
    assert "fewer than the 3 tasks" in page.split("(4096 tokens)")[1]
    assert "*</td>" not in page.split("(1024 tokens)")[1].split("</table>")[0]
    (trace,) = [t for t in read_figures(page)["fig-ruler-mean"]["data"] if t["meta"]["model"] == "llama-b"]
    assert trace["customdata"] == [3, 2] and trace["y"][1] == statistics.mean(partial[(t, 4096)] for t in TASKS[:2])
