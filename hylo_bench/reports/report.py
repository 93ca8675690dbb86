"""``hylo-bench report``: one self-contained, offline HTML report (plotly.js inlined once) from the results store,
or with ``--files-only`` from the result files under a folder alone (imported into an in-memory store and drawn by
the same builder, :mod:`hylo_bench.reports.store_report`). Scores are 0-100, lengths in tokens. Never imports torch.
"""

from __future__ import annotations

from pathlib import Path

from hylo_bench.io_utils import check_output_path
from hylo_bench.reports import store
from hylo_bench.reports.store_report import RULER_KINDS, build_store_report

IN_MEMORY_STORE = "sqlite:///:memory:"


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

    With ``files_only``, the same report from the result files under ``results_dir`` alone, touching no database
    on disk: the files are imported into an in-memory store (``store.sync_dir``) and drawn by the same builder.

    Args:
        results_dir: Directory searched recursively for RULER result files and upcycle manifests.
        out_html: Output path; written atomically, parent folders created.
        title: Page title; defaults to ``"hylo-bench report: <results_dir name>"``.
        strict: (files only) raise on a result file that cannot be imported instead of listing it in the report.
        tables_dir: (files only) also write the RULER tables as CSV there (``store_report.write_tables``).
        db: The results store (path or SQLAlchemy URL, see ``store.resolve_url``).
        models: Only these model names (store report).
        images_dir: Also export every figure as PNG/SVG and every table as CSV/Markdown there (store report).
        files_only: The report of the files alone (an in-memory store).

    Returns:
        The path of the written HTML file.

    Raises:
        ValueError: if no results are found (files only: no finished RULER run), or (strict, files only) a result
            file cannot be imported.
    """
    results_dir, out_html = Path(results_dir), Path(out_html)
    if out_html.is_dir():
        raise ValueError(f"-o {str(out_html)!r} is a directory; give the HTML file to write, e.g. "
                         f"{out_html / 'report.html'}")
    check_output_path(out_html, "-o", is_dir=False)
    if images_dir is not None:
        check_output_path(images_dir, "--images", is_dir=True)
    if not files_only:
        return build_store_report(db, results_dir, out_html, title=title, models=models, images_dir=images_dir)[0]
    if models or images_dir is not None or db is not None:
        raise ValueError("--models, --images and --db use the results store; drop --files-only")
    engine = store.open_store(IN_MEMORY_STORE)
    try:
        skipped = store.sync_dir(engine, results_dir)[1]
        if strict and skipped:
            path, reason = skipped[0]
            raise ValueError(reason if reason.startswith(str(path)) else f"{path}: {reason}")
        runs = store.runs_frame(engine)
        if not (runs["kind"].isin(RULER_KINDS) & (runs["status"] != "running")).any():
            extra = f" ({len(skipped)} file(s) skipped as malformed, see warnings)" if skipped else ""
            raise ValueError(f"no RULER results found in {results_dir}{extra}; run `hylo-bench ruler ...` first")
        return build_store_report(None, results_dir, out_html, title=title, engine=engine, skipped=skipped,
                                  tables_dir=tables_dir)[0]
    finally:
        engine.dispose()
