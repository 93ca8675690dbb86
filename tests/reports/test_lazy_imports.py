"""The eval / RULER result paths and the results store work without plotly (only the HTML report needs it):
GPU images often lack plotly, and an ``import plotly`` at package import once failed ``hylo-bench eval`` there."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["plotly"] = None  # any 'import plotly...' now raises ImportError
from hylo_bench.tasks.lm_eval_bridge import scores_from_results
from hylo_bench.reports import store
res = {"results": {"arc_easy": {"alias": "arc_easy", "acc,none": 0.25, "acc_stderr,none": 0.1}}}
print(scores_from_results(res))
import hylo_bench.reports as R
try:
    R.build_report
except ImportError:
    print("report needs plotly")
"""


def test_eval_and_store_import_without_plotly():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["{'arc_easy': {'acc': 25.0}}", "report needs plotly"]
