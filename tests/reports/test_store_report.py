"""Tests for the full store report (``report --db``): figure data equal the stored values, paper overlays equal
the paper's tables, empty sections say so, ``--models``, ``--images`` export, and rendering in headless Chromium."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from hylo_bench.reports import build_report, store
from hylo_bench.reports.paper import PAPER_TABLES, paper_tables_path
from hylo_bench.reports.store_report import figure_data
from tests.reports.test_report import TASKS, ruler_run, write_json
from tests.reports.test_store import MANIFEST, invoke, plain

SHARED_PAPER = Path(__file__).resolve().parents[3] / "shared" / "paper" / "hylo_paper_tables.json"
RELEASED = "amd/HyLo-Llama-4MLA12GDN-64K-SFT"
LENGTHS = (8192, 16384, 32768, 65536)
# Quarter-point scores are exact in binary floating point.
RULER = {(t, n): 90.0 - 10.25 * i - 2.5 * j for i, n in enumerate(LENGTHS) for j, t in enumerate(TASKS)}
COMMONSENSE = {"arc_challenge": 0.375, "arc_easy": 0.625, "hellaswag": 0.5625, "openbookqa": 0.375, "piqa": 0.75,
               "race": 0.375, "winogrande": 0.625}  # fmt: skip
GSM8K = 0.4375
SWEEP = [
    {"model": "llama-3b", "seq_len": 8192, "status": "ok", "kv_cache_gib": 0.875, "peak_memory_gib": 8.5,
     "ttft_s": 0.25, "tokens_per_s": 120.5},
    {"model": "llama-3b", "seq_len": 65536, "status": "ok", "kv_cache_gib": 7.0, "peak_memory_gib": 20.25,
     "ttft_s": 2.5, "tokens_per_s": 60.25},
    {"model": "llama-3b", "seq_len": 131072, "status": "oom", "kv_cache_gib": None, "peak_memory_gib": None,
     "ttft_s": None, "tokens_per_s": None},
    {"model": RELEASED, "seq_len": 8192, "status": "ok", "kv_cache_gib": 0.0625, "peak_memory_gib": 5.5,
     "ttft_s": 0.375, "tokens_per_s": 100.0},
    {"model": RELEASED, "seq_len": 131072, "status": "ok", "kv_cache_gib": 1.0, "peak_memory_gib": 7.75,
     "ttft_s": 6.5, "tokens_per_s": 90.5},
]  # fmt: skip


def lm_eval(model: str) -> dict:
    results = {t: {"alias": t, "acc,none": v, "acc_stderr,none": 0.01} for t, v in COMMONSENSE.items()}
    results["gsm8k"] = {"alias": "gsm8k", "exact_match,strict-match": GSM8K, "exact_match,flexible-extract": 0.5}
    return {"results": results, "n-samples": {t: {"original": 100, "effective": 64} for t in results},
            "config": {"model": "hf", "model_args": f"pretrained={model}"}, "date": 1767225600.0,
            "model_name": model}  # fmt: skip


@pytest.fixture
def full_db(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    db = tmp_path / "store.sqlite"
    paths = [
        write_json(src / "ruler_released.json", ruler_run(RELEASED, RULER, "2026-05-01T10:00:00Z")),
        write_json(src / "ruler_short.json", ruler_run("hylo-a", {("vt", 1024): 80.5}, "2026-05-01T10:00:00Z")),
        write_json(src / "results_lm_eval.json", lm_eval(RELEASED)),
        write_json(src / "sweep.json", {"benchmark": "serving_sweep", "created_utc": "2026-05-02T00:00:00Z",
                                        "records": SWEEP}),
        write_json(src / "hylo-a" / "manifest.json", MANIFEST),
    ]  # fmt: skip
    store.import_files(store.open_store(db), paths)
    return db


def paper_row(model: str, ctx: str | None) -> dict:
    tables = json.loads(paper_tables_path().read_text())
    (row,) = [r for t in PAPER_TABLES for r in tables[t] if r["model"] == model and r["train_ctx"] == ctx]
    return row


@pytest.mark.skipif(not SHARED_PAPER.is_file(), reason=f"{SHARED_PAPER} is not next to this checkout")
def test_packaged_paper_tables_equal_the_shared_copy():
    assert json.loads(paper_tables_path().read_text()) == json.loads(SHARED_PAPER.read_text())


def test_figure_data_equal_stored_values_and_paper(full_db: Path, tmp_path: Path):
    page = build_report(tmp_path, tmp_path / "r.html", db=full_db).read_text(encoding="utf-8")
    figs = figure_data(page)
    assert set(figs) == {"figure1", "ruler-mean", "ruler-tasks-0", "ruler-tasks-1", "serving", "upcycle-loss"}

    (ours,) = [t for t in figs["figure1"]["data"] if t["meta"]["source"] == "store"]
    means = [math.fsum(RULER[(t, n)] for t in TASKS) / len(TASKS) for n in LENGTHS]
    assert ours["meta"]["model"] == RELEASED and ours["y"] == [GSM8K * 100]
    assert ours["x"] == [pytest.approx(math.fsum(means) / 4, abs=1e-12)]
    tables = json.loads(paper_tables_path().read_text())
    expected = {}
    for r in (r for t in PAPER_TABLES for r in tables[t]):
        label = f"{r['model']}@{r['train_ctx']}" if r["train_ctx"] else r["model"]
        expected[label] = (sum(r[c] for c in ("R8K", "R16K", "R32K", "R64K")) / 4, r["GSM8K"])
    got = {}
    for trace in (t for t in figs["figure1"]["data"] if t["meta"]["source"] == "paper"):
        assert trace["text"] == trace["meta"]["labels"]
        got |= {label: (x, y) for label, x, y in zip(trace["text"], trace["x"], trace["y"])}
    assert got.keys() == expected.keys()
    for label, (x, y) in expected.items():
        assert got[label][0] == pytest.approx(x, abs=1e-9) and got[label][1] == y

    ruler = {(t["meta"].get("source", "store"), t["meta"]["model"]): t for t in figs["ruler-mean"]["data"]}
    assert ruler[("store", RELEASED)]["x"] == list(LENGTHS) and ruler[("store", RELEASED)]["y"] == means
    assert ruler[("store", "hylo-a")]["y"] == [80.5]
    row = paper_row("HyLo-Llama-4MLA12GDN", "64K")
    assert ruler[("paper", RELEASED)]["x"] == list(LENGTHS)
    assert ruler[("paper", RELEASED)]["y"] == [row["R8K"], row["R16K"], row["R32K"], row["R64K"]]
    assert ("paper", "hylo-a") not in ruler

    heat = {f["data"][0]["meta"]["model"]: f["data"][0] for k, f in figs.items() if k.startswith("ruler-tasks")}
    assert heat[RELEASED]["x"] == ["1K", "8K", "16K", "32K", "64K"]  # shared axes: hylo-a has 1K only
    assert heat[RELEASED]["z"] == [[None] + [RULER[(t, n)] for n in LENGTHS] for t in sorted(TASKS)]

    serving = figs["serving"]["data"]
    for field in ("kv_cache_gib", "peak_memory_gib", "ttft_s", "tokens_per_s"):
        for model in ("llama-3b", RELEASED):
            (ok,) = [t for t in serving if t["meta"] == {"model": model, "field": field, "status": "ok"}]
            recs = [r for r in SWEEP if r["model"] == model and r["status"] == "ok"]
            assert ok["x"] == [r["seq_len"] for r in recs] and ok["y"] == [r[field] for r in recs]
        (oom,) = [t for t in serving if t["meta"] == {"model": "llama-3b", "field": field, "status": "oom"}]
        assert oom["x"] == [131072] and oom["text"] == ["OOM"] and oom["marker"]["symbol"] == "x"
    assert not [t for t in serving if t["meta"]["model"] == RELEASED and t["meta"]["status"] == "oom"]
    assert "1 OOM point(s)" in page

    (loss,) = figs["upcycle-loss"]["data"]
    assert loss["x"] == [1000, 2000] and loss["y"] == [4.5, 3.25]


def test_commonsense_table_has_the_7_task_average_and_paper_row(full_db: Path, tmp_path: Path):
    from hylo_bench.reports.store_report import build, load_store

    rep = build(load_store(store.open_store(full_db, create=False)), "t")
    table = rep.tables["commonsense"].set_index("model")
    ours, paper = table.loc[RELEASED], table.loc["paper: HyLo-Llama-4MLA12GDN@64K"]
    for task, value in COMMONSENSE.items():
        assert ours[task] == value * 100
    assert ours["avg_7"] == pytest.approx(sum(COMMONSENSE.values()) / 7 * 100, abs=1e-12)
    assert ours["gsm8k"] == GSM8K * 100 and ours["metric"] == "acc"
    row = paper_row("HyLo-Llama-4MLA12GDN", "64K")
    cols = {"ARC": "arc_challenge", "ARE": "arc_easy", "HS": "hellaswag", "OB": "openbookqa", "PI": "piqa",
            "RA": "race", "WG": "winogrande"}  # fmt: skip
    assert {t: paper[t] for t in cols.values()} == {t: row[c] for c, t in cols.items()}
    assert paper["gsm8k"] == row["GSM8K"] and paper["avg_7"] == pytest.approx(row["Avg"], abs=0.07)
    assert "hylo-a" not in table.index  # no lm-eval results for it
    assert "<h2>Commonsense" in rep.html and f"<td>{COMMONSENSE['piqa'] * 100:.1f}</td>" in rep.html


def test_sections_without_data_say_so(tmp_path: Path):
    db = tmp_path / "only_manifest.sqlite"
    store.import_files(store.open_store(db), [write_json(tmp_path / "m" / "manifest.json", MANIFEST)])
    page = build_report(tmp_path, tmp_path / "r.html", db=db).read_text(encoding="utf-8")
    figs = figure_data(page)
    assert set(figs) == {"figure1", "upcycle-loss"}
    assert all(t["meta"]["source"] == "paper" for t in figs["figure1"]["data"])
    for note in ("No checkpoint in the store has both GSM8K", "No RULER results in the store",
                 "No commonsense results", "No serving sweep points in the store"):  # fmt: skip
        assert note in page
    assert "No training logs" not in page


def test_models_filter_and_unknown_model(full_db: Path, tmp_path: Path):
    out = tmp_path / "r.html"
    result = invoke("report", "--db", str(full_db), "--models", "hylo-a,llama-3b", "-o", str(out))
    assert result.exit_code == 0, result.output
    figs = figure_data(out.read_text(encoding="utf-8"))
    assert {t["meta"]["model"] for t in figs["ruler-mean"]["data"]} == {"hylo-a"}
    assert {t["meta"]["model"] for t in figs["serving"]["data"]} == {"llama-3b"}
    assert [t for t in figs["figure1"]["data"] if t["meta"]["source"] == "store"] == []
    assert "No commonsense results" in out.read_text(encoding="utf-8")
    result = invoke("report", "--db", str(full_db), "--models", "nope", "-o", str(tmp_path / "x.html"))
    assert result.exit_code == 2 and "--models: nope not in the store; stored:" in plain(result.output)
    result = invoke("report", "--results-dir", str(tmp_path), "--models", "a", "--files-only", "-o",
                    str(tmp_path / "x.html"))
    assert result.exit_code == 2 and "use the results store; drop --files-only" in plain(result.output)


def find_chromium() -> str | None:
    """``$HYLO_BENCH_CHROMIUM``, else /usr/bin/chromium, else chromium / chrome on PATH."""
    for cand in (os.environ.get("HYLO_BENCH_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                 shutil.which("chromium-browser"), shutil.which("google-chrome")):  # fmt: skip
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install chromium; .ci/run does)")


@needs_chromium
def test_images_and_tables_export(full_db: Path, tmp_path: Path):
    pytest.importorskip("kaleido", reason="pip install hylo-bench[images]")
    out = tmp_path / "img"
    result = invoke("report", "--db", str(full_db), "-o", str(tmp_path / "r.html"), "--images", str(out))
    assert result.exit_code == 0, result.output
    names = {p.name for p in out.iterdir()}
    for fig in ("figure1", "ruler-mean", "ruler-tasks-0", "ruler-tasks-1", "serving", "upcycle-loss"):
        assert {f"{fig}.png", f"{fig}.svg"} <= names
        assert (out / f"{fig}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"<svg" in (out / f"{fig}.svg").read_bytes()[:400]
    for table in ("figure1_points", "commonsense", "serving_points", "models", "ruler_8192", "ruler_65536"):
        assert {f"{table}.csv", f"{table}.md"} <= names
    assert (out / "commonsense.md").read_text().startswith("|")
    assert "avg_7" in (out / "commonsense.csv").read_text().splitlines()[0]


@needs_chromium
def test_report_renders_in_headless_chromium(full_db: Path, tmp_path: Path):
    from playwright.sync_api import sync_playwright

    out = build_report(tmp_path, tmp_path / "r.html", db=full_db)
    num_figs = len(figure_data(out.read_text(encoding="utf-8")))
    problems, remote = [], []
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"]  # fmt: skip
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            page = browser.new_page()
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.route(lambda url: not url.startswith("file:"), lambda route: (remote.append(route.request.url),
                                                                               route.abort()))  # fmt: skip
            page.goto(out.as_uri(), wait_until="load")
            page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length >= {num_figs}", timeout=30000)
            drawn = page.evaluate("""() => Array.from(document.querySelectorAll('div.plot')).map(d => ({
                id: d.id, svgs: d.querySelectorAll('.main-svg').length, traces: (d.data || []).length,
                points: d.querySelectorAll('.scatterlayer .point, .heatmaplayer image, .hm image').length}))""")
        finally:
            browser.close()
    assert problems == [] and remote == []
    assert len(drawn) == num_figs == 6
    for fig in drawn:
        assert fig["svgs"] >= 1 and fig["traces"] >= 1, fig
    by_id = {f["id"]: f for f in drawn}
    assert by_id["plot-serving"]["points"] >= len(SWEEP)  # every measured and OOM point has a marker


def test_images_skipped_with_a_clear_note_when_kaleido_cannot_render(full_db, tmp_path, monkeypatch):
    import plotly.io as pio

    from hylo_bench.reports.store_report import build_store_report

    def no_browser(*args, **kwargs):
        raise RuntimeError("no Chrome found")

    pytest.importorskip("kaleido", reason="pip install hylo-bench[images]")
    monkeypatch.setattr(pio, "write_images", no_browser)
    path, notes = build_store_report(full_db, tmp_path, tmp_path / "r.html", images_dir=tmp_path / "img")
    assert path.is_file() and len(notes) == 1
    assert "PNG/SVG export skipped" in notes[0] and "no Chrome found" in notes[0] and "chromium" in notes[0]
    names = {p.name for p in (tmp_path / "img").iterdir()}
    assert "commonsense.csv" in names and "commonsense.md" in names and not any(n.endswith(".png") for n in names)


@pytest.mark.parametrize(("name", "expected"), [
    ("amd/HyLo-Qwen-14MLA14M2-8K-SFT", ("HyLo-Qwen-14MLA14M2", "8K")),
    ("/ckpt/HyLo-Llama-4MLA12GDN-64K/", ("HyLo-Llama-4MLA12GDN", "64K")),
    ("Llamba-1B", ("Llamba-1B", None)),
    ("HyLo-Llama-4MLA12GDN", None),  # both 8K and 64K rows exist: no guess
    ("hylo-a", None),
])  # fmt: skip
def test_match_paper_row(name: str, expected):
    from hylo_bench.reports.paper import load_paper_tables, match_paper_row, paper_frame

    row = match_paper_row(name, paper_frame(load_paper_tables()))
    ctx = None if row is None or not isinstance(row["train_ctx"], str) else row["train_ctx"]
    assert (None if row is None else (row["model"], ctx)) == expected


def test_default_report_imports_the_results_dir_into_its_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``report --results-dir R`` (no --db, no $HYLO_BENCH_DB): the store is R/hylo_bench.sqlite; result files
    under R that it lacks are imported first (idempotent), other JSON is ignored, a broken results file is listed
    in the page and not imported."""
    monkeypatch.delenv(store.DB_ENV, raising=False)
    res = tmp_path / "results"
    write_json(res / "ruler_released.json", ruler_run(RELEASED, RULER, "2026-05-01T10:00:00Z"))
    write_json(res / "sweep.json", {"benchmark": "serving_sweep", "records": SWEEP})
    write_json(res / "hylo-a" / "manifest.json", MANIFEST)
    write_json(res / "hylo-a" / "config.json", {"model_type": "llama", "hidden_size": 32})  # not a results file
    broken = ruler_run("broken", {("vt", 1024): 50.0}, "2026-05-01T10:00:00Z")
    del broken["model"]
    write_json(res / "broken.json", broken)
    for _ in range(2):
        result = invoke("report", "--results-dir", str(res), "-o", str(tmp_path / "r.html"))
        assert result.exit_code == 0, result.output
    engine = store.open_store(res / store.DB_FILENAME, create=False)
    assert store.table_counts(engine) == {"runs": 3, "metrics": len(RULER), "train_log": 2, "points": len(SWEEP)}
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    figs = figure_data(page)
    assert {"ruler-mean", "serving", "upcycle-loss"} <= set(figs)
    assert str(res / "broken.json") in page and "config.json" not in page
    (got,) = [t for t in figs["ruler-mean"]["data"] if t["meta"].get("source", "store") == "store"]
    assert got["meta"]["model"] == RELEASED
    assert got["y"] == [math.fsum(RULER[(t, n)] for t in TASKS) / len(TASKS) for n in LENGTHS]


