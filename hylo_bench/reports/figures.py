"""Plotly figures and tables of the report: RULER mean vs length and per task, the paper's Figure 1, RULER vs length
with the paper's rows, the commonsense table, the serving sweep in the shape of the paper's Figure 5, and training
curves.

Builders take tidy frames (see ``store_report``) and return figures whose trace data are the stored values.
Scores are 0-100, lengths in tokens, memory in GiB, times in seconds. Never imports torch.
"""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from hylo_bench.reports.paper import COMMONSENSE_COLUMNS, RULER_COLUMNS
from hylo_bench.reports.results import ruler_means

TEMPLATE = "plotly_white"
COLORS = ["#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def format_tokens(num_tokens: int) -> str:
    """Short label for a length in tokens: 1024 -> "1K", 65536 -> "64K", 1048576 -> "1M", 1000 -> "1000"."""
    if num_tokens % (1 << 20) == 0:
        return f"{num_tokens >> 20}M"
    if num_tokens % (1 << 10) == 0:
        return f"{num_tokens >> 10}K"
    return str(num_tokens)


def label(name: str) -> str:
    # Plotly renders a small HTML subset in names and titles and decodes entities, so escape to show names as-is.
    return html.escape(name, quote=False)


def length_axis(seq_lens: list[int]) -> dict[str, Any]:
    return {"type": "log", "tickvals": seq_lens, "ticktext": [format_tokens(n) for n in seq_lens],
            "title": {"text": "context length (tokens)"}}  # fmt: skip


def mean_figure(df: pd.DataFrame) -> go.Figure:
    """RULER mean score (0-100) vs context length, one line per model, log2-spaced length ticks.

    Args:
        df: a RULER frame (``results.RESULT_COLUMNS``).
    """
    means = ruler_means(df)
    fig = go.Figure()
    for i, (model, part) in enumerate(means.groupby("model", sort=True)):
        fig.add_trace(go.Scatter(
            x=part["seq_len"].tolist(), y=part["score"].tolist(), customdata=part["num_tasks"].tolist(),
            mode="lines+markers", name=label(model), meta={"model": model}, line={"color": COLORS[i % len(COLORS)]},
            hovertemplate="%{x} tokens: %{y:.2f} (mean of %{customdata} tasks)",
        ))  # fmt: skip
    seq_lens = sorted(int(n) for n in means["seq_len"].unique())
    fig.update_layout(
        template=TEMPLATE, title={"text": "RULER mean score vs context length"}, xaxis=length_axis(seq_lens),
        yaxis={"title": {"text": "RULER mean score (0-100)"}, "range": [0, 100]}, hovermode="x unified",
    )
    return fig


def task_figures(df: pd.DataFrame) -> list[go.Figure]:
    """Per-task RULER scores (0-100) vs length: one task x length heatmap per model, on shared axes.

    Args:
        df: a RULER frame (``results.RESULT_COLUMNS``).

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
            template=TEMPLATE, title={"text": f"RULER per task: {label(model)}"},
            xaxis={"title": {"text": "context length (tokens)"}, "type": "category"},
            yaxis={"autorange": "reversed"}, height=max(320, 40 + 26 * len(tasks)),
        )
        figures.append(fig)
    return figures


def loss_figure(losses: pd.DataFrame) -> go.Figure:
    """Upcycling training loss vs tokens, one line per (run, stage); ILD (summed layer L2) and KD (KL in
    nats/token) differ by orders of magnitude, so when both are present they get a panel each (ILD on top).

    Args:
        losses: training-log rows (``results.LOSS_COLUMNS``, non-empty).
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
            name=label(f"{run} / {stage} ({format_tokens(seq_len)})"),
            meta={"run": run, "stage": stage, "seq_len": seq_len},
            hovertemplate="step %{customdata}, %{x} tokens: loss %{y:.4f}",
        )  # fmt: skip
        if both:
            fig.add_trace(trace, row=1 if kinds.loc[part.index[0]] == "ild" else 2, col=1)
        else:
            fig.add_trace(trace)
    fig.update_layout(template=TEMPLATE, title={"text": "Upcycling training loss per stage"},
                      height=720 if both else None)
    fig.update_xaxes(title={"text": "tokens"})
    fig.update_yaxes(title={"text": "loss"})
    return fig


