"""Absorbed MLA decode attention: torch reference vs a per-head loop over decompressed keys (CPU), Triton kernel vs
the reference (GPU-marked), input validation."""

from __future__ import annotations

import pytest
import torch

from hylo_bench.kernels.mla_decode import mla_decode, mla_decode_reference


def _inputs(B, H, T, R, P, G, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q_lat = torch.randn(B, H, R, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(B, H, P, generator=gen, dtype=torch.float64)
    cache = torch.randn(B, T, R + P, generator=gen, dtype=torch.float64)
    ks = torch.rand(B, T, G, generator=gen, dtype=torch.float64) + 0.5
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q_lat, q_rope, cache, ks)] + [lengths.to(device)]


def _loop(q_lat, q_rope, cache, lengths, scale, ks):
    B, H, R = q_lat.shape
    G = ks.shape[-1]
    out = torch.zeros(B, H, R, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        for h in range(H):
            g = h // (H // G)
            s = torch.stack([(q_lat[b, h] @ cache[b, t, :R] + q_rope[b, h] @ cache[b, t, R:]) * ks[b, t, g] * scale
                             for t in range(n)])
            p = torch.softmax(s, 0)
            out[b, h] = (p[:, None] * cache[b, :n, :R]).sum(0)
    return out


@pytest.mark.parametrize("use_scale", [False, True])
def test_reference_equals_loop_B3_H4_T11_R8_P4_G2(use_scale):
    q_lat, q_rope, cache, ks, lengths = _inputs(3, 4, 11, 8, 4, 2)
    ks_arg = ks if use_scale else None
    got = mla_decode(q_lat, q_rope, cache, lengths, scale=0.3, key_scale=ks_arg, backend="torch")
    want = _loop(q_lat, q_rope, cache, lengths, 0.3, ks if use_scale else torch.ones_like(ks))
    assert got.dtype == torch.float64
    assert ((got - want).norm() / want.norm()).item() < 1e-12


def test_rows_past_the_length_are_ignored():
    q_lat, q_rope, cache, ks, _ = _inputs(2, 4, 9, 8, 4, 2)
    lengths = torch.tensor([5, 9])
    a = mla_decode_reference(q_lat, q_rope, cache, lengths, 0.5, ks)
    cache2 = cache.clone()
    cache2[0, 5:] = 1e3
    ks2 = ks.clone()
    ks2[0, 5:] = 7.0
    assert torch.equal(a, mla_decode_reference(q_lat, q_rope, cache2, lengths, 0.5, ks2))


def test_shape_errors_name_the_tensor():
    q_lat, q_rope, cache, ks, lengths = _inputs(2, 4, 9, 8, 4, 2)
    with pytest.raises(ValueError, match="cache must be"):
        mla_decode(q_lat, q_rope, cache[..., :-1], lengths, scale=1.0)
    with pytest.raises(ValueError, match="key_scale"):
        mla_decode(q_lat, q_rope, cache, lengths, scale=1.0, key_scale=ks[..., :1].expand(2, 9, 3))
    with pytest.raises(ValueError, match="backend"):
        mla_decode(q_lat, q_rope, cache, lengths, scale=1.0, backend="cuda")
    with pytest.raises(ValueError, match="CUDA"):
        mla_decode(q_lat, q_rope, cache, lengths, scale=1.0, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,T,R,P,G", [(1, 16, 70_001, 256, 64, 8), (3, 32, 1000, 128, 32, 8),
                                          (2, 4, 37, 32, 8, 2)])
@pytest.mark.parametrize("use_scale", [False, True])
def test_triton_matches_reference_bf16(B, H, T, R, P, G, use_scale):
    q_lat, q_rope, cache, ks, lengths = _inputs(B, H, T, R, P, G, dtype=torch.bfloat16, device="cuda")
    ks_arg = ks if use_scale else None
    got = mla_decode(q_lat, q_rope, cache, lengths, scale=R ** -0.5, key_scale=ks_arg, backend="triton")
    want = mla_decode_reference(q_lat, q_rope, cache, lengths, R ** -0.5, ks_arg)
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_l2_prefetch_matches_reference_and_survives_a_garbage_length():
    """With ``L2_PREFETCH`` the split kernel reads the length before the PDL wait as a prefetch hint. Inside a
    CUDA graph that buffer can hold stale memory, so the hint is clamped: a length whose product with the row stride
    overflows int64 (a 2**63-sized prefetch loop before the clamp: the GPU hung) must end, and the other row must
    still match the reference. Run in a subprocess so that a hang fails the test instead of stopping the suite."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from hylo_bench.kernels.mla_decode import mla_decode_reference
        from hylo_bench.kernels.mla_decode import triton_kernel as tk
        from hylo_bench.kernels.pdl import use_pdl
        assert use_pdl(torch.device("cuda")), "needs PDL"
        tk.L2_PREFETCH = True
        torch.manual_seed(0)
        B, H, T, R, P = 2, 16, 20_000, 256, 64
        q_lat, q_rope = torch.randn(B, H, R, device="cuda"), torch.randn(B, H, P, device="cuda")
        cache = torch.randn(B, T, R + P, device="cuda").bfloat16()
        # row 0: times the row stride, wraps to about +2**63; its low 32 bits (the kernel's length) are negative
        lengths = torch.tensor([-(2 ** 63 // (R + P)) - 7, 12_345], device="cuda")
        got = tk.mla_decode_triton(q_lat.bfloat16(), q_rope.bfloat16(), cache, lengths, R ** -0.5)
        torch.cuda.synchronize()
        want = mla_decode_reference(q_lat.bfloat16(), q_rope.bfloat16(), cache, lengths.clamp(min=1), R ** -0.5)
        err = ((got[1] - want[1]).norm() / want[1].norm()).item()
        assert err < 1e-2, err
        print("ok")
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the split kernel did not end with a garbage length and L2_PREFETCH on")
    if "needs PDL" in done.stderr:
        pytest.skip("the prefetch runs only with programmatic dependent launch (compute capability >= 9)")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
