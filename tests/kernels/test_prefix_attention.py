"""Chunked-prefill attention (hylo_bench.kernels.prefix_attention): the split into an unmasked prefix part and a
causal diagonal part, merged by log-sum-exp, equals lower-right causal attention computed another way (a float64
loop over queries); every back end agrees; cuDNN is refused where it cannot run; on CUDA the cuDNN split equals
the SDPA path."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hylo_bench.kernels import prefix_attention as PA
from hylo_bench.kernels.prefix_attention import (
    cudnn_attend,
    math_attend,
    merge_partial_attention,
    prefix_attention,
    sdpa_prefix_attention,
    select_prefix_attention_backend,
    split_prefix_attention,
)


def _loop_reference(q, k, v, scale, start):
    """Query t of the chunk attends keys 0 .. start + t: softmax over an explicit float64 slice, one query at a
    time. q [B, H, T, d]; k, v [B, G, S, d] -> [B, H, T, d_v] float64."""
    B, H, T, _ = q.shape
    rep = H // k.shape[1]
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                keys, vals = k[b, h // rep, : start + t + 1].double(), v[b, h // rep, : start + t + 1].double()
                w = torch.softmax(keys @ q[b, h, t].double() * scale, dim=0)
                out[b, h, t] = w @ vals
    return out


def _inputs(B, H, G, T, S, d_qk, d_v, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    return mk(B, H, T, d_qk), mk(B, G, S, d_qk), mk(B, G, S, d_v)


@pytest.mark.parametrize("T,S", [(5, 12), (6, 6), (1, 9), (4, 5)])
def test_split_and_merge_equal_lower_right_causal_attention(T, S):
    q, k, v = _inputs(2, 4, 2, T, S, 8, 6)
    scale = 1 / math.sqrt(8)
    ref = _loop_reference(q, k, v, scale, S - T)
    split = split_prefix_attention(q, k, v, scale, S - T, attend=math_attend)
    assert torch.allclose(split, ref, atol=1e-12, rtol=0)
    sdpa = sdpa_prefix_attention(q, k, v, scale, S - T)
    assert torch.allclose(sdpa, ref, atol=1e-12, rtol=0)
    assert torch.allclose(prefix_attention(q, k, v, scale, S - T), ref, atol=1e-12, rtol=0)  # auto -> sdpa on CPU


@pytest.mark.parametrize("T,S", [(5, 12), (6, 6), (3, 3), (8, 20), (1, 9)])
def test_padded_queries_give_the_unpadded_attention_and_bucketed_shapes(T, S):
    """Padding a chunk's queries (and its own keys) to a multiple of 4 changes no real query's output (float64,
    against the per-query loop), and every call the back end sees has a multiple of 4 queries (T == 1 unpadded)."""
    q, k, v = _inputs(2, 4, 2, T, S, 8, 6, seed=3)
    scale = 1 / math.sqrt(8)
    shapes = []

    def attend(q, k, v, causal, scale):
        shapes.append((q.shape[-2], k.shape[-2], causal))
        return math_attend(q, k, v, causal, scale)

    out = split_prefix_attention(q, k, v, scale, S - T, attend=attend, query_bucket=4)
    assert out.shape == (2, 4, T, 6)
    assert torch.allclose(out, _loop_reference(q, k, v, scale, S - T), atol=1e-12, rtol=0)
    padded = -(-T // 4) * 4 if T > 1 else 1
    want = [(padded, padded if T > 1 else S, T > 1)] + ([(padded, S - T, False)] if S > T and T > 1 else [])
    assert shapes == want


def test_split_refuses_a_query_bucket_below_one():
    q, k, v = _inputs(1, 2, 1, 3, 7, 4, 4)
    with pytest.raises(ValueError, match="query_bucket must be >= 1, got 0"):
        split_prefix_attention(q, k, v, 1.0, 4, attend=math_attend, query_bucket=0)


def test_math_attend_log_sum_exp_is_the_scores_log_normaliser():
    q, k, v = _inputs(1, 2, 1, 3, 7, 4, 4)
    out, lse = math_attend(q, k, v, False, 0.5)
    s = q[0, 1] @ k[0, 0].T * 0.5
    assert lse.shape == (1, 2, 3, 1)
    assert torch.allclose(lse[0, 1, :, 0], torch.log(torch.exp(s).sum(-1)), atol=1e-12)
    assert torch.allclose(out[0, 1], torch.softmax(s, -1) @ v[0, 0], atol=1e-12)


def test_merge_takes_the_other_part_where_one_key_set_is_empty():
    out_a, out_b = torch.randn(1, 1, 3, 2, dtype=torch.float64), torch.randn(1, 1, 3, 2, dtype=torch.float64)
    lse_a = torch.tensor([[[[0.3], [float("-inf")], [2.0]]]], dtype=torch.float64)
    lse_b = torch.tensor([[[[float("-inf")], [1.0], [2.0]]]], dtype=torch.float64)
    out = merge_partial_attention(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0, 0, 0], out_a[0, 0, 0]) and torch.equal(out[0, 0, 1], out_b[0, 0, 1])
    assert torch.allclose(out[0, 0, 2], (out_a[0, 0, 2] + out_b[0, 0, 2]) / 2, atol=1e-15)


def test_split_refuses_a_start_that_does_not_match_the_keys():
    q, k, v = _inputs(1, 2, 2, 3, 8, 4, 4)
    with pytest.raises(ValueError, match=r"start=4 but the keys hold 8 tokens for a 3-token chunk \(expected 5\)"):
        split_prefix_attention(q, k, v, 1.0, 4, attend=math_attend)


def test_cudnn_split_is_refused_off_cuda_and_unknown_backends_are_named():
    q, k, v = _inputs(1, 2, 2, 3, 8, 4, 4, dtype=torch.bfloat16)
    assert select_prefix_attention_backend(torch.device("cpu"), torch.bfloat16, 128, 128) == ("sdpa", "device cpu")
    with pytest.raises(ValueError, match="cudnn_split cannot run here: device cpu; use 'sdpa'"):
        prefix_attention(q, k, v, 1.0, 5, backend="cudnn_split")
    with pytest.raises(ValueError, match=r"backend='flash'; expected one of \('auto', 'sdpa', 'cudnn_split'\)"):
        prefix_attention(q, k, v, 1.0, 5, backend="flash")


@pytest.fixture
def cudnn_pretend(monkeypatch):
    """CPU stand-in for a CUDA machine with cuDNN 9: the readiness check passes and the split raises as cuDNN
    does when it refuses a shape; returns the list of exceptions the split will raise, in order."""
    monkeypatch.setattr(PA, "_cudnn_ready", lambda device: "")
    monkeypatch.setattr(PA, "_REFUSED", set())
    monkeypatch.delenv(PA.CHOICE.env, raising=False)
    errors: list[Exception] = []

    def refuse(*args, **kwargs):
        raise errors.pop(0)

    monkeypatch.setattr(PA, "split_prefix_attention", refuse)
    return errors


def test_auto_falls_back_to_sdpa_once_cudnn_refuses_and_remembers_it(cudnn_pretend, caplog):
    q, k, v = _inputs(1, 4, 2, 128, 133, 8, 8, dtype=torch.bfloat16)  # a chunk long enough for cuDNN
    want = sdpa_prefix_attention(q, k, v, 0.3, 5)
    cudnn_pretend.append(RuntimeError("cuDNN Frontend error: [cudnn_frontend] No valid execution plans built."))
    assert select_prefix_attention_backend(q.device, q.dtype, 8, 8, 256)[0] == "cudnn_split"
    with caplog.at_level(logging.WARNING, logger="hylo_bench.kernels.prefix_attention"):
        assert torch.equal(prefix_attention(q, k, v, 0.3, 5), want)
        assert torch.equal(prefix_attention(q, k, v, 0.3, 5), want)  # no second try: cudnn_pretend is empty
    assert [r.getMessage() for r in caplog.records] == [
        "prefill attention backend: sdpa from now on for torch.bfloat16 d_qk=8 d_v=8 (cuDNN refused: cuDNN "
        "Frontend error: [cudnn_frontend] No valid execution plans built.)"]
    assert select_prefix_attention_backend(q.device, q.dtype, 8, 8, 256) == (
        "sdpa", "cuDNN refused torch.bfloat16 d_qk=8 d_v=8 earlier in this process")


def test_explicit_or_overridden_cudnn_and_out_of_memory_are_raised_not_hidden(cudnn_pretend, monkeypatch):
    q, k, v = _inputs(1, 4, 2, 128, 133, 8, 8, dtype=torch.bfloat16)
    cudnn_pretend.extend([RuntimeError("refused"), RuntimeError("refused"), torch.OutOfMemoryError("oom")])
    with pytest.raises(RuntimeError, match="refused"):
        prefix_attention(q, k, v, 0.3, 5, backend="cudnn_split")
    monkeypatch.setenv(PA.CHOICE.env, "cudnn_split")
    with pytest.raises(RuntimeError, match="refused"):
        prefix_attention(q, k, v, 0.3, 5)
    monkeypatch.delenv(PA.CHOICE.env)
    with pytest.raises(torch.OutOfMemoryError):
        prefix_attention(q, k, v, 0.3, 5)
    assert PA._REFUSED == set()


def test_short_chunks_and_decode_tokens_stay_on_sdpa(cudnn_pretend):
    q, k, v = _inputs(1, 4, 2, 1, 9, 8, 8, dtype=torch.bfloat16)
    assert select_prefix_attention_backend(q.device, q.dtype, 8, 8, 1) == (
        "sdpa", "chunk of 1 < 128 queries (no cuDNN graph per key length)")
    assert torch.equal(prefix_attention(q, k, v, 0.3, 8), sdpa_prefix_attention(q, k, v, 0.3, 8))  # no split call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,S,d_qk,d_v", [(256, 1024, 128, 128), (200, 1000, 192, 128), (300, 300, 128, 128),
                                          (1, 777, 128, 128)])
def test_cudnn_split_matches_sdpa_and_float64_on_cuda(T, S, d_qk, d_v):
    backend, why = select_prefix_attention_backend(torch.device("cuda"), torch.bfloat16, d_qk, d_v)
    if backend != "cudnn_split":
        pytest.skip(f"cuDNN attention not available here: {why}")
    q, k, v = _inputs(2, 16, 8, T, S, d_qk, d_v, dtype=torch.bfloat16, device="cuda")
    scale = 1 / math.sqrt(d_qk)
    ref = split_prefix_attention(q.double(), k.double(), v.double(), scale, S - T, attend=math_attend)
    cud = prefix_attention(q, k, v, scale, S - T, backend="cudnn_split")
    sdpa = prefix_attention(q, k, v, scale, S - T, backend="sdpa")
    err_cudnn, err_sdpa = (cud.double() - ref).abs().max().item(), (sdpa.double() - ref).abs().max().item()
    assert err_cudnn < 2e-2 and err_cudnn <= 2 * err_sdpa + 1e-3, (err_cudnn, err_sdpa)
    out, lse = cudnn_attend(q, k[:, :, : S - T or S], v[:, :, : S - T or S], False, scale)
    _, lse_ref = math_attend(q.double(), k[:, :, : S - T or S].double(), v[:, :, : S - T or S].double(), False, scale)
    assert lse.dtype == torch.float32 and torch.allclose(lse.double(), lse_ref, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cudnn_split_on_the_engines_strided_views_matches_sdpa():
    """The MLA prefill hands V over as a transposed split of the decompressed [B, S, G, N + V] rows, and the
    engine's K is sliced along S by the split: cuDNN must read those strides, not assume contiguous inputs."""
    B, H, G, T, S, N, V = 1, 16, 8, 128, 640, 64, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, T, H, 2 * N, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    kv = torch.randn(B, S, G, N + V, device="cuda", dtype=torch.bfloat16, generator=g)
    k_nope, v = kv.transpose(1, 2).split([N, V], dim=-1)
    k = torch.cat([k_nope, torch.randn_like(k_nope)], dim=-1)
    assert not v.is_contiguous() and not q.is_contiguous()
    backend, why = select_prefix_attention_backend(q.device, q.dtype, 2 * N, V, T)
    if backend != "cudnn_split":
        pytest.skip(f"cuDNN attention not available here: {why}")
    ref = split_prefix_attention(q.double(), k.double(), v.double(), N ** -0.5 / 2 ** 0.5, S - T, attend=math_attend)
    cud = prefix_attention(q, k, v, None, S - T, backend="cudnn_split")
    sdpa = prefix_attention(q, k, v, None, S - T, backend="sdpa")
    err_cudnn, err_sdpa = (cud.double() - ref).abs().max().item(), (sdpa.double() - ref).abs().max().item()
    assert err_cudnn <= 2 * err_sdpa + 1e-3, (err_cudnn, err_sdpa)