FIGURE1_LENGTHS = tuple(RULER_COLUMNS.values())  # 8K, 16K, 32K, 64K
# Paper column -> lm-eval task, in the paper's column order; the 7-task average is the paper's "Avg".
COMMONSENSE_TASKS = dict(zip(COMMONSENSE_COLUMNS, (
    "arc_challenge", "arc_easy", "hellaswag", "openbookqa", "piqa", "race", "winogrande")))  # fmt: skip
# Serving panels (record field, axis title), in the layout of the paper's Figure 5 (memory on top, speed below).
SERVING_PANELS = (
    ("kv_cache_gib", "KV cache (GiB)"), ("peak_memory_gib", "peak memory (GiB)"),
    ("ttft_s", "TTFT (s)"), ("tokens_per_s", "decode tokens/s"),
    ("tpot_s", "TPOT (s); dashed: its bandwidth bound"), ("fraction_of_bound", "share of the bandwidth bound"),
)  # fmt: skip
SERVING_BOUNDS = {"tpot_s": "bound_tpot_s"}
"""Panel field -> the record field drawn dashed next to it (:mod:`hylo_bench.serving.bound`)."""
_PAPER_STYLE = {"hylo": ("#d62728", "diamond"), "baseline": ("#7f7f7f", "circle-open")}


def paper_label(row: pd.Series) -> str:
    """``HyLo-Llama-4MLA12GDN@64K`` for a HyLo row, the model name for a baseline (no training context)."""
    ctx = row.get("train_ctx")
    return f"{row['model']}@{ctx}" if isinstance(ctx, str) and ctx else str(row["model"])


def figure1_points(ruler_means: pd.DataFrame, gsm8k: pd.Series) -> tuple[pd.DataFrame, list[str]]:
    """Our Figure 1 points: GSM8K and the mean of the per-length RULER means at 8K, 16K, 32K and 64K.

    Args:
        ruler_means: Columns ``model, seq_len, score`` (output of ``results.ruler_means``).
        gsm8k: GSM8K score (0-100) indexed by model.

    Returns:
        ``(points, notes)``: points has columns ``model, gsm8k, ruler_mean``; notes say why a model with only
        part of the data is left out.
    """
    rows, notes = [], []
    models = sorted(set(ruler_means["model"]) | set(gsm8k.index))
    for model in models:
        have = ruler_means[ruler_means["model"] == model].set_index("seq_len")["score"]
        missing = [format_tokens(n) for n in FIGURE1_LENGTHS if n not in have.index]
        if model not in gsm8k.index or missing:
            why = ([f"RULER at {', '.join(missing)}"] if missing else []) + ([] if model in gsm8k.index else ["GSM8K"])
            notes.append(f"{model}: no {' and no '.join(why)}")
            continue
        mean = math.fsum(have.loc[n] for n in FIGURE1_LENGTHS) / len(FIGURE1_LENGTHS)
        rows.append({"model": model, "gsm8k": float(gsm8k.loc[model]), "ruler_mean": mean})
    return pd.DataFrame(rows, columns=["model", "gsm8k", "ruler_mean"]), notes


