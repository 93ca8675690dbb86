"""GDN decode pre-step (hylo_bench.kernels.gated_delta.decode_prestep): the torch reference against the model's
own T == 1 forward pieces, and the one-kernel Triton version against the reference (Triton's interpreter on CPU
with ``TRITON_INTERPRET=1``; bf16 on CUDA in the GPU test)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hylo_bench.kernels.gated_delta.decode_prestep import gdn_decode_prestep_reference


def _inputs(B=2, H=3, K=8, Vd=16, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    Ck, Cv = H * K, H * Vd
    C = 2 * Ck + Cv
    proj = torch.randn(B, 1, C + 2 * H + Cv, generator=gen, dtype=torch.float64) * 2
    caches = tuple(torch.randn(B, c, 3, generator=gen, dtype=torch.float64) for c in (Ck, Ck, Cv))
    w = torch.randn(C, 4, generator=gen, dtype=torch.float64) * 0.5
    A_log = torch.rand(H, generator=gen, dtype=torch.float64).float()
    dt_bias = (torch.randn(H, generator=gen, dtype=torch.float64) * 10).float()  # some a + dt_bias beyond 20
    def cast(t):
        return t.to(device=device, dtype=dtype)

    return cast(proj), tuple(cast(c) for c in caches), cast(w), A_log.to(device), dt_bias.to(device)


def test_reference_equals_conv1d_silu_and_gates():
    """Against F.conv1d over [cache ; x] (the model's short conv) and the gate formulas, float64."""
    proj, caches, w, A_log, dt_bias = _inputs()
    before = [c.clone() for c in caches]
    act, g, beta = gdn_decode_prestep_reference(proj, caches, w, A_log, dt_bias)
    C = sum(c.shape[1] for c in caches)
    xx = torch.cat([torch.cat(before, dim=1), proj[:, 0, :C, None]], dim=-1)  # [B, C, 4]
    want = F.silu(F.conv1d(xx, w[:, None], groups=C)[..., 0])
    torch.testing.assert_close(act, want, rtol=0, atol=1e-12)
    H = A_log.shape[0]
    a, b = proj[:, 0, C:C + H], proj[:, 0, C + H:C + 2 * H]
    torch.testing.assert_close(g, -A_log.double().exp() * F.softplus(a + dt_bias.double()), rtol=0, atol=1e-12)
    torch.testing.assert_close(beta, torch.sigmoid(b), rtol=0, atol=1e-15)
    for c, old, x in zip(caches, before, proj[:, 0, :C].split([c.shape[1] for c in caches], dim=-1)):
        assert torch.equal(c[..., :2], old[..., 1:]) and torch.equal(c[..., 2], x)


def _check_triton(B, H, K, Vd, dtype, device):
    from hylo_bench.kernels.gated_delta.decode_prestep_triton import gdn_decode_prestep_triton

    proj, caches, w, A_log, dt_bias = _inputs(B, H, K, Vd, dtype, device, seed=B * H)
    ref_caches = tuple(c.clone() for c in caches)
    act, g, beta = gdn_decode_prestep_triton(proj, caches, w, A_log, dt_bias)
    want_act, want_g, want_beta = gdn_decode_prestep_reference(proj, ref_caches, w, A_log, dt_bias)
    assert all(torch.equal(c, r) for c, r in zip(caches, ref_caches))  # the shift is exact (no arithmetic)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the conv sum's rounding may differ by one ulp (2^-8)
    torch.testing.assert_close(act.float(), want_act.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(g, want_g.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beta, want_beta.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("B,H,K,Vd", [(1, 3, 8, 16), (2, 6, 256, 512), (3, 5, 24, 40)])
def test_triton_prestep_matches_reference_interpreter(B, H, K, Vd):
    _check_triton(B, H, K, Vd, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,H,K,Vd", [(1, 6, 256, 512), (4, 6, 256, 512), (3, 5, 24, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_prestep_on_cuda(B, H, K, Vd, dtype):
    pytest.importorskip("triton")
    _check_triton(B, H, K, Vd, dtype, "cuda")


def test_triton_prestep_refuses_what_it_cannot_serve():
    """Checked before any launch (no GPU or interpreter needed): float64 (the kernel sums in float32 and returns
    float32 gates, while the reference and the custom op's fake give float64), a conv weight of the wrong row
    count (the kernel would read past it), caches of unequal q / k width."""
    pytest.importorskip("triton")
    from hylo_bench.kernels.gated_delta.decode_prestep_triton import gdn_decode_prestep_triton

    proj, caches, w, A_log, dt_bias = _inputs(dtype=torch.float64)
    with pytest.raises(ValueError, match="float64 inputs take the reference"):
        gdn_decode_prestep_triton(proj, caches, w, A_log, dt_bias)
    proj, caches, w, A_log, dt_bias = _inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"conv_weight must be \[C=96, 4\]"):
        gdn_decode_prestep_triton(proj, caches, w[:-5], A_log, dt_bias)
    with pytest.raises(ValueError, match="caches"):
        gdn_decode_prestep_triton(proj, (caches[0], caches[0][:, :-1], caches[2]), w, A_log, dt_bias)
    with pytest.raises(ValueError, match=r"proj must be \[B, 1, >= C \+ 2H = 102\]"):
        gdn_decode_prestep_triton(proj[..., :101], caches, w, A_log, dt_bias)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 and triton")
def test_triton_prestep_strided_gate_parameters():
    """A_log / dt_bias given as strided views are read element by element."""
    from hylo_bench.kernels.gated_delta.decode_prestep_triton import gdn_decode_prestep_triton

    proj, caches, w, A_log, dt_bias = _inputs(B=1, dtype=torch.float32)
    A_s = torch.stack([A_log, torch.zeros_like(A_log)], 1).reshape(-1)[::2]
    dt_s = torch.stack([dt_bias, torch.zeros_like(dt_bias)], 1).reshape(-1)[::2]
    ref_caches = tuple(c.clone() for c in caches)
    _, g, beta = gdn_decode_prestep_triton(proj, caches, w, A_s, dt_s)
    _, want_g, want_beta = gdn_decode_prestep_reference(proj, ref_caches, w, A_log, dt_bias)
    torch.testing.assert_close(g, want_g, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(beta, want_beta, rtol=1e-5, atol=1e-6)
