"""The report page's HTML pieces: styles, the figure loader, figures embedded as JSON, score and text tables, the
list of skipped files. Figure data are embedded as ``<script type="application/json" id="fig-NAME">`` (plotly
``{data, layout}``) and drawn into ``<div id="plot-NAME">`` by :data:`LOADER`, so tests and scripts read the numbers
back. Never imports torch.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

import pandas as pd
import plotly.graph_objects as go

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.text, th.row { text-align: left; }
tr.mean td, tr.mean th { font-weight: bold; border-top: 2px solid #888; }
.meta { color: #555; } .warn { background: #fff4e5; border: 1px solid #f0b060; padding: 0.5em 1em; }
.plot { width: 100%; min-height: 420px; }
"""
# Draws every embedded figure; the JSON stays the single source of truth for the plotted numbers.
LOADER = """
document.querySelectorAll('script[type="application/json"][id^="fig-"]').forEach(function (el) {
  var spec = JSON.parse(el.textContent);
  Plotly.newPlot('plot-' + el.id.slice(4), spec.data, spec.layout, {responsive: true, displaylogo: false});
});
"""



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


def figure_html(fig_id: str, fig: go.Figure) -> str:
    return (f'<div class="plot" id="plot-{fig_id}"></div>\n'
            f'<script type="application/json" id="fig-{fig_id}">{figure_json(fig)}</script>\n')  # fmt: skip


def score_cell(value: float, mark: str = "") -> str:
    if pd.isna(value):
        return "<td>-</td>"
    alpha = 0.45 * min(max(value, 0.0), 100.0) / 100.0
    return f'<td style="background: rgba(31, 119, 180, {alpha:.2f})" title="{float(value)!r}">{value:.1f}{mark}</td>'


def scores_table_html(table: pd.DataFrame) -> str:
    """Task x model score table; the ``"mean"`` row is styled as a total and marked where tasks are missing."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = [f'<tr><th class="row">task</th>{head}</tr>']
    tasks = table.drop(index="mean")
    num_tasks = tasks.notna().sum()
    for task, values in table.iterrows():
        if task == "mean":
            # The paper's RULER score is the mean over all tasks; a mean over fewer tasks is not comparable.
            marks = ["*" if num_tasks[m] < len(tasks) else "" for m in table.columns]
            cells = "".join(score_cell(v, mark) for v, mark in zip(values, marks))
            rows.append(f'<tr class="mean"><th class="row">mean</th>{cells}</tr>')
        else:
            cells = "".join(score_cell(v) for v in values)
            rows.append(f'<tr><th class="row">{html.escape(str(task))}</th>{cells}</tr>')
    note = ""
    if (num_tasks < len(tasks)).any():
        note = f'<p class="meta">* mean over fewer than the {len(tasks)} tasks listed; not comparable.</p>\n'
    return "<table>\n" + "\n".join(rows) + "\n</table>\n" + note


def text_table_html(table: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = [f"<tr>{head}</tr>"]
    for values in table.itertuples(index=False):
        rows.append("<tr>" + "".join(f'<td class="text">{html.escape(str(v))}</td>' for v in values) + "</tr>")
    return "<table>\n" + "\n".join(rows) + "\n</table>\n"


def skipped_html(skipped: list[tuple[str, str]]) -> str:
    if not skipped:
        return ""
    items = "".join(f"<li><code>{html.escape(p)}</code>: {html.escape(r)}</li>" for p, r in skipped)
    return f'<div class="warn"><b>{len(skipped)} file(s) skipped</b><ul>{items}</ul></div>\n'
