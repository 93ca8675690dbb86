"""GatedDeltaNet mixer: fla 0.6.0 parameter layout, forward semantics vs a spec-level float64 reference,
prefill + decode consistency, left padding, dtypes, and a GPU-marked fla vs torch back-end parity check."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from hylo_bench.kernels.gated_delta import gated_delta_rule_reference
from hylo_bench.kernels.gated_delta.fla_backend import fla_backward_refusal, probe_gdn_environment
from hylo_bench.models.gdn import GatedDeltaNet, GDNState

HAS_FLA = importlib.util.find_spec("fla") is not None


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def tiny(dtype=torch.float64, seed=0, **kw) -> GatedDeltaNet:
    torch.manual_seed(seed)
    args = {"hidden_size": 48, "num_heads": 2, "head_dim": 8, "expand_v": 2, "conv_size": 4}
    args.update(kw)
    layer = GatedDeltaNet(**args)
    with torch.no_grad():  # larger-than-default weights so every part of the layer matters numerically
        for p in layer.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
        layer.o_norm.weight.uniform_(0.5, 1.5)
    return layer.to(dtype)


def rand_x(B, T, D=48, dtype=torch.float64, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# Released HyLo layout, Llama-3.2-1B / Qwen3-1.7B backbones (checkpoint-format.md sec. 4.4, kernels.md sec. 3.2).
RELEASED_1B_SHAPES = {
    "q_proj.weight": (1536, 2048),
    "k_proj.weight": (1536, 2048),
    "v_proj.weight": (3072, 2048),
    "a_proj.weight": (6, 2048),
    "b_proj.weight": (6, 2048),
    "A_log": (6,),
    "dt_bias": (6,),
    "q_conv1d.weight": (1536, 1, 4),
    "k_conv1d.weight": (1536, 1, 4),
    "v_conv1d.weight": (3072, 1, 4),
    "g_proj.weight": (3072, 2048),
    "o_norm.weight": (512,),
    "o_proj.weight": (2048, 3072),
}


def test_released_layout_names_shapes_count_on_meta():
    with torch.device("meta"):
        layer = GatedDeltaNet(2048, 6, 256, expand_v=2)
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == RELEASED_1B_SHAPES
    assert sum(p.numel() for p in layer.parameters()) == 25_215_500
    assert layer.A_log.dtype == torch.float32 and layer.dt_bias.dtype == torch.float32
    assert not list(layer.buffers())
    with torch.device("meta"):
        layer3b = GatedDeltaNet(3072, 9, 256, expand_v=2)
    assert sum(p.numel() for p in layer3b.parameters()) == 56_715_794


def test_state_bytes_per_sequence():
    with torch.device("meta"):
        layer = GatedDeltaNet(2048, 6, 256, expand_v=2).to(torch.bfloat16)
    # recurrent 6 * 256 * 512 fp32 + conv (1536 + 1536 + 3072) channels * 3 columns * 2 bytes
    assert layer.state_bytes_per_sequence() == 3_145_728 + 36_864


def test_init_follows_fla():
    torch.manual_seed(0)
    layer = GatedDeltaNet(64, 16, 8)
    A = layer.A_log.detach().exp()
    assert ((A > 0) & (A <= 16)).all()
    dt = F.softplus(layer.dt_bias.detach())
    assert ((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5))).all()
    assert torch.equal(layer.o_norm.weight, torch.ones(16))
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay
    with torch.device("meta"):
        meta = GatedDeltaNet(64, 16, 8)
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert torch.isfinite(meta.A_log).all() and torch.equal(meta.o_norm.weight, torch.ones(16))


def test_constructor_errors():
    with pytest.raises(ValueError, match="integer"):
        GatedDeltaNet(64, 2, 8, expand_v=1.3)
    with pytest.raises(ValueError, match="num_heads"):
        GatedDeltaNet(64, 0, 8)


def spec_forward(layer: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """The layer written straight from checkpoint-format.md sec. 4.4, float64, per-token reference recurrence."""
    B, T, _ = x.shape
    H, K, Vd, W = layer.num_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size

    def conv(proj, conv_mod):
        y = F.conv1d(proj(x).transpose(1, 2), conv_mod.weight, padding=W - 1, groups=conv_mod.weight.shape[0])
        return F.silu(y[..., :T]).transpose(1, 2)

    q = F.normalize(conv(layer.q_proj, layer.q_conv1d).view(B, T, H, K), dim=-1, eps=0)
    k = F.normalize(conv(layer.k_proj, layer.k_conv1d).view(B, T, H, K), dim=-1, eps=0)
    v = conv(layer.v_proj, layer.v_conv1d).view(B, T, H, Vd)
    beta = torch.sigmoid(layer.b_proj(x))
    g = -layer.A_log.exp() * F.softplus(layer.a_proj(x) + layer.dt_bias)
    o, _ = gated_delta_rule_reference(q, k, v, g, beta, scale=1 / math.sqrt(K))
    gate = layer.g_proj(x).view(B, T, H, Vd)
    o = o / o.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * layer.o_norm.weight * F.silu(gate)
    return layer.o_proj(o.reshape(B, T, H * Vd))


def test_forward_matches_spec_float64():
    layer = tiny()
    x = rand_x(2, 70, seed=2)
    with torch.no_grad():
        out, state = layer(x)
        ref = spec_forward(layer, x)
    assert state is None
    # only difference from the spec: l2norm eps 1e-6 on the squared norm (fla), about 1e-7 relative here
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("prefill", [1, 23])
def test_prefill_then_decode_equals_full_forward(dtype, tol, prefill):
    layer = tiny(dtype)
    x = rand_x(2, 30, dtype=dtype, seed=3)
    with torch.no_grad():
        full, _ = layer(x)
        out, state = layer(x[:, :prefill], use_cache=True)
        outs = [out]
        for t in range(prefill, 30):
            out, state = layer(x[:, t : t + 1], state=state, use_cache=True)
            outs.append(out)
    assert isinstance(state, GDNState)
    assert state.recurrent.shape == (2, 2, 8, 16) and state.recurrent.dtype == (
        torch.float64 if dtype == torch.float64 else torch.float32
    )
    assert [tuple(c.shape) for c in state.conv] == [(2, 16, 3), (2, 16, 3), (2, 32, 3)]
    assert rel_err(torch.cat(outs, 1), full) < tol


def test_chunked_continuation_and_empty_state():
    layer = tiny()
    x = rand_x(2, 90, seed=4)
    with torch.no_grad():
        full, full_state = layer(x, use_cache=True)
        a, st = layer(x[:, :2], state=layer.empty_state(2), use_cache=True)  # T=2 < W-1 conv columns
        b, st = layer(x[:, 2:67], state=st, use_cache=True)
        c, st = layer(x[:, 67:], state=st, use_cache=True)
    assert rel_err(torch.cat([a, b, c], 1), full) < 1e-12
    assert rel_err(st.recurrent, full_state.recurrent) < 1e-12
    for c1, c2 in zip(st.conv, full_state.conv):
        assert rel_err(c1, c2) < 1e-14


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_left_padding_equals_unpadded_runs(dtype, tol):
    layer = tiny(dtype, seed=5)
    lengths = [30, 17, 1]
    T = max(lengths)
    xs = [rand_x(1, n, dtype=dtype, seed=10 + i) for i, n in enumerate(lengths)]
    x_pad = torch.stack([F.pad(x[0], (0, 0, T - x.shape[1], 0), value=7.0) for x in xs])  # junk in pads
    mask = torch.stack([torch.arange(T) >= T - n for n in lengths]).long()
    step_x = rand_x(3, 1, dtype=dtype, seed=99)
    with torch.no_grad():
        out_pad, st_pad = layer(x_pad, attention_mask=mask, use_cache=True)
        nxt_pad, _ = layer(
            step_x,
            attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1),
            state=st_pad,
            use_cache=True,
        )
        for i, (x, n) in enumerate(zip(xs, lengths)):
            out_i, st_i = layer(x, use_cache=True)
            nxt_i, _ = layer(step_x[i : i + 1], state=st_i, use_cache=True)
            assert rel_err(out_pad[i, T - n :], out_i[0]) < tol
            assert torch.all(out_pad[i, : T - n] == 0)
            assert rel_err(st_pad.recurrent[i], st_i.recurrent[0]) < tol
            assert rel_err(nxt_pad[i], nxt_i[0]) < tol


def test_bf16_and_fp32_run_on_cpu():
    layer32 = tiny(torch.float32, seed=6)
    layer16 = tiny(torch.float32, seed=6).to(torch.bfloat16)
    x = rand_x(2, 40, dtype=torch.float32, seed=7)
    with torch.no_grad():
        y32, _ = layer32(x)
        y16, st = layer16(x.bfloat16(), use_cache=True)
        z16, st = layer16(x[:, :1].bfloat16(), state=st, use_cache=True)
    assert y16.dtype == torch.bfloat16 and z16.dtype == torch.bfloat16
    assert st.recurrent.dtype == torch.float32 and st.conv[0].dtype == torch.bfloat16
    assert torch.isfinite(y16.float()).all() and torch.isfinite(z16.float()).all()
    assert rel_err(y16, y32) < 5e-2


def test_backward_reaches_every_parameter():
    layer = tiny(torch.float32, seed=8)
    x = rand_x(2, 70, dtype=torch.float32, seed=9).requires_grad_(True)
    out, state = layer(x, use_cache=True)
    out2, _ = layer(x[:, :1], state=state)  # decode step is differentiable too
    (out.square().mean() + out2.square().mean()).backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()


def test_bad_mask_raises():
    layer = tiny()
    with pytest.raises(ValueError, match="attention_mask"):
        layer(rand_x(2, 5), attention_mask=torch.ones(2, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_FLA, reason="needs a CUDA GPU and fla installed")
def test_layer_fla_backend_matches_torch_backend_bf16():
    device = torch.device("cuda")
    torch.manual_seed(0)
    base = GatedDeltaNet(512, 4, 128, expand_v=2).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        base.A_log.copy_(base.A_log.float())
    x = torch.randn(2, 700, 512, device=device, dtype=torch.bfloat16)
    refusal = fla_backward_refusal(probe_gdn_environment(device))
    results = {}
    for backend in ("fla", "torch"):
        base.backend = backend
        base.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(refusal is None)
        out, state = base(xi, use_cache=True)
        if refusal is None:
            out.float().square().mean().backward()
        grads = {n: p.grad.clone() for n, p in base.named_parameters()} if refusal is None else {}
        results[backend] = (out.detach(), state.recurrent, grads)
    (o_f, s_f, g_f), (o_t, s_t, g_t) = results["fla"], results["torch"]
    assert rel_err(o_f, o_t) < 2e-2
    assert rel_err(s_f, s_t) < 2e-2
    for name in g_t:
        assert rel_err(g_f[name], g_t[name]) < 2e-2, name
    if refusal is not None:
        pytest.skip(f"forward checked; backward not compared: {refusal}")