def test_every_committed_benchmark_result_imports_and_is_shown(tmp_path: Path):
    """benchmarks/results/*.json (the H200 evidence) follow the benchmark format (flat records) and the report
    shows each: serving sweeps as the Figure 5 panels, the rest as tables holding the stored values."""
    from hylo_bench.reports.store_report import build, load_store

    results = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "results").glob("*.json"))
    assert results, "no committed benchmark results"
    engine = store.open_store(tmp_path / "s.sqlite")
    outcomes = store.import_files(engine, results)
    assert [o.status for o in outcomes] == ["new"] * len(results)
    data = load_store(engine)
    rep = build(data, "t")
    by_name: dict[str, list[dict]] = {}  # one table / panel per benchmark name, rows of every run in import order
    for path in results:
        doc = json.loads(path.read_text())
        by_name.setdefault(doc["benchmark"], []).extend(doc["records"])
    for name, records in by_name.items():
        if name in data.other_points:
            table = rep.tables[f"benchmark_{name}"]
            assert len(table) == len(records), name
            for row, rec in zip(table.to_dict("records"), records):
                rec = {k: v for k, v in rec.items() if not (k == "benchmark" and v == name)}  # the table's own name
                assert {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))} == rec, name
            assert f"<h3>{name}</h3>" in rep.html
        else:
            # parity / bandwidth checks and skipped points (nothing measured) are not drawn; a record naming its
            # own benchmark (batched_decode's prefill and continuous-batching points) is drawn under that name
            points = [r for r in records if "check" not in r and r.get("status") != "skipped"]
            for bench in {r.get("benchmark", name) for r in points}:
                mine = [r for r in points if r.get("benchmark", name) == bench]
                drawn = data.points[data.points["benchmark"] == bench]
                keys = {(r.get("model"), r.get("variant") or "", r["seq_len"], r.get("batch_size") or 1)
                        for r in mine}  # newest run per key; each batch size is its own series
                assert len(drawn) == len(keys) and set(drawn["seq_len"]) == {r["seq_len"] for r in mine}, bench
                assert set(drawn["status"]) <= {"ok", "oom"}