def figure1(points: pd.DataFrame, paper: pd.DataFrame) -> go.Figure:
    """GSM8K vs mean RULER over 8K-64K: one point per checkpoint, the paper's Tables 2-4 rows overlaid, labelled.

    Args:
        points: Output of :func:`figure1_points`.
        paper: Output of ``paper.paper_frame`` (its ``ruler_mean`` is the mean of R8K..R64K).
    """
    fig = go.Figure()
    for group, part in paper.dropna(subset=["ruler_mean", "GSM8K"]).groupby("group", sort=False):
        color, symbol = _PAPER_STYLE.get(group, ("#7f7f7f", "circle"))
        labels = [paper_label(r) for _, r in part.iterrows()]
        fig.add_trace(go.Scatter(
            x=part["ruler_mean"].tolist(), y=part["GSM8K"].tolist(), text=labels, mode="markers+text",
            textposition="top center", textfont={"size": 8, "color": color}, marker={"color": color, "symbol": symbol},
            name=f"paper: {'HyLo' if group == 'hylo' else 'baselines'}",
            meta={"source": "paper", "group": group, "labels": labels},
            hovertemplate="%{text}: RULER %{x:.2f}, GSM8K %{y:.1f}<extra>paper</extra>",
        ))  # fmt: skip
    for r in points.itertuples():
        fig.add_trace(go.Scatter(
            x=[r.ruler_mean], y=[r.gsm8k], text=[label(r.model)], mode="markers+text", textposition="top left",
            marker={"size": 14, "symbol": "star"}, name=label(r.model), meta={"source": "store", "model": r.model},
            hovertemplate="%{text}: RULER %{x:.2f}, GSM8K %{y:.2f}<extra></extra>",
        ))  # fmt: skip
    fig.update_layout(
        template=TEMPLATE, title={"text": "Figure 1: GSM8K vs mean RULER over 8K-64K"}, height=640,
        legend={"orientation": "h", "y": -0.15},
        xaxis={"title": {"text": "mean RULER score, 8K/16K/32K/64K (0-100)"}},
        yaxis={"title": {"text": "GSM8K (0-100)"}},
    )
    return fig


def ruler_length_figure(df: pd.DataFrame, matches: dict[str, pd.Series]) -> go.Figure:
    """RULER mean vs context length per checkpoint (see :func:`mean_figure`) plus, dashed, the paper's RULER
    row (R8K..R64K) of each checkpoint that matches a released model by name.

    Args:
        df: RULER rows (``results.results_frame`` output).
        matches: Stored model name -> its paper row (``paper.match_paper_row``).
    """
    fig = mean_figure(df)
    colors = {t.meta["model"]: t.line.color for t in fig.data}  # the paper's line takes its checkpoint's colour
    lengths = {int(n) for n in df["seq_len"].unique()}
    for model, row in sorted(matches.items()):
        cols = [c for c in RULER_COLUMNS if row.get(c) is not None and not pd.isna(row.get(c))]
        fig.add_trace(go.Scatter(
            x=[RULER_COLUMNS[c] for c in cols], y=[float(row[c]) for c in cols], mode="lines+markers",
            line={"dash": "dash", "color": colors.get(model)}, marker={"symbol": "diamond-open"},
            name=label(f"paper: {paper_label(row)}"),
            meta={"source": "paper", "model": model, "paper_model": paper_label(row)},
            hovertemplate="%{x} tokens: %{y:.1f} (paper)",
        ))  # fmt: skip
        lengths |= {RULER_COLUMNS[c] for c in cols}
    fig.update_layout(xaxis=length_axis(sorted(lengths)), title={"text": "RULER mean score vs context length"})
    return fig


