"""benchmarks/attention_backends.py: its attention FLOP count equals a per-query count of the keys each mask lets a
query see, and the --tiny CPU run writes one flat record per (mask, GQA, padding) with the math back end, plus the
engine's own prefill attention (``prefix:sdpa``: lower-right mask, GQA) per padding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import attention_backends as A  # noqa: E402

from tests.benchmarks import run_tiny  # noqa: E402


@pytest.mark.parametrize("mask", ["lower_right", "none", "causal"])
def test_flops_count_the_keys_each_query_sees(mask):
    T, S, H, d_qk, d_v = 5, 13, 3, 7, 4
    keys = {"lower_right": S, "none": S - T, "causal": T}[mask]
    if mask == "none":
        seen = torch.ones(T, keys, dtype=torch.bool)
    else:  # query t (of the last T positions) sees keys 0 .. keys - T + t
        seen = torch.arange(keys)[None, :] <= torch.arange(keys - T, keys)[:, None]
    want = 2 * int(seen.sum()) * H * (d_qk + d_v)
    assert A.attention_flops(mask, T, S, H, d_qk, d_v) == want


def test_tiny_run_writes_flat_records(tmp_path):
    doc = run_tiny("attention_backends.py", tmp_path / "a.json")
    assert doc["benchmark"] == "attention_backends" and doc["device"] == "cpu"
    recs = doc["records"]
    assert len(recs) == 3 * 4 + 2 and {r["status"] for r in recs} == {"ok"}
    assert all(not isinstance(v, (dict, list)) for r in recs for v in r.values())
    assert {(r["mask"], r["gqa"], r["pad_values"]) for r in recs if r["backend"] == "math"} == {
        (m, g, p) for m in ("lower_right", "none", "causal") for g in (True, False) for p in (True, False)}
    assert {(r["mask"], r["gqa"], r["pad_values"]) for r in recs if r["backend"] == "prefix:sdpa"} == {
        ("lower_right", True, True), ("lower_right", True, False)}
    for r in recs:
        assert r["tflop_per_s"] == pytest.approx(r["attention_flops"] / r["time_s"] / 1e12)
