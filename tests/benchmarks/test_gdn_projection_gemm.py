"""benchmarks/gdn_projection_gemm.py: every variant gives the six projections of separate float64 GEMMs, the padded
weight really is a multiple of 64 rows, and the --tiny CPU run writes one flat record per variant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gdn_projection_gemm as G  # noqa: E402

from tests.benchmarks import run_tiny  # noqa: E402


def test_layout_of_the_qwen_gdn_layer_has_9228_columns():
    sizes = G.layout(2048, 6, 256, 512)
    assert list(sizes) == ["q", "k", "v", "a", "b", "g"]
    assert sum(sizes.values()) == 9228 and (9228 * 2) % 16 == 8  # the merged GEMM's rows: not 16-byte aligned


@pytest.mark.parametrize("variant", G.VARIANTS)
def test_every_variant_gives_the_separate_projections(variant):
    sizes = G.layout(40, 3, 8, 16)
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(sum(sizes.values()), 40, dtype=torch.float64, generator=g)
    x = torch.randn(9, 40, dtype=torch.float64, generator=g)
    want, row = {}, 0
    for name, n in sizes.items():
        want[name] = x @ weight[row:row + n].T
        row += n
    fn, gemms = G.make_variant(variant, weight, sizes)
    got = fn(x)
    assert set(got) == set(want) and gemms == {"six": 6, "merged": 1, "aligned3": 3, "padded": 1}[variant]
    for name in want:
        assert got[name].shape == want[name].shape
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)


def test_padded_variant_pads_to_a_multiple_of_64(monkeypatch):
    sizes = G.layout(32, 2, 8, 16)  # 16 + 16 + 32 + 2 + 2 + 32 = 100 columns -> 128
    seen = []
    real = F.linear
    monkeypatch.setattr(G.F, "linear", lambda x, w: seen.append(w.shape[0]) or real(x, w))
    fn, _ = G.make_variant("padded", torch.randn(100, 32), sizes)
    fn(torch.randn(3, 32))
    assert seen == [128]


def test_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="unknown variant 'fused'"):
        G.make_variant("fused", torch.zeros(3, 2), {"q": 3})


def test_tiny_run_writes_flat_records(tmp_path):
    doc = run_tiny("gdn_projection_gemm.py", tmp_path / "g.json")
    assert doc["benchmark"] == "gdn_projection_gemm" and doc["device"] == "cpu"
    assert [r["variant"] for r in doc["records"]] == list(G.VARIANTS)
    for r in doc["records"]:
        assert r["status"] == "ok" and all(not isinstance(v, (dict, list)) for v in r.values())
        assert r["tflop_per_s"] == pytest.approx(2 * 48 * 64 * doc["output_columns"] / r["time_s"] / 1e12)
