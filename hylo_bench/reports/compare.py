"""Compare two result sets (stored runs, models, or the paper's numbers) metric by metric with 95 % intervals.

A side is a run id, a model name as stored (its latest value per metric), or ``paper:<model>[@<train ctx>]``
(Tables 2-4 of arXiv:2604.24715, read from ``hylo_paper_tables.json``). Scores are 0-100, lengths in tokens.
"""

from __future__ import annotations

import dataclasses
import html
import math
from pathlib import Path
from typing import Any

import pandas as pd
from sqlalchemy.engine import Engine

from hylo_bench.config.units import LM_EVAL_PERCENT_METRICS
from hylo_bench.io_utils import WEIGHT_PATTERNS, atomic_write_text, weights_sha256
from hylo_bench.reports import store
from hylo_bench.reports.paper import PAPER_TABLES, load_paper_tables, paper_tables_path

Z_95 = 1.959963984540054
RULER_MEAN_TASK = "ruler_mean"
# Paper column -> (task, seq_len, metric) in the store's naming. The paper does not say acc vs acc_norm or which
# GSM8K filter it reports; lm-eval's plain "acc" and "exact_match,strict-match" are assumed.
PAPER_COLUMNS: dict[str, tuple[str, int | None, str]] = {
    "ARC": ("arc_challenge", None, "acc"), "ARE": ("arc_easy", None, "acc"), "HS": ("hellaswag", None, "acc"),
    "OB": ("openbookqa", None, "acc"), "PI": ("piqa", None, "acc"), "RA": ("race", None, "acc"),
    "WG": ("winogrande", None, "acc"), "GSM8K": ("gsm8k", None, "exact_match,strict-match"),
    "R8K": (RULER_MEAN_TASK, 8192, "score"), "R16K": (RULER_MEAN_TASK, 16384, "score"),
    "R32K": (RULER_MEAN_TASK, 32768, "score"), "R64K": (RULER_MEAN_TASK, 65536, "score"),
}  # fmt: skip
_KEY = ["task", "seq_len", "metric"]
_LOWER_IS_BETTER = ("perplexity", "bits_per_byte", "loss")


@dataclasses.dataclass(kw_only=True, slots=True)
class Side:
    """One side of a comparison: ``metrics`` has columns task, seq_len, metric, value, n, stderr (se 0-100)."""

    label: str
    description: str
    metrics: pd.DataFrame


@dataclasses.dataclass(kw_only=True, slots=True)
class Comparison:
    """Result of :func:`compare`. ``rows``: one per metric on both sides; ``only_base``/``only_cand``: the rest."""

    base: Side
    cand: Side
    threshold: float
    rows: pd.DataFrame
    only_base: pd.DataFrame
    only_cand: pd.DataFrame

    @property
    def num_regressions(self) -> int:
        return int(self.rows["regression"].sum())


def default_paper_path() -> Path:
    """``$HYLO_BENCH_PAPER_TABLES``, else the copy shipped in the package (see ``paper.paper_tables_path``)."""
    return paper_tables_path()


def paper_side(spec: str, paper_path: str | Path | None = None) -> Side:
    """The paper's numbers for ``spec`` = ``<model>`` or ``<model>@<train ctx>`` (e.g. ``HyLo-Llama-4MLA12M2@64K``).

    Raises:
        ValueError: the tables file is missing, or the model matches no row or several rows (lists the choices).
    """
    tables = load_paper_tables(paper_path)
    name, _, ctx = spec.partition("@")
    rows = [(t, r) for t in PAPER_TABLES for r in tables.get(t, []) if r["model"] == name]
    if ctx:
        rows = [(t, r) for t, r in rows if str(r.get("train_ctx")) == ctx]
    if len(rows) != 1:
        pool = rows or [(t, r) for t in PAPER_TABLES for r in tables.get(t, [])]
        choices = sorted({r["model"] + (f"@{r['train_ctx']}" if r.get("train_ctx") else "") for _, r in pool})
        what = "no row" if not rows else f"{len(rows)} rows"
        raise ValueError(f"paper:{spec}: {what} in {', '.join(PAPER_TABLES)}; use one of: {', '.join(choices)}")
    table, row = rows[0]
    records = [{"task": task, "seq_len": seq_len, "metric": metric, "value": float(row[col]), "n": None,
                "stderr": None} for col, (task, seq_len, metric) in PAPER_COLUMNS.items() if row.get(col) is not None]
    desc = f"paper {table}, {row['model']} (train ctx {row.get('train_ctx') or '-'})"
    return Side(label=f"paper:{spec}", description=desc, metrics=_frame(records))