def commonsense_table(scores: pd.DataFrame, matches: dict[str, pd.Series], metric: str) -> pd.DataFrame:
    """Commonsense accuracy (0-100) per checkpoint, the 7-task average, and GSM8K; matched paper rows beside ours.

    Args:
        scores: Columns ``model, task, value`` for the commonsense tasks and ``gsm8k`` (one metric each).
        matches: Stored model name -> its paper row.
        metric: Name of the stored metric, for the row's ``metric`` column.

    Returns:
        One row per checkpoint (``source`` = "store") followed by its paper row (``source`` = "paper"), columns
        ``model, source, <7 tasks>, avg_7, gsm8k``; ``avg_7`` is NaN unless all 7 tasks are present.
    """
    tasks = list(COMMONSENSE_TASKS.values())
    wide = scores.pivot(index="model", columns="task", values="value").reindex(columns=tasks + ["gsm8k"])
    rows = []
    for model, values in wide.iterrows():
        row = {"model": model, "source": "store", "metric": metric, **values.to_dict()}
        rows.append(row | {"avg_7": _mean_all([row[t] for t in tasks])})
        if model in matches:
            p = matches[model]
            paper = {"model": f"paper: {paper_label(p)}", "source": "paper", "metric": "as printed",
                     "gsm8k": p.get("GSM8K")} | {t: p.get(c) for c, t in COMMONSENSE_TASKS.items()}  # fmt: skip
            rows.append(paper | {"avg_7": _mean_all([paper[t] for t in tasks])})
    cols = ["model", "source", "metric", *tasks, "avg_7", "gsm8k"]
    return pd.DataFrame(rows, columns=cols).astype({c: float for c in (*tasks, "avg_7", "gsm8k")})


def _mean_all(values: list[Any]) -> float:
    if any(v is None or pd.isna(v) for v in values):
        return math.nan
    return math.fsum(values) / len(values)


