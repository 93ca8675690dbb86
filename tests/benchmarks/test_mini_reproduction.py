"""The mini reproduction's one command (benchmarks/mini_reproduction.py) in its --tiny CPU mode: every step runs,
the JSON has one record per (role, task, length) with 95 % Wilson intervals, the report draws the finding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def test_wilson_interval_matches_a_hand_computation():
    from benchmarks.mini_reproduction import wilson

    # 40 of 50: p = 0.8, z = 1.959964: centre (0.8 + z^2/100) / (1 + z^2/50), half-width by the Wilson formula
    lo, hi = wilson(0.8, 50)
    assert lo == pytest.approx(0.6696, abs=5e-4) and hi == pytest.approx(0.8876, abs=5e-4)
    assert wilson(0.0, 10) == (0.0, pytest.approx(0.2775, abs=5e-4))
    assert wilson(1.0, 4)[1] == pytest.approx(1.0) and wilson(1.0, 4)[0] == pytest.approx(0.5101, abs=5e-4)


def test_tiny_mode_runs_the_whole_plan(tmp_path):
    out = tmp_path / "mini.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mini_reproduction.py"), "--tiny", "--work",
                          str(tmp_path / "work"), "--device", "cpu", "--jobs", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {k for k in ("benchmark", "git_sha", "device", "versions", "records") if k in doc} == \
        {"benchmark", "git_sha", "device", "versions", "records"}
    assert all(j["status"] == "ok" for j in doc["jobs"].values()), doc["jobs"]
    recs = doc["records"]
    keys = {(r["model_role"], r["task"], r["seq_len"]) for r in recs}
    want = {(role, task, L) for role in ("teacher", "short", "staged") for L in (512, 1024)
            for task in ("niah_single_1", "niah_multikey_1", "mean")}
    assert keys == want
    for r in recs:
        assert 0 <= r["ci_low"] <= r["score"] <= r["ci_high"] <= 100
        assert r["n"] == (4 if r["task"] == "mean" else 2)
    train = doc["training"]
    assert train["ild"]["mla_layers"] == train["ild_random"]["mla_layers"] == train["short"]["mla_layers"]
    assert len(train["ild"]["losses"]) == len(train["ild_random"]["losses"]) == 2
    stages = {k: [s["tokens"] for s in v["stages"]] for k, v in train.items() if k in ("short", "staged")}
    assert sum(stages["short"]) == 3072 and len(stages["staged"]) == 3
    page = (tmp_path / "work" / "report.html").read_text()
    assert "Length generalisation" in page and "ild_random" in page
