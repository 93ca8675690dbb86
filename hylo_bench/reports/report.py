"""Render a results directory into one self-contained, offline HTML report (plotly.js inlined once).

Each figure's data is embedded as ``<script type="application/json" id="fig-NAME">`` (plotly ``{data, layout}``)
and drawn into ``<div id="plot-NAME">`` by a small loader, so tests and scripts can read the numbers back.
Scores are 0-100, lengths in tokens. Never imports torch.
"""

from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import plotly.offline

from hylo_bench import __version__
from hylo_bench.io_utils import atomic_write_text, check_output_path
from hylo_bench.reports.results import load_manifests, load_results, models_table, ruler_means, task_tables

_TEMPLATE = "plotly_white"
_COLORS = ["#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.text, th.row { text-align: left; }
tr.mean td, tr.mean th { font-weight: bold; border-top: 2px solid #888; }
.meta { color: #555; } .warn { background: #fff4e5; border: 1px solid #f0b060; padding: 0.5em 1em; }
.plot { width: 100%; min-height: 420px; }
"""
# Draws every embedded figure; the JSON stays the single source of truth for the plotted numbers.
_LOADER = """
document.querySelectorAll('script[type="application/json"][id^="fig-"]').forEach(function (el) {
  var spec = JSON.parse(el.textContent);
  Plotly.newPlot('plot-' + el.id.slice(4), spec.data, spec.layout, {responsive: true, displaylogo: false});
});
"""


def format_tokens(num_tokens: int) -> str:
    """Short label for a length in tokens: 1024 -> "1K", 65536 -> "64K", 1048576 -> "1M", 1000 -> "1000"."""
    if num_tokens % (1 << 20) == 0:
        return f"{num_tokens >> 20}M"
    if num_tokens % (1 << 10) == 0:
        return f"{num_tokens >> 10}K"
    return str(num_tokens)


def _jsonable(obj: Any) -> Any:
    """Plain JSON types; NaN and inf become null (``JSON.parse`` rejects NaN)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):  # numpy scalars
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def figure_json(fig: go.Figure) -> str:
    """Serialize a figure to JSON that is safe inside a ``<script>`` element (``<``, ``>``, ``&`` escaped)."""
    text = json.dumps(_jsonable(fig.to_plotly_json()), allow_nan=False, ensure_ascii=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _label(name: str) -> str:
    # Plotly renders a small HTML subset in names and titles and decodes entities, so escape to show names as-is.
    return html.escape(name, quote=False)


def _length_axis(seq_lens: list[int]) -> dict[str, Any]:
    return {"type": "log", "tickvals": seq_lens, "ticktext": [format_tokens(n) for n in seq_lens],
            "title": {"text": "context length (tokens)"}}  # fmt: skip


def mean_figure(df: pd.DataFrame) -> go.Figure:
    """RULER mean score (0-100) vs context length, one line per model, log2-spaced length ticks.

    Args:
        df: Output of :func:`load_results`.
    """
    means = ruler_means(df)
    fig = go.Figure()
    for i, (model, part) in enumerate(means.groupby("model", sort=True)):
        fig.add_trace(go.Scatter(
            x=part["seq_len"].tolist(), y=part["score"].tolist(), customdata=part["num_tasks"].tolist(),
            mode="lines+markers", name=_label(model), meta={"model": model}, line={"color": _COLORS[i % len(_COLORS)]},
            hovertemplate="%{x} tokens: %{y:.2f} (mean of %{customdata} tasks)",
        ))  # fmt: skip
    seq_lens = sorted(int(n) for n in means["seq_len"].unique())
    fig.update_layout(
        template=_TEMPLATE, title={"text": "RULER mean score vs context length"}, xaxis=_length_axis(seq_lens),
        yaxis={"title": {"text": "RULER mean score (0-100)"}, "range": [0, 100]}, hovermode="x unified",
    )
    return fig


def task_figures(df: pd.DataFrame) -> list[go.Figure]:
    """Per-task RULER scores (0-100) vs length: one task x length heatmap per model, on shared axes.

    Args:
        df: Output of :func:`load_results`.

    Returns:
        One figure per model, sorted by model name; missing cells are NaN (drawn empty).
    """
    seq_lens = sorted(int(n) for n in df["seq_len"].unique())
    tasks = sorted(df["task"].unique())
    figures = []
    for model, part in df.groupby("model", sort=True):
        grid = part.pivot(index="task", columns="seq_len", values="score").reindex(index=tasks, columns=seq_lens)
        fig = go.Figure(go.Heatmap(
            z=grid.to_numpy().tolist(), x=[format_tokens(n) for n in seq_lens], y=tasks, zmin=0, zmax=100,
            colorscale="Viridis", texttemplate="%{z:.1f}", colorbar={"title": {"text": "score"}},
            hovertemplate="%{y} @ %{x}: %{z:.2f}<extra></extra>", meta={"model": model, "seq_len": seq_lens},
        ))  # fmt: skip
        fig.update_layout(
            template=_TEMPLATE, title={"text": f"RULER per task: {_label(model)}"},
            xaxis={"title": {"text": "context length (tokens)"}, "type": "category"},
            yaxis={"autorange": "reversed"}, height=max(320, 40 + 26 * len(tasks)),
        )
        figures.append(fig)
    return figures


def loss_figure(losses: pd.DataFrame) -> go.Figure:
    """Upcycling training loss vs tokens, one line per (run, stage); ILD (summed layer L2) and KD (KL in
    nats/token) differ by orders of magnitude, so when both are present they get a panel each (ILD on top).

    Args:
        losses: Output of :func:`load_manifests` (non-empty).
    """
    from plotly.subplots import make_subplots

    kinds = losses["stage_kind"] if "stage_kind" in losses else pd.Series("", index=losses.index)
    both = {"ild", "kd"} <= set(kinds.dropna())
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.12, subplot_titles=("Enhanced-ILD", "KD (KL)")) \
        if both else go.Figure()
    for (run, _, stage), part in losses.groupby(["run", "stage_index", "stage"], sort=True):
        seq_len = int(part["stage_seq_len"].iloc[0])
        trace = go.Scatter(
            x=part["tokens"].tolist(), y=part["loss"].tolist(), customdata=part["step"].tolist(), mode="lines",
            name=_label(f"{run} / {stage} ({format_tokens(seq_len)})"),
            meta={"run": run, "stage": stage, "seq_len": seq_len},
            hovertemplate="step %{customdata}, %{x} tokens: loss %{y:.4f}",
        )  # fmt: skip
        if both:
            fig.add_trace(trace, row=1 if kinds.loc[part.index[0]] == "ild" else 2, col=1)
        else:
            fig.add_trace(trace)
    fig.update_layout(template=_TEMPLATE, title={"text": "Upcycling training loss per stage"},
                      height=720 if both else None)
    fig.update_xaxes(title={"text": "tokens"})
    fig.update_yaxes(title={"text": "loss"})
    return fig


def _figure_html(fig_id: str, fig: go.Figure) -> str:
    return (f'<div class="plot" id="plot-{fig_id}"></div>\n'
            f'<script type="application/json" id="fig-{fig_id}">{figure_json(fig)}</script>\n')  # fmt: skip


def _score_cell(value: float, mark: str = "") -> str:
    if pd.isna(value):
        return "<td>-</td>"
    alpha = 0.45 * min(max(value, 0.0), 100.0) / 100.0
    return f'<td style="background: rgba(31, 119, 180, {alpha:.2f})" title="{float(value)!r}">{value:.1f}{mark}</td>'


def _scores_table_html(table: pd.DataFrame) -> str:
    """Task x model score table; the ``"mean"`` row is styled as a total and marked where tasks are missing."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = [f'<tr><th class="row">task</th>{head}</tr>']
    tasks = table.drop(index="mean")
    num_tasks = tasks.notna().sum()
    for task, values in table.iterrows():
        if task == "mean":
            # The paper's RULER score is the mean over all tasks; a mean over fewer tasks is not comparable.
            marks = ["*" if num_tasks[m] < len(tasks) else "" for m in table.columns]
            cells = "".join(_score_cell(v, mark) for v, mark in zip(values, marks))
            rows.append(f'<tr class="mean"><th class="row">mean</th>{cells}</tr>')
        else:
            cells = "".join(_score_cell(v) for v in values)
            rows.append(f'<tr><th class="row">{html.escape(str(task))}</th>{cells}</tr>')
    note = ""
    if (num_tasks < len(tasks)).any():
        note = f'<p class="meta">* mean over fewer than the {len(tasks)} tasks listed; not comparable.</p>\n'
    return "<table>\n" + "\n".join(rows) + "\n</table>\n" + note


def _text_table_html(table: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = [f"<tr>{head}</tr>"]
    for values in table.itertuples(index=False):
        rows.append("<tr>" + "".join(f'<td class="text">{html.escape(str(v))}</td>' for v in values) + "</tr>")
    return "<table>\n" + "\n".join(rows) + "\n</table>\n"


def _skipped_html(skipped: list[tuple[str, str]]) -> str:
    if not skipped:
        return ""
    items = "".join(f"<li><code>{html.escape(p)}</code>: {html.escape(r)}</li>" for p, r in skipped)
    return f'<div class="warn"><b>{len(skipped)} file(s) skipped</b><ul>{items}</ul></div>\n'


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


def build_report(
    results_dir: str | Path,
    out_html: str | Path,
    title: str | None = None,
    *,
    strict: bool = False,
    tables_dir: str | Path | None = None,
    db: str | Path | None = None,
    models: list[str] | None = None,
    images_dir: str | Path | None = None,
    files_only: bool = False,
) -> Path:
    """Build one self-contained HTML report (opens offline).

    By default from the results store (``db``, else ``$HYLO_BENCH_DB``, else ``RESULTS_DIR/hylo_bench.sqlite``),
    after importing the result files under ``results_dir`` it lacks: Figure 1, RULER vs length with the paper's
    rows, per-task heatmaps, commonsense table, serving sweep, training curves (``store_report``).

    With ``files_only``, a lighter report from the RULER result files and upcycle manifests under ``results_dir``
    alone, touching no database: RULER mean vs length, per-task heatmaps, per-length score tables, a models
    table, and upcycle training losses.

    Args:
        results_dir: Directory searched recursively for RULER result files and upcycle manifests.
        out_html: Output path; written atomically, parent folders created.
        title: Page title; defaults to ``"hylo-bench report: <results_dir name>"``.
        strict: Raise on a malformed result file instead of skipping it with a warning (listed in the report).
        tables_dir: If given, also write every table as CSV there (see :func:`write_tables`).
        db: The results store (path or SQLAlchemy URL, see ``store.resolve_url``).
        models: Only these model names (store report).
        images_dir: Also export every figure as PNG/SVG and every table as CSV/Markdown there (store report).
        files_only: The file-scan report (no store).

    Returns:
        The path of the written HTML file.

    Raises:
        ValueError: if no results are found, or (strict, files only) a result file is malformed.
    """
    results_dir, out_html = Path(results_dir), Path(out_html)
    if out_html.is_dir():
        raise ValueError(f"-o {str(out_html)!r} is a directory; give the HTML file to write, e.g. {out_html / 'report.html'}")
    check_output_path(out_html, "-o", is_dir=False)
    if images_dir is not None:
        check_output_path(images_dir, "--images", is_dir=True)
    if not files_only:
        from hylo_bench.reports.store_report import build_store_report

        return build_store_report(db, results_dir, out_html, title=title, models=models, images_dir=images_dir)[0]
    if models or images_dir is not None or db is not None:
        raise ValueError("--models, --images and --db use the results store; drop --files-only")
    df, losses = load_results(results_dir, strict=strict), load_manifests(results_dir, strict=strict)
    skipped = df.attrs["skipped"] + losses.attrs["skipped"]
    title = title or f"hylo-bench report: {results_dir.resolve().name}"
    source = str(results_dir)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    meta = (f"{df['model'].nunique()} model(s), {df['run_file'].nunique()} run file(s), "
            f"{len(skipped)} skipped; generated {now} by hylo-bench {__version__} from "
            f"<code>{html.escape(source)}</code>")  # fmt: skip
    parts = [f"<h1>{html.escape(title)}</h1>\n<p class=\"meta\">{meta}</p>\n", _skipped_html(skipped)]
    parts.append("<h2>RULER mean vs context length</h2>\n" + _figure_html("ruler-mean", mean_figure(df)))
    parts.append("<h2>RULER per task</h2>\n")
    parts.extend(_figure_html(f"ruler-tasks-{i}", fig) for i, fig in enumerate(task_figures(df)))
    parts.append("<h2>RULER scores per length (0-100)</h2>\n")
    for seq_len, table in task_tables(df).items():
        parts.append(f"<h3>{format_tokens(seq_len)} ({seq_len} tokens)</h3>\n" + _scores_table_html(table))
    parts.append("<h2>Models</h2>\n" + _text_table_html(models_table(df)))
    if not losses.empty:
        parts.append("<h2>Upcycling training loss</h2>\n" + _figure_html("upcycle-loss", loss_figure(losses)))
    page = (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{html.escape(title)}</title>\n'
        f"<style>{_CSS}</style>\n<script>{plotly.offline.get_plotlyjs()}</script>\n</head>\n<body>\n"
        + "".join(parts) + f"<script>{_LOADER}</script>\n</body>\n</html>\n"
    )  # fmt: skip
    atomic_write_text(out_html, page)
    if tables_dir is not None:
        write_tables(df, tables_dir)
    return out_html