def _identity(runs: pd.DataFrame, spec: str) -> tuple[pd.DataFrame, set[str]]:
    """Runs of the model ``spec`` names (its stored name, its checkpoint path, a weights hash or a prefix of 12+ hex
    digits, or a local checkpoint folder, hashed here), widened to every run of the same weights: one model,
    whatever name each command stored it under (``tiny`` from ``upcycle``, ``runs/tiny`` from ``ruler``)."""
    hashes = runs["model_hash"].fillna("")
    named = (runs["model"] == spec) | (runs["checkpoint"] == spec)
    if len(spec) >= 12 and all(c in "0123456789abcdef" for c in spec.lower()):
        named |= hashes.str.startswith(spec.lower())
    ids = set(hashes[named & (hashes != "")])
    path = Path(spec).expanduser()
    if path.is_dir() and any(path.glob(p) for p in WEIGHT_PATTERNS):
        ids.add(weights_sha256(path))
        named |= runs["checkpoint"].isin([str(path), str(path.resolve())])
    return runs[named | hashes.isin(ids)], ids


def store_side(engine: Engine, spec: str) -> Side:
    """A run id or a model as stored (:func:`_identity`); for a model, each metric's value comes from its latest
    finished run. Runs stored as ``running`` (interrupted) are left out and named in the description; a run id
    selects that run whatever its status.

    RULER per-task scores also yield a ``ruler_mean`` row per length (mean over the tasks present).

    Raises:
        ValueError: nothing stored under ``spec`` (lists the stored model names), or only unfinished runs.
    """
    runs = store.runs_frame(engine)
    unfinished = runs["status"] == "running"
    notes = []
    if spec.isdigit() and int(spec) in set(runs["id"]):
        chosen = runs[runs["id"] == int(spec)]
        if bool(unfinished[chosen.index].any()):
            notes.append("UNFINISHED run: the command was interrupted or is still running")
        hashes = set(chosen["model_hash"].dropna())
    else:
        chosen, hashes = _identity(runs, spec)
        left_out = chosen[unfinished[chosen.index]]
        if not left_out.empty:
            if len(left_out) == len(chosen):
                raise ValueError(f"{spec!r}: only unfinished runs ({', '.join(map(str, left_out['id']))}: interrupted "
                                 f"or still running); finish them (e.g. `hylo-bench ruler --resume`), or pass a run "
                                 f"id to compare one as it is")
            notes.append(f"left out unfinished run(s) {', '.join(map(str, left_out['id']))}")
            chosen = chosen[~unfinished[chosen.index]]
    if chosen.empty:
        models = ", ".join(sorted(runs["model"].unique())) or "none (run `hylo-bench import` first)"
        raise ValueError(f"{spec!r} is neither a stored run id nor a stored model name; stored models: {models}")
    df = store.metrics_frame(engine, [int(i) for i in chosen["id"]])
    if df.empty:
        raise ValueError(f"{spec!r}: the matching run(s) {list(chosen['id'])} hold no metrics (e.g. only a manifest)")
    df = df.sort_values(["created_utc", "run_id"], kind="stable").drop_duplicates(_KEY, keep="last")
    records = df[_KEY + ["value", "n", "stderr"]].to_dict("records")
    records += _ruler_means(df)
    ids = ", ".join(str(i) for i in sorted(df["run_id"].unique()))
    names = sorted(set(chosen["model"]) - {spec})
    who = "; weights " + ", ".join(h[:12] for h in sorted(hashes)) if hashes else ""
    also = f"; also stored as {', '.join(names)}" if names else ""
    desc = f"{spec} (run {ids}{who}{also}" + "".join(f"; {n}" for n in notes) + ")"
    return Side(label=spec, description=desc, metrics=_frame(records))


