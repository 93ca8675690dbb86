"""The report builder (the one pipeline: ``report`` reads the results store, ``report --files-only`` an in-memory
store the result files were imported into): Figure 1, RULER vs length and per task, per-length score tables,
models, commonsense table, serving sweep (Figure 5 shape) and training curves; sections without data say so.
Optional PNG/SVG/CSV/Markdown export.

Scores are 0-100, lengths in tokens. Never imports torch.
"""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import re
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import plotly.offline

from hylo_bench import __version__
from hylo_bench.io_utils import atomic_write_text
from hylo_bench.reports import figures as F
from hylo_bench.reports import html as H
from hylo_bench.reports import store
from hylo_bench.reports.compare import PAPER_COLUMNS
from hylo_bench.reports.paper import load_paper_tables, match_paper_row, paper_frame
from hylo_bench.reports.results import (
    LOSS_COLUMNS,
    RESULT_COLUMNS,
    models_table,
    results_frame,
    ruler_means,
    task_tables,
)

logger = logging.getLogger(__name__)

RULER_KINDS = ("ruler", "ruler-json")
SERVING_FIELDS = ("kv_cache_gib", "ttft_s")  # a benchmark run with either in a record is a serving sweep
COMMONSENSE_METRIC = PAPER_COLUMNS["ARC"][2]
GSM8K_METRIC = PAPER_COLUMNS["GSM8K"][2]


@dataclasses.dataclass(kw_only=True, slots=True)
class StoreData:
    """What the report draws, read from the store (latest value per model, task, length and metric)."""

    ruler: pd.DataFrame  # results.RESULT_COLUMNS
    metrics: pd.DataFrame  # store.metrics_frame columns, latest per (model, task, seq_len, metric)
    losses: pd.DataFrame  # results.LOSS_COLUMNS
    points: pd.DataFrame  # serving points: model, seq_len, status, SERVING_PANELS fields, benchmark, run_id
    other_points: list[str]  # benchmarks whose records are not serving points (not drawn)
    source: str
    benchmarks: pd.DataFrame = dataclasses.field(default_factory=pd.DataFrame)  # those runs' records, all fields
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (file, reason) not imported


@dataclasses.dataclass(kw_only=True, slots=True)
class Report:
    """A built report: the page, and every figure and table in it (keyed by their ids / file stems)."""

    html: str
    figures: dict[str, go.Figure]
    tables: dict[str, pd.DataFrame]


def load_store(engine, models: list[str] | None = None) -> StoreData:
    """Read everything the report needs; ``models`` keeps only those names (RULER, lm-eval, sweep, training).

    Raises:
        ValueError: the store is empty, or a name in ``models`` is not stored (lists the stored names).
    """
    url = engine.url.render_as_string(hide_password=True)
    runs = store.runs_frame(engine)
    if runs.empty:
        raise ValueError(f"no results in the store {url}; run `hylo-bench import FILE...` first")
    metrics = store.metrics_frame(engine)
    metrics = metrics[metrics["run_status"] != "running"]  # unfinished runs: listed as skipped by the caller
    metrics = metrics.sort_values(["created_utc", "run_id"], kind="stable")
    metrics = metrics.drop_duplicates(["model", "task", "seq_len", "metric"], keep="last")
    losses = store.train_log_frame(engine).reindex(columns=LOSS_COLUMNS)
    all_points = store.points_frame(engine)
    points, other = _points(all_points, runs)
    bench = _other_benchmarks(all_points, runs, other)
    ruler = _ruler_frame(engine, metrics)
    if models:
        known = set(runs["model"]) | set(points["model"])
        unknown = [m for m in models if m not in known]
        if unknown:
            raise ValueError(f"--models: {', '.join(unknown)} not in the store; stored: {', '.join(sorted(known))}")
        ruler, metrics = ruler[ruler["model"].isin(models)], metrics[metrics["model"].isin(models)]
        losses, points = losses[losses["run"].isin(models)], points[points["model"].isin(models)]
    return StoreData(ruler=ruler, metrics=metrics, losses=losses, points=points, other_points=other, source=url,
                     benchmarks=bench)