def serving_figure(points: pd.DataFrame) -> go.Figure:
    """KV cache and peak memory (top), TTFT and decode tokens/s (middle), TPOT with its memory-bandwidth bound
    dashed and the share of the bound reached (bottom) vs context length, one colour per model; out-of-memory
    lengths are drawn as red crosses on the top edge of each panel (no measured value).

    Args:
        points: Columns ``model, seq_len, status`` (``ok`` or ``oom``), the fields of :data:`SERVING_PANELS` and
            optionally those of :data:`SERVING_BOUNDS` (``bound_tpot_s``).
    """
    fig = make_subplots(rows=3, cols=2, subplot_titles=[t for _, t in SERVING_PANELS], horizontal_spacing=0.1,
                        vertical_spacing=0.09)
    models = sorted(points["model"].unique())
    ok, oom = points[points["status"] != "oom"], points[points["status"] == "oom"]
    for i, (field, title) in enumerate(SERVING_PANELS):
        pos = {"row": i // 2 + 1, "col": i % 2 + 1}
        values = ok.dropna(subset=[field]) if field in ok else ok.iloc[:0]
        top = float(values[field].max()) * 1.08 if not values.empty else 1.0
        for j, model in enumerate(models):
            color = COLORS[j % len(COLORS)]
            part = values[values["model"] == model].sort_values("seq_len")
            fig.add_trace(go.Scatter(
                x=part["seq_len"].tolist(), y=part[field].tolist() if field in part else [], mode="lines+markers",
                name=label(model), legendgroup=model, showlegend=i == 0, line={"color": color},
                meta={"model": model, "field": field, "status": "ok"}, hovertemplate="%{x} tokens: %{y:.4g}",
            ), **pos)  # fmt: skip
            bound = SERVING_BOUNDS.get(field)
            if bound is not None and bound in part and part[bound].notna().any():
                fig.add_trace(go.Scatter(
                    x=part["seq_len"].tolist(), y=part[bound].tolist(), mode="lines", name=label(f"{model} bound"),
                    legendgroup=model, showlegend=False, line={"color": color, "dash": "dash"},
                    meta={"model": model, "field": bound, "status": "bound"},
                    hovertemplate="bound at %{x} tokens: %{y:.4g}",
                ), **pos)  # fmt: skip
            failed = oom[oom["model"] == model].sort_values("seq_len")
            if not failed.empty:
                n = len(failed)
                fig.add_trace(go.Scatter(
                    x=failed["seq_len"].tolist(), y=[top] * n, text=["OOM"] * n, mode="markers+text",
                    textposition="bottom center", marker={"symbol": "x", "size": 12, "color": "#d62728"},
                    name=label(f"{model} OOM"), legendgroup=model, showlegend=False,
                    meta={"model": model, "field": field, "status": "oom"},
                    hovertemplate=f"{label(model)}: OOM at %{{x}} tokens<extra></extra>",
                ), **pos)  # fmt: skip
        fig.update_yaxes(rangemode="tozero", **pos)
        if values.empty and oom.empty:
            fig.add_annotation(text=f"no {field} in the records", showarrow=False, xref=f"x{i + 1 if i else ''} domain",
                               yref=f"y{i + 1 if i else ''} domain", x=0.5, y=0.5)  # fmt: skip
    lengths = sorted(int(n) for n in points["seq_len"].unique())
    fig.update_xaxes(type="log", tickvals=lengths, ticktext=[format_tokens(n) for n in lengths])
    fig.update_xaxes(title_text="context length (tokens)", row=3)
    fig.update_layout(template=TEMPLATE, height=1040, title={"text": "Serving: memory and speed vs context length"},
                      legend={"orientation": "h", "y": -0.15})  # fmt: skip
    return fig


LENGTH_FINDING_PAPER_MODEL = "HyLo-Llama-4MLA12GDN"
"""The paper's model whose 8K- and 64K-trained rows show the length finding (Table 2; the blog's 55.1 -> 0.8)."""


def length_finding_figure(rows: pd.DataFrame, paper: pd.DataFrame) -> go.Figure:
    """RULER mean vs length for each model role of a length-generalisation run (``benchmarks/mini_reproduction``:
    teacher, short-trained, staged-trained) with 95 % intervals as error bars, and, dashed, the paper's
    HyLo-Llama-4MLA12GDN rows trained at 8K and at 64K.

    Args:
        rows: benchmark records with ``model_role``, ``task`` (``mean`` rows are drawn), ``seq_len``, ``score``,
            ``ci_low``, ``ci_high`` (0-100) and optionally ``trained_len``.
        paper: ``paper.paper_frame`` output.
    """
    fig = go.Figure()
    means = rows[rows["task"] == "mean"].sort_values("seq_len")
    lengths = set(int(x) for x in means["seq_len"])
    names = {"teacher": "teacher", "short": "S: trained at the shortest length only",
             "staged": "L: trained with staged lengths"}
    for role, part in means.groupby("model_role", sort=False):
        fig.add_trace(go.Scatter(
            x=part["seq_len"].astype(int).tolist(), y=part["score"].tolist(), mode="lines+markers",
            name=names.get(role, str(role)),
            error_y={"type": "data", "symmetric": False, "array": (part["ci_high"] - part["score"]).tolist(),
                     "arrayminus": (part["score"] - part["ci_low"]).tolist()},
            meta={"source": "store", "model_role": role},
            hovertemplate="%{x} tokens: %{y:.1f}<extra>" + str(role) + "</extra>",
        ))  # fmt: skip
    for ctx, dash in (("8K", "dash"), ("64K", "dot")):
        hit = paper[(paper["model"] == LENGTH_FINDING_PAPER_MODEL) & (paper["train_ctx"] == ctx)]
        if hit.empty:
            continue
        row = hit.iloc[0]
        cols = [c for c in RULER_COLUMNS if not pd.isna(row.get(c))]
        fig.add_trace(go.Scatter(
            x=[RULER_COLUMNS[c] for c in cols], y=[float(row[c]) for c in cols], mode="lines+markers",
            line={"dash": dash, "color": "#7f7f7f"}, marker={"symbol": "diamond-open"},
            name=f"paper: {LENGTH_FINDING_PAPER_MODEL} trained at {ctx}",
            meta={"source": "paper", "train_ctx": ctx}, hovertemplate="%{x} tokens: %{y:.1f} (paper)",
        ))  # fmt: skip
        lengths |= {RULER_COLUMNS[c] for c in cols}
    fig.update_layout(template=TEMPLATE, height=520, legend={"orientation": "h", "y": -0.2},
                      title={"text": "Length generalisation: RULER mean vs context length (95 % intervals)"},
                      xaxis=length_axis(sorted(lengths)), yaxis={"title": {"text": "RULER mean (0-100)"},
                                                                  "range": [0, 100]})
    return fig