def _ruler_means(df: pd.DataFrame) -> list[dict[str, Any]]:
    """One ``ruler_mean`` row per length: the plain mean of the task scores, ``n`` = the samples of all its tasks
    (the mean of equally sized tasks is the pooled share of ``n`` samples; None when a task's n is unknown)."""
    ruler = df[(df["metric"] == "score") & df["seq_len"].notna() & (df["task"] != RULER_MEAN_TASK)]
    out = []
    for seq_len, part in ruler.groupby("seq_len"):
        ns = [None if pd.isna(n) else int(n) for n in part["n"]]
        out.append({"task": RULER_MEAN_TASK, "seq_len": int(seq_len), "metric": "score",
                    "value": math.fsum(part["value"]) / len(part), "n": None if None in ns else sum(ns),
                    "stderr": None, "num_tasks": len(part)})  # fmt: skip
    return out


def _frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    cols = _KEY + ["value", "n", "stderr", "num_tasks"]
    df = pd.DataFrame(records, columns=cols)
    df["seq_len"] = df["seq_len"].astype("Int64")
    df["n"] = df["n"].astype("Int64")
    return df


def _is_share(metric: str) -> bool:
    """Scores that are a share of n samples on 0-100: RULER's ``score``, lm-eval accuracies (``acc``, ...)."""
    return metric == "score" or metric.partition(",")[0] in LM_EVAL_PERCENT_METRICS