def _other_benchmarks(df: pd.DataFrame, runs: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """Records of the benchmark runs that are not serving sweeps (upcycle speed, RULER throughput, ...), with
    each run's device, git sha and date: shown as tables, as stored."""
    if df.empty or not names:
        return pd.DataFrame()
    df = df[df["benchmark"].isin(names)].dropna(axis=1, how="all")
    meta = runs.set_index("id")[["device", "git_sha", "created_utc"]]
    suffix = "\x00run"  # no record key can end so
    out = df.join(meta, on="run_id", rsuffix=suffix)
    for col in meta.columns:  # a record that names its own device / sha keeps it; the run's fills the gaps
        if col + suffix in out.columns:
            out[col] = out[col].fillna(out.pop(col + suffix))
    return out.dropna(axis=1, how="all").reset_index(drop=True)


def _ruler_frame(engine, metrics: pd.DataFrame) -> pd.DataFrame:
    rows = store.ruler_rows(engine)
    json_rows = metrics[(metrics["kind"] == "ruler-json") & (metrics["metric"] == "score")]
    rows += [{"model": r.model, "task": r.task, "seq_len": int(r.seq_len), "score": r.value, "n": r.n,
              "created_utc": r.created_utc, "run_file": r.source} for r in json_rows.itertuples()]  # fmt: skip
    return results_frame(rows, skipped=[]).reindex(columns=RESULT_COLUMNS)


def _points(df: pd.DataFrame, runs: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    cols = ["model", "seq_len", "status", *(f for f, _ in F.SERVING_PANELS), *F.SERVING_BOUNDS.values(), "benchmark",
            "run_id"]
    if df.empty:
        return pd.DataFrame(columns=cols), []
    # A run whose records carry serving fields is a sweep; its OOM records (all fields null) are points too.
    # Records tagged "check" (parity checks, bandwidth-bound fractions) are not context-length points.
    if "check" in df:
        df = df[df["check"].isna()]
    # A point a run skipped (its budget ran out, an earlier context failed) holds no measurement: not drawn.
    if "status" in df:
        df = df[df["status"] != "skipped"]
    measured = df.reindex(columns=list(SERVING_FIELDS)).notna().any(axis=1)
    serving = df["run_id"].isin(df.loc[measured, "run_id"])
    other = sorted(df.loc[~serving, "benchmark"].unique())
    df = df[serving & df.reindex(columns=["seq_len"])["seq_len"].notna()].copy()
    names = runs.set_index("id")["model"]
    label = df["model"] if "model" in df else pd.Series(None, index=df.index, dtype=object)
    df["model"] = label.where(label.notna(), df["run_id"].map(names))
    if "variant" in df:  # e.g. the same model decoded without CUDA graphs: its own series, not a duplicate
        variant = df["variant"].fillna("").astype(str)
        df["model"] = df["model"].where(variant == "", df["model"] + " [" + variant + "]")
    if "batch_size" in df:  # batch 8 of a model is its own series (one point per model and context below)
        batch = pd.to_numeric(df["batch_size"], errors="coerce").fillna(1).astype(int)
        df["model"] = df["model"].where(batch == 1, df["model"] + " B=" + batch.astype(str))
    df["status"] = df["status"].fillna("ok") if "status" in df else "ok"
    df = df.reindex(columns=cols)
    # the newest run's value of a (benchmark, model, context) point wins, whatever the import order
    if "created_utc" in runs:
        df["_created"] = df["run_id"].map(runs.set_index("id")["created_utc"])
        df = df.sort_values(["_created", "run_id"], kind="stable").drop(columns="_created")
    else:
        df = df.sort_values(["run_id"], kind="stable")
    df = df.drop_duplicates(["benchmark", "model", "seq_len"], keep="last")
    df = df.sort_values(["model", "seq_len"]).reset_index(drop=True)
    df["seq_len"] = df["seq_len"].astype(int)
    return df, other


def _nodata(text: str) -> str:
    return f'<p class="nodata">{html.escape(text)}</p>\n'


def build(data: StoreData, title: str) -> Report:
    """Assemble the page from :func:`load_store` output (see the module docstring for the sections)."""
    tables_json = load_paper_tables()
    paper = paper_frame(tables_json)
    names = sorted(set(data.ruler["model"]) | set(data.metrics["model"]))
    matches = {m: row for m in names if (row := match_paper_row(m, paper)) is not None}
    figs: dict[str, go.Figure] = {}
    tables: dict[str, pd.DataFrame] = {}
    caveats = [c for c in tables_json.get("_caveats", []) if c.startswith("table")]
    parts = [_figure1_section(data, paper, caveats, figs, tables), _ruler_section(data, matches, figs, tables),
             _commonsense_section(data, matches, tables), _serving_section(data, figs, tables),
             _length_finding_section(data, paper, figs, tables), _training_section(data, figs),
             _benchmarks_section(data, tables)]  # fmt: skip
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    matched = ", ".join(f"{m} = {F.paper_label(r)}" for m, r in matches.items()) or "none"
    meta = (f"{len(names)} checkpoint(s); paper rows matched by name: {html.escape(matched)}; generated {now} by "
            f"hylo-bench {__version__} from <code>{html.escape(data.source)}</code>")  # fmt: skip
    page = (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
        f"<style>{H.CSS} .nodata {{ color: #777; font-style: italic; }}</style>\n"
        f"<script>{plotly.offline.get_plotlyjs()}</script>\n</head>\n<body>\n"
        f'<h1>{html.escape(title)}</h1>\n<p class="meta">{meta}</p>\n' + H.skipped_html(data.skipped) + "".join(parts)
        + f"<script>{H.LOADER}</script>\n</body>\n</html>\n"
    )  # fmt: skip
    return Report(html=page, figures=figs, tables=tables)


def _figure1_section(data: StoreData, paper: pd.DataFrame, caveats: list[str], figs: dict, tables: dict) -> str:
    means = ruler_means(data.ruler) if not data.ruler.empty else pd.DataFrame(columns=["model", "seq_len", "score"])
    gsm = data.metrics[(data.metrics["task"] == "gsm8k") & (data.metrics["metric"] == GSM8K_METRIC)]
    points, notes = F.figure1_points(means, gsm.set_index("model")["value"])
    figs["figure1"] = F.figure1(points, paper)
    tables["figure1_points"] = points
    out = "<h2>Figure 1: GSM8K vs mean RULER (8K-64K)</h2>\n"
    if points.empty:
        out += _nodata(f"No checkpoint in the store has both GSM8K ({GSM8K_METRIC}) and RULER at 8K, 16K, 32K "
                       "and 64K; only the paper's points are drawn.")  # fmt: skip
    if notes:
        out += '<p class="meta">Not drawn: ' + html.escape("; ".join(notes)) + ".</p>\n"
    out += ('<p class="meta">Paper points: Tables 2-4, x = mean of the printed R8K..R64K (recomputed). Caveats from '
            "the tables file: " + html.escape(" / ".join(caveats) or "none") + ".</p>\n")
    return out + H.figure_html("figure1", figs["figure1"])


def _ruler_section(data: StoreData, matches: dict, figs: dict, tables: dict) -> str:
    out = "<h2>RULER mean vs context length</h2>\n"
    if data.ruler.empty:
        return out + _nodata("No RULER results in the store (run `hylo-bench ruler` or import RULER results).")
    figs["ruler-mean"] = F.ruler_length_figure(data.ruler, {m: r for m, r in matches.items()
                                                              if m in set(data.ruler["model"])})
    out += H.figure_html("ruler-mean", figs["ruler-mean"])
    out += '<h2>RULER per task</h2>\n<p class="meta">The paper publishes no per-task RULER numbers.</p>\n'
    for i, fig in enumerate(F.task_figures(data.ruler)):
        figs[f"ruler-tasks-{i}"] = fig
        out += H.figure_html(f"ruler-tasks-{i}", fig)
    out += "<h2>RULER scores per length (0-100)</h2>\n"
    for seq_len, table in task_tables(data.ruler).items():
        tables[f"ruler_{seq_len}"] = table
        out += f"<h3>{F.format_tokens(seq_len)} ({seq_len} tokens)</h3>\n" + H.scores_table_html(table)
    tables["models"] = models_table(data.ruler)
    return out + "<h2>Models</h2>\n" + H.text_table_html(tables["models"])


def _commonsense_section(data: StoreData, matches: dict, tables: dict) -> str:
    out = "<h2>Commonsense (lm-eval, 0-shot) and GSM8K</h2>\n"
    m = data.metrics
    want = m["task"].isin(F.COMMONSENSE_TASKS.values()) & (m["metric"] == COMMONSENSE_METRIC)
    scores = pd.concat([m[want], m[(m["task"] == "gsm8k") & (m["metric"] == GSM8K_METRIC)]])
    if not want.any():
        return out + _nodata(f"No commonsense results ({COMMONSENSE_METRIC}) in the store (import lm-eval "
                             "results_*.json of arc_easy, arc_challenge, hellaswag, openbookqa, piqa, race, "
                             "winogrande).")  # fmt: skip
    table = F.commonsense_table(scores[["model", "task", "value"]], matches, COMMONSENSE_METRIC)
    tables["commonsense"] = table
    body = ["<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in table.columns) + "</tr>"]
    for r in table.itertuples(index=False):
        cells = [f'<td class="text">{html.escape(str(v))}</td>' for v in r[:3]]
        cells += ["<td>-</td>" if pd.isna(v) else f"<td>{v:.1f}</td>" for v in r[3:]]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return out + (f'<p class="meta">Scores 0-100. Ours: lm-eval <code>{COMMONSENSE_METRIC}</code> per task and GSM8K '
                  f"<code>{GSM8K_METRIC}</code> (the paper does not say acc vs acc_norm or which GSM8K filter; "
                  "these are assumed, as in <code>compare</code>). avg_7 = mean of the 7 tasks, blank unless all 7 "
                  "are present (the paper's Avg).</p>\n<table>\n" + "\n".join(body) + "\n</table>\n")  # fmt: skip


def _serving_section(data: StoreData, figs: dict, tables: dict) -> str:
    out = "<h2>Serving: memory and speed vs context length (paper Figure 5)</h2>\n"
    if data.other_points:
        out += (f'<p class="meta">Benchmark records without serving fields ({", ".join(SERVING_FIELDS)}) are not '
                f"drawn: {html.escape(', '.join(data.other_points))}.</p>\n")  # fmt: skip
    if data.points.empty:
        return out + _nodata("No serving sweep points in the store (import sweep / benchmark JSON whose records "
                             "have seq_len, status and kv_cache_gib / peak_memory_gib / ttft_s / tokens_per_s).")
    figs["serving"] = F.serving_figure(data.points)
    tables["serving_points"] = data.points
    num_oom = int((data.points["status"] == "oom").sum())
    return out + f'<p class="meta">{num_oom} OOM point(s), drawn as red crosses.</p>\n' + \
        H.figure_html("serving", figs["serving"])


LENGTH_FINDING_FIELDS = ("model_role", "task", "seq_len", "score", "ci_low", "ci_high")


def _length_finding_section(data: StoreData, paper: pd.DataFrame, figs: dict, tables: dict) -> str:
    """RULER vs length of the length-generalisation benchmark (teacher / S / L roles with intervals) next to the
    paper's 8K- and 64K-trained rows; absent when no such benchmark is stored."""
    b = data.benchmarks
    if b.empty or not set(LENGTH_FINDING_FIELDS) <= set(b.columns):
        return ""
    rows = b.dropna(subset=list(LENGTH_FINDING_FIELDS))
    if rows.empty:
        return ""
    latest = rows[rows["run_id"] == rows["run_id"].max()]
    figs["length-finding"] = F.length_finding_figure(latest, paper)
    means = latest[latest["task"] == "mean"].pivot_table(index="model_role", columns="seq_len", values="score")
    tables["length_finding"] = means.reset_index()
    prov = ", ".join(f"{k} {latest.iloc[0][k]}" for k in ("benchmark", "device", "git_sha") if k in latest)
    return ("<h2>Length generalisation (the paper's length finding)</h2>\n<p class=\"meta\">"
            + html.escape(prov) + "; error bars: 95 % Wilson intervals over all samples of the 11-task mean.</p>\n"
            + H.figure_html("length-finding", figs["length-finding"]))


def _training_section(data: StoreData, figs: dict) -> str:
    out = "<h2>Upcycling training loss per stage</h2>\n"
    if data.losses.empty:
        return out + _nodata("No training logs in the store (import an upcycle manifest.json).")
    figs["upcycle-loss"] = F.loss_figure(data.losses)
    return out + H.figure_html("upcycle-loss", figs["upcycle-loss"])


def _benchmarks_section(data: StoreData, tables: dict) -> str:
    if data.benchmarks.empty:
        return ""
    out = ("<h2>Other benchmarks</h2>\n<p class=\"meta\">Benchmark JSON whose records are not serving-sweep points "
           "(no kv_cache_gib / ttft_s), one table per benchmark as stored; units are in the column names.</p>\n")
    for name, part in data.benchmarks.groupby("benchmark", sort=True):
        first = part.iloc[0]
        table = part.drop(columns=["run_id", "benchmark", "device", "git_sha", "created_utc"], errors="ignore")
        table = table.dropna(axis=1, how="all")
        tables[f"benchmark_{name}"] = table
        prov = ", ".join(f"{k} {first[k]}" for k in ("device", "git_sha", "created_utc") if k in part and
                         pd.notna(first[k]))
        out += (f"<h3>{html.escape(str(name))}</h3>\n<p class=\"meta\">{html.escape(prov)}</p>\n"
                + H.text_table_html(table.astype(object).where(table.notna(), "-")))
    return out


def export(rep: Report, out_dir: str | Path) -> list[str]:
    """Write every table as CSV and Markdown, and every figure as PNG and SVG (kaleido) into ``out_dir``.

    Returns:
        Notes for the user: empty when everything was written; otherwise why the images were skipped.
    """
    out_dir = Path(out_dir)
    for name, table in rep.tables.items():
        index = not isinstance(table.index, pd.RangeIndex)
        atomic_write_text(out_dir / f"{name}.csv", table.to_csv(index=index))
        atomic_write_text(out_dir / f"{name}.md", table.to_markdown(index=index) + "\n")
    try:
        import kaleido  # noqa: F401
        import plotly.io as pio
    except ImportError:
        return ["PNG/SVG export skipped: kaleido is not installed (pip install hylo-bench[images])"]
    ids = list(rep.figures)
    paths = [out_dir / f"{i}.{ext}" for ext in ("png", "svg") for i in ids]
    for name in ("kaleido", "choreographer", "logistro"):  # per-step INFO lines drown the command's output
        logging.getLogger(name).setLevel(logging.WARNING)
    figs = [rep.figures[i] for i in ids] * 2
    try:
        pio.write_images(figs, paths, width=1200, height=[f.layout.height or 600 for f in figs])
    except Exception as exc:  # kaleido raises its own types when it cannot start a browser
        return [f"PNG/SVG export skipped: kaleido could not render ({type(exc).__name__}: {exc}); it needs Chrome "
                "or Chromium (apt-get install chromium, or set BROWSER_PATH)"]
    return []


def write_tables(df: pd.DataFrame, tables_dir: str | Path) -> list[Path]:
    """Write the report's tables as CSV (full precision) into ``tables_dir``.

    Files: ``ruler_records.csv`` (tidy rows), ``ruler_mean.csv`` (models x lengths), ``ruler_<seq_len>.csv``
    (tasks + mean x models, one per length in tokens) and ``models.csv``.

    Returns:
        The written paths.
    """
    tables_dir = Path(tables_dir)
    means = ruler_means(df).pivot(index="model", columns="seq_len", values="score")
    tables = {"ruler_records.csv": df.to_csv(index=False), "ruler_mean.csv": means.to_csv(),
              "models.csv": models_table(df).to_csv(index=False)}  # fmt: skip
    for seq_len, table in task_tables(df).items():
        tables[f"ruler_{seq_len}.csv"] = table.to_csv()
    paths = []
    for name, text in tables.items():
        atomic_write_text(tables_dir / name, text)
        paths.append(tables_dir / name)
    return paths


def build_store_report(db, results_dir: str | Path, out_html: str | Path, *, title: str | None = None,
                       models: list[str] | None = None, images_dir: str | Path | None = None,
                       sync: bool = True, engine=None, skipped: list[tuple[str, str]] | None = None,
                       tables_dir: str | Path | None = None) -> tuple[Path, list[str]]:
    """Bring the store up to date with ``results_dir``, read it, write the report (atomically), and export
    figures and tables when ``images_dir`` is given.

    Args:
        db: store path / URL (None: ``$HYLO_BENCH_DB``, else ``RESULTS_DIR/hylo_bench.sqlite``).
        sync: first import the results files under ``results_dir`` that the store lacks
            (:func:`store.sync_dir`; idempotent); files that fail are listed in the report. When False (or
            ``results_dir`` does not exist) the store must already exist.
        engine: an open store to read instead of ``db`` (``report --files-only``: an in-memory store the files
            were imported into); ``skipped``: files already found unimportable, listed in the page.
        tables_dir: also write the RULER tables as CSV there (:func:`write_tables`).

    Returns:
        ``(path, notes)``: the HTML path and :func:`export`'s notes.

    Raises:
        ValueError: no store and nothing to import, an empty store, unknown ``models``.
    """
    skipped = list(skipped or [])
    in_memory = engine is not None
    if not in_memory and sync and Path(results_dir).is_dir():
        engine = store.open_store(db, results_dir)
        skipped += store.sync_dir(engine, results_dir)[1]
    elif not in_memory:
        engine = store.open_store(db, results_dir, create=False)
    data = load_store(engine, models)
    data.skipped = skipped + [(source, reason) for _, source, reason in store.unfinished_runs(engine,
                                                                                           with_ids=not in_memory)]
    if in_memory:
        data.source = str(results_dir)  # the store lives only in this process: name the files it was read from
    rep = build(data, title or f"hylo-bench report: {Path(results_dir).resolve().name}")
    atomic_write_text(out_html, rep.html)
    if tables_dir is not None:
        write_tables(data.ruler, tables_dir)
    notes = export(rep, images_dir) if images_dir is not None else []
    for note in notes:
        logger.warning(note)
    return Path(out_html), notes


def figure_data(page: str) -> dict[str, dict]:
    """The ``{data, layout}`` of every figure embedded in a report page, keyed by figure id."""
    found = re.findall(r'<script type="application/json" id="fig-([^"]+)">(.*?)</script>', page, flags=re.DOTALL)
    return {fig_id: json.loads(text) for fig_id, text in found}
