"""Results: file readers (``results``), the SQL results store (``store``, ``ingest``), the HTML report and
``compare`` (regression gate). RULER result files, manifests and stored runs go to pandas and plotly.

Never imports torch.
"""

from hylo_bench.reports.report import build_report, write_tables
from hylo_bench.reports.results import load_manifests, load_results, models_table, ruler_means, task_tables

__all__ = [
    "build_report", "load_manifests", "load_results", "models_table", "ruler_means", "task_tables", "write_tables",
]
