"""The Triton MLA decode kernel and fla's fused recurrent GDN step inside the serving engine, on CPU through
Triton's interpreter (float32; the interpreter's bf16 ``tl.dot`` is broken). Runs only where ``triton`` (and fla)
import and ``TRITON_INTERPRET=1`` is set, e.g.::

    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_mla_decode_interpreter.py

(kernels.md §8.2: numpy < 2.4 and a stubbed autotuner benchmark are needed).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                   reason="needs TRITON_INTERPRET=1 and triton installed")]


@pytest.fixture(autouse=True)
def _stub_autotune(monkeypatch):
    at = pytest.importorskip("triton.runtime.autotuner")
    monkeypatch.setattr(at.Autotuner, "do_bench", lambda self, *a, **k: [0.0, 0.0, 0.0])


@pytest.mark.parametrize("B,H,T,R,P,G", [(2, 4, 37, 32, 8, 2), (1, 16, 300, 256, 64, 8)])
@pytest.mark.parametrize("use_scale", [False, True])
def test_triton_kernel_matches_reference_fp32(B, H, T, R, P, G, use_scale):
    from hylo_bench.kernels.mla_decode.reference import mla_decode_reference
    from hylo_bench.kernels.mla_decode.triton_kernel import mla_decode_triton

    gen = torch.Generator().manual_seed(0)
    q_lat, q_rope = torch.randn(B, H, R, generator=gen), torch.randn(B, H, P, generator=gen)
    cache = torch.randn(B, T, R + P, generator=gen)
    ks = torch.rand(B, T, G, generator=gen) + 0.5 if use_scale else None
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    got = mla_decode_triton(q_lat, q_rope, cache, lengths, 0.1, ks)
    want = mla_decode_reference(q_lat, q_rope, cache, lengths, 0.1, ks)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_engine_with_triton_and_fla_decode_equals_torch_engine(monkeypatch):
    pytest.importorskip("fla")
    import hylo_bench.decode.mla_layer as ML
    from hylo_bench.decode.engine import Engine
    from hylo_bench.kernels.mla_decode.triton_kernel import mla_decode_triton
    from tests.conftest import engine_reference_case

    model, ids, want = engine_reference_case()
    calls = []

    def triton_decode(q_lat, q_rope, cache, lengths, *, scale, key_scale=None, backend="auto"):
        calls.append(cache.shape)
        return mla_decode_triton(q_lat, q_rope, cache, lengths, scale, key_scale)

    monkeypatch.setattr(ML, "mla_decode", triton_decode)  # the back ends refuse CPU tensors; call them directly
    engine = Engine(model, 3, 32, 5)
    for srv in engine.mixers:
        if getattr(srv, "kind", None) == "gdn":
            srv.gdn_backend = "fla"
    got, _ = engine.generate(ids, 6)
    assert torch.equal(got, want)
    assert len(calls) == 2 * 5  # 2 MLA layers x 5 decode steps
