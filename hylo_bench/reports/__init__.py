"""Results: file readers (``results``), the SQL results store (``store``, ``ingest``), the HTML report and
``compare`` (regression gate). RULER result files, manifests and stored runs go to pandas and plotly.

Never imports torch. The names below load on first use, so importing a submodule (``reports.ingest`` from the
eval runner, say) does not pull in plotly.
"""

import importlib
from typing import Any

_LAZY = {
    "build_report": "report", "write_tables": "store_report", "load_manifests": "results", "load_results": "results",
    "models_table": "results", "ruler_means": "results", "task_tables": "results",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"hylo_bench.reports.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hylo_bench.reports' has no attribute {name!r}")
