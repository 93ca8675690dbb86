"""A whole GDN decode token (hylo_bench.kernels.gated_delta.decode_token_triton): the torch reference against a
naive float64 recurrence written out here, and the one-kernel Triton version against the reference over several
consecutive tokens (Triton's interpreter on CPU with ``TRITON_INTERPRET=1``; float32 / bf16 on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hylo_bench.kernels.gated_delta.decode_prestep import gdn_decode_token_reference
from tests.kernels.test_gdn_prestep import _inputs as prestep_inputs


def _inputs(B=2, H=3, K=8, Vd=16, dtype=torch.float64, device="cpu", seed=0):
    """The pre-step test's inputs plus a recurrent state [B, H, K, Vd] (float32; float64 for float64)."""
    proj, caches, w, A_log, dt_bias = prestep_inputs(B, H, K, Vd, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    state = torch.randn(B, H, K, Vd, generator=gen, dtype=torch.float64) * 0.3
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    return proj, caches, w, A_log, dt_bias, state.to(device=device, dtype=sdt)


def test_reference_equals_a_naive_float64_recurrence():
    """conv1d over [cache ; x] + SiLU, gates, l2norm (eps 1e-6), then per head S <- exp(g) S; S <- S + k (beta
    (v - S^T k))^T; o = S^T q K^-0.5, written out as loops over heads (float64)."""
    B, H, K, Vd = 2, 3, 8, 16
    proj, caches, w, A_log, dt_bias, state = _inputs(B, H, K, Vd)
    before, S = [c.clone() for c in caches], state.clone()
    o = gdn_decode_token_reference(proj, caches, w, A_log, dt_bias, state)
    Ck, C = H * K, 2 * H * K + H * Vd
    xx = torch.cat([torch.cat(before, dim=1), proj[:, 0, :C, None]], dim=-1)
    act = F.silu(F.conv1d(xx, w[:, None], groups=C)[..., 0])
    a, b = proj[:, 0, C:C + H], proj[:, 0, C + H:C + 2 * H]
    g = -A_log.double().exp() * F.softplus(a + dt_bias.double())
    beta = torch.sigmoid(b)
    want_o = torch.empty(B, H * Vd, dtype=torch.float64)
    for bi in range(B):
        for h in range(H):
            q = act[bi, h * K:(h + 1) * K]
            k = act[bi, Ck + h * K:Ck + (h + 1) * K]
            v = act[bi, 2 * Ck + h * Vd:2 * Ck + (h + 1) * Vd]
            q = q / torch.sqrt((q * q).sum() + 1e-6)
            k = k / torch.sqrt((k * k).sum() + 1e-6)
            s = S[bi, h] * torch.exp(g[bi, h])
            s = s + torch.outer(k, beta[bi, h] * (v - s.T @ k))
            S[bi, h] = s
            want_o[bi, h * Vd:(h + 1) * Vd] = s.T @ q * K ** -0.5
    torch.testing.assert_close(o, want_o, rtol=0, atol=1e-12)
    torch.testing.assert_close(state, S, rtol=0, atol=1e-12)


def _check_triton(B, H, K, Vd, dtype, device, tokens=3):
    from hylo_bench.kernels.gated_delta.decode_token_triton import gdn_decode_token_triton

    proj, caches, w, A_log, dt_bias, state = _inputs(B, H, K, Vd, dtype, device, seed=B * H + K)
    ref_caches, ref_state = tuple(c.clone() for c in caches), state.clone()
    counters = torch.zeros(B * H, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(1)
    for t in range(tokens):  # consecutive tokens: each sees the caches / state the previous one left
        if t:
            proj = (torch.randn(proj.shape, generator=gen, dtype=torch.float64) * 2).to(device=device, dtype=dtype)
        o = gdn_decode_token_triton(proj, caches, w, A_log, dt_bias, state, counters)
        want = gdn_decode_token_reference(proj, ref_caches, w, A_log, dt_bias, ref_state)
        assert o.dtype == dtype and o.shape == (B, H * Vd)
        assert all(torch.equal(c, r) for c, r in zip(caches, ref_caches)), f"token {t}: conv caches"
        assert int(counters.abs().sum()) == 0, "the last program of each head resets its counter"
        tol = 2e-5 if dtype == torch.float32 else 2e-2  # bf16: q / k / v rounded once more or less than the reference
        torch.testing.assert_close(o.float(), want.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(state, ref_state, rtol=tol, atol=tol)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("B,H,K,Vd,BV", [(1, 3, 8, 16, 8), (2, 2, 24, 40, 16), (1, 1, 64, 128, 8)])
def test_triton_token_matches_reference_interpreter(B, H, K, Vd, BV, monkeypatch):
    """Vd > BV in every case, so several programs share a head's query / key caches (the counter's last
    arrival writes them); K = 24, Vd = 40 pad the blocks. One config (the interpreter cannot autotune)."""
    from hylo_bench.kernels.gated_delta import decode_token_triton as dt

    monkeypatch.setattr(dt, "CONFIGS", ((BV, 1),))
    monkeypatch.setattr(dt, "_BEST", {})
    _check_triton(B, H, K, Vd, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,H,K,Vd", [(1, 6, 256, 512), (4, 6, 256, 512), (3, 5, 24, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_token_on_cuda(B, H, K, Vd, dtype):
    pytest.importorskip("triton")
    _check_triton(B, H, K, Vd, dtype, "cuda", tokens=4)


def test_triton_token_refuses_what_it_cannot_serve():
    """Checked before any launch: float64, a short conv weight, a state of the wrong shape or dtype, too few
    counters."""
    pytest.importorskip("triton")
    from hylo_bench.kernels.gated_delta.decode_token_triton import gdn_decode_token_triton

    proj, caches, w, A_log, dt_bias, state = _inputs(dtype=torch.float64)
    cnt = torch.zeros(6, dtype=torch.int32)
    with pytest.raises(ValueError, match="float64 inputs take the reference"):
        gdn_decode_token_triton(proj, caches, w, A_log, dt_bias, state, cnt)
    proj, caches, w, A_log, dt_bias, state = _inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"conv_weight must be \[C=96, 4\]"):
        gdn_decode_token_triton(proj, caches, w[:-5], A_log, dt_bias, state, cnt)
    with pytest.raises(ValueError, match=r"state must be float32 \[B=2, H=3, K=8, Vd=16\]"):
        gdn_decode_token_triton(proj, caches, w, A_log, dt_bias, state[..., :8], cnt)
    with pytest.raises(ValueError, match=r"state must be float32"):
        gdn_decode_token_triton(proj, caches, w, A_log, dt_bias, state.double(), cnt)
    with pytest.raises(ValueError, match=r"counters must be .* >= B\*H = 6"):
        gdn_decode_token_triton(proj, caches, w, A_log, dt_bias, state, cnt[:5])


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 and triton")
def test_engine_with_the_token_kernel_equals_torch_engine(monkeypatch):
    """The serving engine's GDN layers on the one-kernel token path (forced on CPU: the selection refuses CPU
    tensors) give the torch engine's greedy tokens (float32, batch 2, prompts then 6 decode tokens)."""
    at = pytest.importorskip("triton.runtime.autotuner")
    monkeypatch.setattr(at.Autotuner, "do_bench", lambda self, *a, **k: [0.0, 0.0, 0.0])
    from hylo_bench.decode.engine import Engine
    from tests.conftest import engine_reference_case

    model, ids, want = engine_reference_case()
    engine = Engine(model, 3, 32, 5, mla_decode_backend="torch", gdn_decode_backend="torch")
    gdn = [srv for srv in engine.mixers if getattr(srv, "kind", None) == "gdn"]
    assert gdn and all(srv.m.head_v_dim > 8 for srv in gdn)  # several programs per head at BV = 8
    for srv in gdn:
        srv.gdn_backend = "triton"
    got, _ = engine.generate(ids, 6)
    assert torch.equal(got, want)
    assert all(int(srv.counters.abs().sum()) == 0 and srv.counters.numel() >= 2 * srv.m.num_heads for srv in gdn)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_token_counter_protocol_under_load():
    """64 consecutive tokens at batch 16 (1536 programs, more than fit at once at small BV): the query / key
    conv caches must equal the reference's exactly after every token (a program reading taps after the last
    arrival shifted them would change both the caches' history and the outputs)."""
    pytest.importorskip("triton")
    _check_triton(16, 6, 256, 512, torch.float32, "cuda", tokens=64)
