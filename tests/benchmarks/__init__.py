"""Tests of the GPU benchmark scripts' CPU paths, and the one way they run a script's tiny mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_tiny(script: str, out: Path, *args: str) -> dict:
    """Run ``benchmarks/SCRIPT --tiny --out OUT ARGS`` in a subprocess (one thread: tiny shapes run faster without
    contention) and return the JSON it wrote; a failed run fails the test with the script's stderr."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--tiny", "--out", str(out), *args],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())
