"""The one-kernel MLA decode prep (hylo_bench.kernels.mla_decode.prep_triton) against the engine's torch path
(MLAServing.prep_torch): absorbed queries, rotated rope queries, the cache row and key scales written at each
sequence's position. Triton's interpreter on CPU (``TRITON_INTERPRET=1``, float32); bf16 on CUDA."""

from __future__ import annotations

import os

import pytest
import torch


def _check(device, dtype, tol, **cfg):
    from hylo_bench.decode.mla_layer import MLAServing
    from hylo_bench.models.hybrid import HyLoForCausalLM
    from tests.conftest import tiny_hybrid_config

    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config(**cfg)).eval().to(device=device, dtype=dtype)
    layer = next(lay for lay in model.model.layers if lay.mixer_type == "mla")
    with torch.no_grad():
        for p in layer.mixer.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # norms away from 1
    srv = MLAServing(layer.mixer, decode_backend="torch", merge_projections=True)
    slot_a, slot_b = srv.new_slot(3, 40), srv.new_slot(3, 40)
    x = torch.randn(2, 1, model.config.hidden_size, device=device, dtype=dtype)
    positions = torch.tensor([5, 37], device=device)
    with torch.no_grad():
        first, lat = srv._projections(x)
        want_lat, want_pe = srv.prep_torch(x, first, lat, slot_a, positions)
        got_lat, got_pe, lengths = srv.prep_triton(srv._query_gemv(first), lat, slot_b, positions)
    assert torch.equal(lengths, positions + 1)
    assert got_lat.shape == want_lat.shape and got_pe.shape == want_pe.shape and got_lat.dtype == dtype
    torch.testing.assert_close(got_lat.float(), want_lat.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_pe.float(), want_pe.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(slot_b.latent.float(), slot_a.latent.float(), rtol=tol, atol=tol)
    assert int((slot_b.latent != 0).any(-1).sum()) == 2  # exactly the two rows written
    if slot_a.key_scale is not None:
        torch.testing.assert_close(slot_b.key_scale.float(), slot_a.key_scale.float(), rtol=tol, atol=tol)
        assert int((slot_b.key_scale != 0).any(-1).sum()) == 2


def _check_value_up(device, dtype, tol):
    from hylo_bench.kernels.mla_decode.prep_triton import mla_value_up_triton

    gen = torch.Generator().manual_seed(0)
    B, G, rep, V, R, N = 2, 3, 2, 24, 40, 8
    kv_b = torch.randn(G, N + V, R, generator=gen).to(device=device, dtype=dtype)
    w_uv = kv_b[:, N:]  # the engine's strided view of kv_b_proj
    o_lat = torch.randn(B, G * rep, R, generator=gen).to(device)
    got = mla_value_up_triton(o_lat, w_uv)
    want = torch.einsum("bgrc,gvc->bgrv", o_lat.unflatten(1, (G, rep)).to(dtype), w_uv).reshape(B, G * rep * V)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 and triton")
def test_value_up_kernel_matches_einsum_interpreter():
    _check_value_up("cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_value_up_kernel_matches_einsum_on_cuda():
    pytest.importorskip("triton")
    _check_value_up("cuda", torch.bfloat16, 2e-2)


CASES = [{"use_qk_norm": True}, {"use_qk_norm": False}, {"use_qk_norm": True, "q_lora_rank": None},
         {"use_qk_norm": False, "use_lora_layer_norm": True}]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("cfg", CASES, ids=["qknorm", "plain", "qknorm-no-qlora", "lora-norms"])
def test_prep_kernel_matches_torch_path_interpreter(cfg):
    _check("cpu", torch.float32, 1e-5, **cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", CASES, ids=["qknorm", "plain", "qknorm-no-qlora", "lora-norms"])
def test_prep_kernel_matches_torch_path_on_cuda(cfg):
    """bf16: same roundings, summation order may differ by an ulp (2^-8 relative)."""
    pytest.importorskip("triton")
    _check("cuda", torch.bfloat16, 2e-2, **cfg)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 and triton")
def test_engine_with_the_glue_kernels_equals_torch_engine(monkeypatch):
    """The engine's fused decode layer with the prep and W_UV kernels (forced on CPU under the interpreter; the
    fused GEMVs fall back to their torch reference off CUDA) gives the torch engine's greedy tokens (float32)."""
    from hylo_bench.decode.engine import Engine
    from hylo_bench.decode.mla_layer import MLAServing
    from tests.conftest import engine_reference_case

    model, ids, want = engine_reference_case()
    engine = Engine(model, 3, 32, 5, mla_decode_backend="torch", gdn_decode_backend="torch", gemv_backend="triton")
    mla = [srv for srv in engine.mixers if isinstance(srv, MLAServing)]
    for srv in mla:
        srv.prep_backend = "triton"
    assert mla and all(srv.prep_fusable() for srv in mla) and engine.fused is not None
    import hylo_bench.kernels.mla_decode.prep_triton as pt

    calls = []
    real = pt.mla_value_up_triton
    monkeypatch.setattr(pt, "mla_value_up_triton", lambda *a: calls.append(1) or real(*a))
    got, _ = engine.generate(ids, 6)
    assert torch.equal(got, want)
    assert len(calls) == 2 * 5  # 2 MLA layers x 5 decode steps
