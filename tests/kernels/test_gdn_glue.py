"""The GDN mixer's multi-token glue (hylo_bench.kernels.gated_delta.glue): the torch short convolution equals a
float64 loop over taps, continues exactly from its cache across a split, and the gated norm equals its formula;
"auto" picks torch off CUDA and for training; on CUDA fla's kernels equal the torch references (bf16 rounding),
and a GDN mixer's chunked prefill with them equals its one-shot forward."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from hylo_bench.kernels import registry
from hylo_bench.kernels.gated_delta import glue
from hylo_bench.kernels.gated_delta.glue import (
    gated_rms_norm,
    gated_rms_norm_torch,
    select_glue_backend,
    short_conv,
    short_conv_torch,
)


def _loop_conv(x, w, cache):
    """SiLU(sum_j w[:, j] * x[t - W + 1 + j]) by explicit taps over [cache | x] in float64. x [B, T, C]; w [C, W];
    cache [B, C, W - 1] or None."""
    B, T, C = x.shape
    W = w.shape[1]
    hist = torch.zeros(B, W - 1, C, dtype=torch.float64) if cache is None else cache.double().transpose(1, 2)
    full = torch.cat([hist, x.double()], dim=1)  # [B, W - 1 + T, C]
    y = torch.zeros(B, T, C, dtype=torch.float64)
    for t in range(T):
        for j in range(W):
            y[:, t] += w[:, j].double() * full[:, t + j]
    return F.silu(y), full[:, -(W - 1):].transpose(1, 2)


@pytest.mark.parametrize("T,with_cache", [(7, False), (7, True), (2, True), (1, False)])
def test_torch_short_conv_equals_a_loop_over_taps(T, with_cache):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, T, 5, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    cache = torch.randn(2, 5, 3, generator=g, dtype=torch.float64) if with_cache else None
    y, new = short_conv_torch(x, w, cache)
    y_ref, new_ref = _loop_conv(x, w, cache)
    assert y.shape == (2, T, 5) and new.shape == (2, 5, 3)
    assert torch.allclose(y, y_ref, atol=1e-12, rtol=0) and torch.allclose(new, new_ref, atol=0, rtol=0)


def test_short_conv_split_continues_exactly_from_its_cache():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 9, 6, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)
    whole, cache_whole = short_conv(x, w, None)
    a, cache_a = short_conv(x[:, :4], w, None)
    b, cache_b = short_conv(x[:, 4:], w, cache_a)
    assert torch.equal(torch.cat([a, b], dim=1), whole) and torch.equal(cache_b, cache_whole)


def test_gated_norm_is_rmsnorm_times_weight_times_silu_gate():
    g = torch.Generator().manual_seed(2)
    o, gate = torch.randn(3, 2, 8, generator=g, dtype=torch.float64), torch.randn(3, 2, 8, generator=g,
                                                                                dtype=torch.float64)
    w = torch.rand(8, generator=g, dtype=torch.float64) + 0.5
    ref = o / torch.sqrt((o ** 2).mean(-1, keepdim=True) + 1e-5) * w * gate * torch.sigmoid(gate)
    assert torch.allclose(gated_rms_norm(o, gate, w, 1e-5), ref, atol=1e-14, rtol=0)
    assert torch.allclose(gated_rms_norm_torch(o, gate, w, 1e-5), ref, atol=1e-14, rtol=0)


def test_auto_picks_torch_off_cuda_and_for_training_and_fla_is_refused_off_cuda(monkeypatch):
    monkeypatch.delenv(glue.CHOICE.env, raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert glue.CHOICE.select(cpu, torch.bfloat16, False) == ("torch", "device cpu")
    assert glue.CHOICE.select(cuda, torch.bfloat16, True)[0] == "torch"
    assert glue.CHOICE.select(cuda, torch.float64, False) == ("torch", "torch.float64 inputs")
    monkeypatch.setattr(registry, "fla_installed", lambda: True)  # the shared rule, registry.fla_for_inference
    assert glue.CHOICE.select(cuda, torch.bfloat16, False) == ("fla", "CUDA inference, fla installed")
    monkeypatch.setattr(registry, "fla_installed", lambda: False)
    assert glue.CHOICE.select(cuda, torch.bfloat16, False) == ("torch", "fla not installed")
    with pytest.raises(ValueError, match="GDN glue backend 'fla' needs CUDA / ROCm tensors; got cpu"):
        select_glue_backend("fla", cpu, torch.float32, False)
    with pytest.raises(ValueError, match="expected one of"):
        select_glue_backend("cuda", cpu, torch.float32, False)
    monkeypatch.setenv(glue.CHOICE.env, "fla")  # the override is checked as an explicit request
    with pytest.raises(ValueError, match="needs CUDA"):
        short_conv(torch.zeros(1, 3, 2), torch.zeros(2, 4), None)


_CUDA_FLA = pytest.mark.skipif(not torch.cuda.is_available() or not registry.fla_installed(), reason="needs CUDA + fla")


@pytest.mark.gpu
@_CUDA_FLA
@pytest.mark.parametrize("T,with_cache", [(1000, False), (1000, True), (2, True), (3, False)])
def test_fla_short_conv_matches_torch_on_cuda(T, with_cache):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, T, 384, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(384, 4, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5
    cache = torch.randn(2, 384, 3, device="cuda", dtype=torch.bfloat16, generator=g) if with_cache else None
    y_f, c_f = short_conv(x, w, cache, backend="fla")
    y_t, c_t = short_conv(x, w, cache, backend="torch")
    ref, c_ref = _loop_conv(x.cpu(), w.cpu(), None if cache is None else cache.cpu())
    assert y_f.is_contiguous() and torch.equal(c_f, c_t)
    err_f, err_t = (y_f.cpu().double() - ref).abs().max().item(), (y_t.cpu().double() - ref).abs().max().item()
    assert err_f <= 2 * err_t + 1e-2, (err_f, err_t)
    assert torch.equal(c_f.cpu().double(), c_ref)


@pytest.mark.gpu
@_CUDA_FLA
def test_fla_gated_norm_matches_torch_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(3)
    o = torch.randn(2, 500, 6, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = torch.randn(2, 500, 6, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(512, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    ref = gated_rms_norm_torch(o.double(), gate.double(), w.double(), 1e-6)
    err_f = (gated_rms_norm(o, gate, w, 1e-6, backend="fla").double() - ref).abs().max().item()
    err_t = (gated_rms_norm(o, gate, w, 1e-6, backend="torch").double() - ref).abs().max().item()
    assert err_f <= 2 * err_t + 1e-3, (err_f, err_t)


@pytest.mark.gpu
@_CUDA_FLA
def test_gdn_chunked_prefill_with_fla_glue_equals_its_one_shot_forward():
    from hylo_bench.models.gdn import GatedDeltaNet

    torch.manual_seed(0)
    m = GatedDeltaNet(256, 2, 64).to("cuda", torch.bfloat16).eval()
    x = torch.randn(1, 300, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        whole, _ = m(x)
        a, st = m(x[:, :130], use_cache=True)
        b, _ = m(x[:, 130:], state=st, use_cache=True)
    ref, _ = m(x)  # the weights need a gradient here: "auto" keeps the torch conv and norm
    split = torch.cat([a, b], dim=1)
    scale = ref.abs().max().item()
    assert (whole - ref.detach()).abs().max().item() <= 2e-2 * scale
    assert (split - whole).abs().max().item() <= 2e-2 * scale


@pytest.mark.gpu
@_CUDA_FLA
def test_fla_short_conv_reads_a_column_slice_in_place():
    """fla's convolution reads a column slice (a view with row stride wider than its channels, such as the q / k / v
    columns of a merged projection's output) in place: the result equals the same columns made contiguous."""
    g = torch.Generator(device="cuda").manual_seed(4)
    proj = torch.randn(2, 700, 390, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(384, 4, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5
    cache = torch.randn(2, 384, 3, device="cuda", dtype=torch.bfloat16, generator=g)
    view = proj[..., :384]
    assert not view.is_contiguous()
    y_v, c_v = short_conv(view, w, cache, backend="fla")
    y_c, c_c = short_conv(view.contiguous(), w, cache, backend="fla")
    assert torch.equal(y_v, y_c) and torch.equal(c_v, c_c)


@pytest.mark.gpu
@_CUDA_FLA
def test_intracard_split_of_one_long_sequence_matches_the_plain_pass(monkeypatch, caplog):
    """fla's intra-card context parallelism on one 40,000-token sequence (split into sub-sequences, merged by their
    affine state maps) against the plain sequential pass: same output and final state up to rounding."""
    from hylo_bench.kernels.gated_delta import fla_backend, gated_delta_rule

    g = torch.Generator(device="cuda").manual_seed(2)
    B, T, H, K, V = 1, 40_000, 2, 128, 256
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = -torch.rand(B, T, H, device="cuda", generator=g) * 0.05
    beta = torch.rand(B, T, H, device="cuda", generator=g)
    h0 = torch.randn(B, H, K, V, device="cuda", generator=g)
    out = {}
    for split in ("0", "1"):
        monkeypatch.setenv(fla_backend.INTRACARD_ENV, split)
        with torch.inference_mode(), caplog.at_level(logging.INFO, logger="fla.backends"):
            assert fla_backend.intracard_split(q) is (split == "1")
            out[split] = gated_delta_rule(q, k, v, gate, beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, backend="fla")
    assert "intracard_cp" in caplog.text  # fla's dispatch log: the split path ran
    (o0, s0), (o1, s1) = out["0"], out["1"]
    assert (o1.float() - o0.float()).abs().max().item() <= 2e-2 * o0.float().abs().max().item()
    assert (s1 - s0).abs().max().item() <= 2e-2 * s0.abs().max().item()
