"""benchmarks/serving_sweep.py in its --smoke CPU mode, a driver over hylo-bench sweep's library: the results
envelope, the parity record, HyLo points estimated when their reserve leaves no time (the baseline's run in full),
the bandwidth-bound records and the summary; a spent budget skips every point and still writes the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POINT_KEYS = ("series", "model", "layout", "seq_len", "batch_size", "decode_steps", "prefill_chunk", "cuda_graphs",
              "compile", "variant", "kv_model_gib", "kv_model_engine_gib", "prefill_attention_flops", "kv_cache_gib",
              "decode_bytes_per_token", "mode", "prompt_tokens", "new_tokens", "tpot_s", "tokens_per_s",
              "peak_memory_gib", "status")


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "s.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # tiny models: one thread beats contention
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving_sweep.py"), "--smoke", "--out", str(out),
                          *extra], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(out.read_text())


def test_smoke_run_estimates_hylo_points_without_time_and_runs_the_baseline_in_full(tmp_path):
    doc = _run(tmp_path, "--reserve-s", "100000")  # HyLo points keep everything back: all estimated
    assert {"benchmark", "git_sha", "device", "versions", "records", "summary", "elapsed_s"} <= doc.keys()
    assert doc["benchmark"] == "serving_sweep" and doc["device"] == "cpu" and doc["finished"] is True
    assert doc["copy_bandwidth_gb_per_s"] > 0 and doc["hybrid_params"] > 0 and doc["baseline_params"] > 0
    recs = doc["records"]
    assert all(not isinstance(v, (dict, list)) for r in recs for v in r.values())
    assert [(r.get("check") or r["series"], r.get("seq_len"), r["status"], r.get("mode")) for r in recs] == [
        ("parity", None, "ok", None), ("hylo", 64, "ok", "estimated"), ("hylo", 256, "ok", "estimated"),
        ("bandwidth_bound", 256, "ok", None), ("hylo", 1024, "ok", "estimated"), ("baseline", 64, "ok", "full"),
        ("baseline", 256, "ok", "full"), ("bandwidth_bound", 256, "ok", None), ("baseline", 1024, "ok", "full")]
    assert recs[0]["graph_tokens_equal_eager"] is True
    points = [r for r in recs if "check" not in r]
    for r in points:
        assert all(k in r for k in POINT_KEYS), sorted(set(POINT_KEYS) - set(r))
        assert r["decode_bytes_per_token"] == r["bound_bytes_per_step"] and r["backend"] == "native"
    hylo = [r for r in points if r["series"] == "hylo"]
    assert all(r["ttft_s"] is None and r["why_estimated"] for r in hylo)
    assert [r.get("ttft_estimated_s") is not None for r in hylo] == [False, True, True]  # 1 chunk of 64: no estimate
    for bw in (r for r in recs if r.get("check") == "bandwidth_bound"):
        assert bw["bound_tpot_s"] == pytest.approx(bw["bytes_per_token"] / (bw["copy_bandwidth_gb_per_s"] * 1e9))
        assert bw["fraction_of_bound"] == pytest.approx(bw["bound_tpot_s"] / bw["tpot_s"])
    s = doc["summary"]
    assert s["hylo"]["max_estimated_tokens"] == 1024 and s["hylo"]["max_full_tokens"] is None
    assert s["baseline"]["max_full_tokens"] == 1024 and s["baseline"]["attention_tflops_lower_bound"] > 0
    assert set(s["hylo"]["bandwidth_bound_fraction"]) == {"eager"}


def test_a_spent_budget_skips_every_point_and_still_writes(tmp_path):
    doc = _run(tmp_path, "--budget-s", "0", "--no-checks")
    recs = doc["records"]
    assert [(r["series"], r["seq_len"]) for r in recs] == [("hylo", 64), ("hylo", 256), ("hylo", 1024),
                                                           ("baseline", 64), ("baseline", 256), ("baseline", 1024)]
    assert {r["status"] for r in recs} == {"skipped"} and all("budget" in r["error"] for r in recs)
    assert doc["finished"] is True and doc["summary"]["hylo"]["max_full_tokens"] is None