def wilson_interval(p: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``p`` (in [0, 1]) observed on ``n`` samples.

    Reference: E. B. Wilson, JASA 22 (1927) 209-212; Newcombe, Stat. Med. 17 (1998) 857-872, method 3:
    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n). Inside [0, 1] by construction, and never zero-width
    for n > 0 (0 of 20: [0, 0.1611]).
    """
    denom = 1.0 + z * z / n
    center = (p + z * z / (2.0 * n)) / denom
    half = z * math.sqrt(max(p * (1.0 - p), 0.0) / n + z * z / (4.0 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def _side_interval(metric: str, value: float, n: Any, stderr: Any) -> tuple[float, float] | None:
    """95 % interval of one side's value in its own units; None when neither ``n`` nor a stderr is known.

    A share with a known ``n``: Wilson on value / 100 (a stored lm-eval stderr is not used: it is 0 at 0 % and
    100 %). Otherwise value -+ 1.96 stderr, clipped to [0, 100] for a share.
    """
    known_n = n is not None and not pd.isna(n) and int(n) > 0
    if _is_share(metric) and known_n and 0.0 <= value <= 100.0:
        lo, hi = wilson_interval(value / 100.0, int(n))
        return 100.0 * lo, 100.0 * hi
    if stderr is None or pd.isna(stderr):
        return None
    lo, hi = value - Z_95 * float(stderr), value + Z_95 * float(stderr)
    return (max(lo, 0.0), min(hi, 100.0)) if _is_share(metric) else (lo, hi)


def delta_interval(base: float, cand: float, base_ci: tuple[float, float] | None,
                   cand_ci: tuple[float, float] | None, sign: float = 1.0) -> tuple[float, float]:
    """95 % interval of ``sign * (cand - base)`` from the two sides' intervals (a side without one counts as exact).

    Reference: Newcombe, Stat. Med. 17 (1998) 873-890, method 10 (the hybrid score interval for a difference of
    proportions, from each side's Wilson interval): L = d - sqrt((c - l_c)^2 + (u_b - b)^2),
    U = d + sqrt((u_c - c)^2 + (b - l_b)^2), d = c - b; with symmetric normal intervals it is d -+ 1.96 sqrt(se_b^2 +
    se_c^2).
    """
    lb, ub = base_ci or (base, base)
    lc, uc = cand_ci or (cand, cand)
    if sign < 0:  # lower is better: d = base - cand, the roles of the sides swap
        base, cand, (lb, ub), (lc, uc) = cand, base, (lc, uc), (lb, ub)
    d = cand - base
    return d - math.hypot(cand - lc, ub - base), d + math.hypot(uc - cand, base - lb)


def resolve_side(engine: Engine | None, spec: str, paper_path: str | Path | None = None) -> Side:
    """``paper:<model>`` from the paper's tables, anything else from the store (see :func:`store_side`)."""
    if spec.startswith("paper:"):
        return paper_side(spec[len("paper:"):], paper_path)
    if engine is None:
        raise ValueError(f"{spec!r}: a stored run or model needs the results store (--db)")
    return store_side(engine, spec)


def compare_sides(base: Side, cand: Side, threshold: float = 1.0) -> Comparison:
    """Per metric delta = cand - base (sign flipped for lower-is-better metrics such as perplexity) with a 95 % CI.

    The CI is Newcombe's interval for a difference (:func:`delta_interval`) from each side's Wilson interval for a
    score that is a share of n samples (RULER, lm-eval accuracies), else from a stored stderr; for shares it is
    clipped to the range of a difference of two 0-100 scores, [-100, 100]. A metric regresses when
    delta < -threshold AND the CI upper bound is below 0 (with no n or stderr on either side the CI has zero width,
    so the threshold alone decides).

    Raises:
        ValueError: ``threshold`` is negative.
    """
    if threshold < 0:
        raise ValueError(f"threshold: expected >= 0 score points, got {threshold}")
    merged = base.metrics.merge(cand.metrics, on=_KEY, how="outer", suffixes=("_base", "_cand"), indicator=True)
    both = merged[merged["_merge"] == "both"].copy()
    rows = []
    for r in both.itertuples():
        ci_b = _side_interval(r.metric, r.value_base, r.n_base, r.stderr_base)
        ci_c = _side_interval(r.metric, r.value_cand, r.n_cand, r.stderr_cand)
        sign = -1.0 if any(w in r.metric for w in _LOWER_IS_BETTER) else 1.0
        delta = sign * (r.value_cand - r.value_base)
        lo, hi = delta_interval(r.value_base, r.value_cand, ci_b, ci_c, sign)
        if _is_share(r.metric):
            lo, hi = max(lo, -100.0), min(hi, 100.0)
        rows.append({"task": r.task, "seq_len": r.seq_len, "metric": r.metric, "base": r.value_base,
                     "cand": r.value_cand, "delta": delta, "ci_low": lo, "ci_high": hi,
                     "has_ci": ci_b is not None or ci_c is not None,
                     "regression": bool(delta < -threshold and hi < 0)})
    cols = ["task", "seq_len", "metric", "base", "cand", "delta", "ci_low", "ci_high", "has_ci", "regression"]
    out = pd.DataFrame(rows, columns=cols)
    only = merged[merged["_merge"] != "both"]
    only_base = only[only["_merge"] == "left_only"][_KEY + ["value_base"]].rename(columns={"value_base": "value"})
    only_cand = only[only["_merge"] == "right_only"][_KEY + ["value_cand"]].rename(columns={"value_cand": "value"})
    return Comparison(base=base, cand=cand, threshold=threshold, rows=_sorted(out), only_base=_sorted(only_base),
                      only_cand=_sorted(only_cand))


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(_KEY, na_position="first", kind="stable").reset_index(drop=True)


def _len(seq_len: Any) -> str:
    return "-" if pd.isna(seq_len) else str(int(seq_len))


def to_markdown(cmp: Comparison) -> str:
    """A Markdown report for a CI comment: verdict, the delta table (regressions first), metrics on one side only."""
    verdict = (f"**{cmp.num_regressions} regression(s)** beyond {cmp.threshold:g} points and the 95 % CI"
               if cmp.num_regressions else f"no regression beyond {cmp.threshold:g} points and the 95 % CI")
    lines = [f"### hylo-bench compare: `{cmp.cand.label}` vs `{cmp.base.label}`", "",
             f"base: {cmp.base.description}; candidate: {cmp.cand.description}", "",
             f"{verdict}; {len(cmp.rows)} metric(s) compared, {len(cmp.only_base)} only in base, "
             f"{len(cmp.only_cand)} only in candidate.", "",
             "| | task | length | metric | base | cand | delta | 95 % CI |", "|---|---|---|---|---:|---:|---:|---|"]
    for r in cmp.rows.sort_values("regression", ascending=False, kind="stable").itertuples():
        ci = f"[{r.ci_low:+.2f}, {r.ci_high:+.2f}]" if r.has_ci else "n/a"
        flag = "**REGRESSION**" if r.regression else ""
        lines.append(f"| {flag} | {r.task} | {_len(r.seq_len)} | {r.metric} | {r.base:.2f} | {r.cand:.2f} | "
                     f"{r.delta:+.2f} | {ci} |")
    for title, df in (("Only in base", cmp.only_base), ("Only in candidate", cmp.only_cand)):
        if not df.empty:
            lines += ["", f"**{title}** ({len(df)}): " + ", ".join(
                f"`{r.task}@{_len(r.seq_len)}:{r.metric}` = {r.value:.2f}" for r in df.itertuples())]
    return "\n".join(lines) + "\n"


def to_html(cmp: Comparison) -> str:
    """A self-contained HTML page with the same content as :func:`to_markdown` (regressions highlighted)."""
    esc = html.escape
    head = "".join(f"<th>{h}</th>" for h in ("task", "length", "metric", "base", "cand", "delta", "95 % CI"))
    body = []
    for r in cmp.rows.sort_values("regression", ascending=False, kind="stable").itertuples():
        ci = f"[{r.ci_low:+.2f}, {r.ci_high:+.2f}]" if r.has_ci else "n/a"
        style = ' style="background:#fdd"' if r.regression else ""
        body.append(f"<tr{style}><td>{esc(r.task)}</td><td>{_len(r.seq_len)}</td><td>{esc(r.metric)}</td>"
                    f"<td>{r.base:.2f}</td><td>{r.cand:.2f}</td><td>{r.delta:+.2f}</td><td>{ci}</td></tr>")
    extra = []
    for title, df in (("Only in base", cmp.only_base), ("Only in candidate", cmp.only_cand)):
        if not df.empty:
            items = "".join(f"<li>{esc(r.task)} @ {_len(r.seq_len)}: {esc(r.metric)} = {r.value:.2f}</li>"
                            for r in df.itertuples())
            extra.append(f"<h2>{title} ({len(df)})</h2><ul>{items}</ul>")
    verdict = f"{cmp.num_regressions} regression(s)" if cmp.num_regressions else "no regression"
    title = f"hylo-bench compare: {cmp.cand.label} vs {cmp.base.label}"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            "<style>body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}</style></head><body>"
            f"<h1>{esc(title)}</h1><p>base: {esc(cmp.base.description)}<br>candidate: {esc(cmp.cand.description)}"
            f"</p><p><b>{verdict}</b> beyond {cmp.threshold:g} points and the 95 % CI</p>"
            f"<table><tr>{head}</tr>{''.join(body)}</table>{''.join(extra)}</body></html>\n")


def write_outputs(cmp: Comparison, md: str | Path | None, html_path: str | Path | None) -> None:
    """Write the Markdown and/or HTML report (atomically, parent folders created) where a path is given."""
    if md is not None:
        atomic_write_text(md, to_markdown(cmp))
    if html_path is not None:
        atomic_write_text(html_path, to_html(cmp))