def test_serving_figure_draws_each_bound_next_to_its_tpot_and_splits_batches_and_variants(tmp_path):
    recs = [
        {"model": "hylo", "seq_len": 65536, "batch_size": 1, "status": "ok", "ttft_s": 1.5, "tpot_s": 0.002,
         "bound_tpot_s": 0.00125, "fraction_of_bound": 0.625},
        {"model": "hylo", "seq_len": 65536, "batch_size": 8, "status": "ok", "ttft_s": 2.5, "tpot_s": 0.004,
         "bound_tpot_s": 0.0015, "fraction_of_bound": 0.375},
        {"model": "qwen", "seq_len": 65536, "batch_size": 1, "status": "ok", "ttft_s": 3.0, "tpot_s": 0.0625,
         "bound_tpot_s": 0.0025, "fraction_of_bound": 0.04, "variant": ""},
        {"model": "qwen", "seq_len": 65536, "batch_size": 1, "status": "ok", "ttft_s": 3.0, "tpot_s": 0.005,
         "bound_tpot_s": 0.0025, "fraction_of_bound": 0.5, "variant": "static"},
    ]
    db = tmp_path / "s.sqlite"
    engine = store.open_store(db)
    store.import_files(engine, [write_json(tmp_path / "sweep.json", {"benchmark": "sweep", "records": recs})])
    page = build_report(tmp_path, tmp_path / "r.html", db=db).read_text(encoding="utf-8")
    traces = figure_data(page)["serving"]["data"]

    def ys(model, field, status):
        (t,) = [t for t in traces if t["meta"] == {"model": model, "field": field, "status": status}]
        return t["y"]

    for rec, label in zip(recs, ("hylo", "hylo B=8", "qwen", "qwen [static]")):
        assert ys(label, "tpot_s", "ok") == [rec["tpot_s"]]
        assert ys(label, "bound_tpot_s", "bound") == [rec["bound_tpot_s"]]
        assert ys(label, "fraction_of_bound", "ok") == [rec["fraction_of_bound"]]
