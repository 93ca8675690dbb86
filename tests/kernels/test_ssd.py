"""SSD (Mamba-2) scan: chunked torch scan and decode step vs the naive float64 recurrence; GPU-marked fla parity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylo_bench.kernels.ssd import ssd_scan, ssd_scan_chunked, ssd_scan_reference, ssd_step


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def inputs(Bsz=2, T=37, H=4, G=2, P=8, N=6, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    out = dict(x=r(Bsz, T, H, P), dt=r(Bsz, T, H) - 1.0, A=-torch.empty(H, dtype=torch.float64).uniform_(
        1, 16, generator=g), B=r(Bsz, T, G, N), C=r(Bsz, T, G, N))
    extra = dict(D=r(H), dt_bias=r(H) * 0.5, initial_state=r(Bsz, H, P, N))
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}, {
        k: v.to(device=device, dtype=dtype) for k, v in extra.items()}


def hand_recurrence(x, dt, A, B, C, D, dt_bias, S0):
    """Independent scalar-loop transcription of checkpoint-format.md sec. 4.5 step 4 (float64)."""
    Bsz, T, H, P = x.shape
    G = B.shape[2]
    y = torch.zeros_like(x)
    S = S0.clone()
    for b in range(Bsz):
        for h in range(H):
            g = h // (H // G)
            for t in range(T):
                d = F.softplus(dt[b, t, h] + dt_bias[h])
                S[b, h] = torch.exp(d * A[h]) * S[b, h] + d * torch.outer(x[b, t, h], B[b, t, g])
                y[b, t, h] = S[b, h] @ C[b, t, g] + D[h] * x[b, t, h]
    return y, S


def test_reference_matches_hand_recurrence():
    a, e = inputs(Bsz=1, T=9, H=2, G=1, P=3, N=2)
    y, S = ssd_scan_reference(**a, D=e["D"], dt_bias=e["dt_bias"], dt_softplus=True, initial_state=e["initial_state"])
    y2, S2 = hand_recurrence(a["x"], a["dt"], a["A"], a["B"], a["C"], e["D"], e["dt_bias"], e["initial_state"])
    assert rel_err(y, y2) < 1e-13 and rel_err(S, S2) < 1e-13


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64, 256])
@pytest.mark.parametrize("with_extras", [False, True], ids=["plain", "D-dtbias-softplus-h0"])
def test_chunked_equals_naive_float64(chunk_size, with_extras):
    a, e = inputs()
    kw = dict(D=e["D"], dt_bias=e["dt_bias"], dt_softplus=True, initial_state=e["initial_state"]) if with_extras \
        else {}
    if not with_extras:  # raw dt must then already be a positive step size
        a["dt"] = F.softplus(a["dt"])
    y_ref, S_ref = ssd_scan_reference(**a, **kw)
    y, S = ssd_scan_chunked(**a, **kw, chunk_size=chunk_size)
    assert y.dtype == torch.float64 and S.shape == (2, 4, 8, 6)
    assert rel_err(y, y_ref) < 1e-10 and rel_err(S, S_ref) < 1e-10
    assert y.abs().max() > 1e-3  # non-trivial outputs


def test_initial_state_matters_and_split_scan_continues():
    a, e = inputs(T=40)
    kw = dict(D=e["D"], dt_bias=e["dt_bias"], dt_softplus=True)
    y_full, S_full = ssd_scan_chunked(**a, **kw, chunk_size=8)
    first = {k: (v[:, :17] if v.dim() >= 3 else v) for k, v in a.items()}
    rest = {k: (v[:, 17:] if v.dim() >= 3 else v) for k, v in a.items()}
    y1, S1 = ssd_scan_chunked(**first, **kw, chunk_size=8)
    y2, S2 = ssd_scan_chunked(**rest, **kw, initial_state=S1, chunk_size=8)
    assert rel_err(torch.cat([y1, y2], 1), y_full) < 1e-12 and rel_err(S2, S_full) < 1e-12
    y_h0, _ = ssd_scan_chunked(**a, **kw, initial_state=e["initial_state"], chunk_size=8)
    assert rel_err(y_h0, y_full) > 1e-3


def test_step_equals_naive_token_by_token():
    a, e = inputs(T=11)
    kw = dict(D=e["D"], dt_bias=e["dt_bias"], dt_softplus=True)
    y_ref, S_ref = ssd_scan_reference(**a, **kw, initial_state=e["initial_state"])
    S, ys = e["initial_state"], []
    for t in range(11):
        y, S = ssd_step(a["x"][:, t], a["dt"][:, t], a["A"], a["B"][:, t], a["C"][:, t], S, **kw)
        ys.append(y)
    assert rel_err(torch.stack(ys, 1), y_ref) < 1e-12 and rel_err(S, S_ref) < 1e-12


def test_float32_close_and_grad_flows():
    a, e = inputs(dtype=torch.float32)
    a = {k: v.requires_grad_() for k, v in a.items()}
    y, S = ssd_scan_chunked(**a, D=e["D"], dt_bias=e["dt_bias"], dt_softplus=True, chunk_size=16)
    y_ref, _ = ssd_scan_reference(**{k: v.double() for k, v in a.items()}, D=e["D"].double(),
                                  dt_bias=e["dt_bias"].double(), dt_softplus=True)
    assert y.dtype == torch.float32 and S.dtype == torch.float32 and rel_err(y, y_ref) < 1e-5
    (y.square().sum() + S.sum()).backward()
    assert all(v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0 for v in a.values())


def test_shape_errors_name_the_argument():
    a, _ = inputs()
    with pytest.raises(ValueError, match=r"dt must be \[B, T, H\]"):
        ssd_scan_chunked(**(a | {"dt": a["dt"][..., :2]}))
    with pytest.raises(ValueError, match="multiple of the B/C groups"):
        ssd_scan_chunked(**(a | {"B": a["B"][:, :, :1].expand(-1, -1, 3, -1), "C": a["C"][:, :, :1].expand(
            -1, -1, 3, -1)}))
    with pytest.raises(ValueError, match="backend="):
        ssd_scan(**a, backend="cuda")
    with pytest.raises(ValueError, match="needs CUDA"):
        ssd_scan(**a, backend="fla")


@pytest.mark.gpu
def test_fla_backend_matches_torch_bf16():
    pytest.importorskip("fla")
    a, e = inputs(Bsz=2, T=300, H=4, G=2, P=64, N=64, dtype=torch.bfloat16, device="cuda")
    a["A"] = a["A"].float()
    kw = dict(D=e["D"].float(), dt_bias=e["dt_bias"].float(), dt_softplus=True,
              initial_state=e["initial_state"].float())
    y_t, S_t = ssd_scan(**a, **kw, backend="torch")
    y_f, S_f = ssd_scan(**a, **kw, backend="fla")
    assert rel_err(y_f, y_t) < 1e-2 and rel_err(S_f, S_t) < 1e-2
