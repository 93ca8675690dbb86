"""Mamba-2 mixer: Zebra-Llama parameter layout (spec values), forward vs a spec-level float64 transcription,
prefill + decode consistency, left padding, init, errors, and the released Qwen 14MLA14M2 model on meta."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hylo_bench.kernels.ssd import ssd_scan_reference
from hylo_bench.models.mamba2 import Mamba2, Mamba2State


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def tiny(dtype=torch.float64, seed=0, **kw) -> Mamba2:
    torch.manual_seed(seed)
    args = dict(hidden_size=40, d_inner=32, d_xb=16, ngroups=4, d_state=8, d_conv=4, chunk_size=8)
    args.update(kw)
    layer = Mamba2(**args)
    with torch.no_grad():  # non-default values so every parameter matters numerically
        layer.D.uniform_(-1, 1)
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.conv1d.bias.uniform_(-0.5, 0.5)
    return layer.to(dtype)


def rand_x(B, T, D=40, dtype=torch.float64, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def spec_forward(m: Mamba2, u: torch.Tensor) -> torch.Tensor:
    """checkpoint-format.md sec. 4.5 steps 1-5, written out with loops (float64)."""
    E, X, H, N = m.d_inner, m.d_xb, m.nheads, m.d_state
    Bsz, T, _ = u.shape
    zxbcdt = u @ m.in_proj.weight.T
    z, xBC, dt = zxbcdt[..., :E], zxbcdt[..., E:2 * E + 2 * X], zxbcdt[..., 2 * E + 2 * X:]
    w = m.conv1d.weight[:, 0]  # [C, W]
    W = w.shape[1]
    conv = torch.zeros_like(xBC)
    for t in range(T):
        for j in range(W):  # tap j multiplies input t - (W - 1) + j
            s = t - (W - 1) + j
            if s >= 0:
                conv[:, t] += w[:, j] * xBC[:, s]
    xBC = F.silu(conv + m.conv1d.bias)
    x, Bm, C = xBC[..., :X], xBC[..., X:2 * X], xBC[..., 2 * X:]
    n_kv, g = X // N, H // (X // N)
    x_h = torch.stack([x[..., (h // g) * N:(h // g + 1) * N] for h in range(H)], dim=2)
    B_h = torch.stack([Bm[..., (h // g) * N:(h // g + 1) * N] for h in range(H)], dim=2)
    C_h = C.reshape(Bsz, T, H, N)
    assert n_kv * g == H
    y, _ = ssd_scan_reference(x_h, dt, -torch.exp(m.A_log), B_h, C_h, D=m.D, dt_bias=m.dt_bias, dt_softplus=True)
    y = y.reshape(Bsz, T, E) * F.silu(z)
    yg = y.reshape(Bsz, T, H, N)
    yg = yg / torch.sqrt(yg.pow(2).mean(-1, keepdim=True) + 1e-5)
    return (yg.reshape(Bsz, T, E) * m.norm.weight) @ m.out_proj.weight.T


# Released Qwen3-1.7B Mamba-2 layer, values copied from checkpoint-format.md sec. 4.5 "Concrete shapes".
QWEN_M2_SHAPES = {
    "in_proj.weight": (6160, 2048),
    "conv1d.weight": (4096, 1, 4),
    "conv1d.bias": (4096,),
    "dt_bias": (16,),
    "A_log": (16,),
    "D": (16,),
    "norm.weight": (2048,),
    "out_proj.weight": (2048, 2048),
}


@pytest.mark.parametrize("dims, shapes", [
    (dict(hidden_size=2048, d_inner=2048, d_xb=1024, ngroups=16, d_state=128), QWEN_M2_SHAPES),
    (dict(hidden_size=2048, d_inner=2048, d_xb=512, ngroups=32, d_state=64),  # Llama-3.2-1B (paper only)
     {"in_proj.weight": (5152, 2048), "conv1d.weight": (3072, 1, 4), "D": (32,), "out_proj.weight": (2048, 2048)}),
    (dict(hidden_size=3072, d_inner=3072, d_xb=1024, ngroups=24, d_state=128),  # Llama-3.2-3B (paper only)
     {"in_proj.weight": (8216, 3072), "conv1d.weight": (5120, 1, 4), "conv1d.bias": (5120,), "A_log": (24,)}),
], ids=["qwen3-1.7b", "llama-1b", "llama-3b"])
def test_layer_names_and_shapes_match_spec_on_meta(dims, shapes):
    with torch.device("meta"):
        m = Mamba2(**dims)
    got = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert set(got) == set(QWEN_M2_SHAPES)
    assert {k: got[k] for k in shapes} == shapes
    if dims["ngroups"] == 16:
        # 6160*2048 + 4096*4 + 4096 + 3*16 + 2048 + 2048*2048 (sec. 4.5 table)
        assert sum(v.numel() for v in m.parameters()) == 12_615_680 + 16_384 + 4_096 + 48 + 2_048 + 4_194_304


def test_state_bytes_and_empty_state_layout():
    m = tiny(torch.float32)
    st = m.empty_state(3)
    assert isinstance(st, Mamba2State) and st.ssm.shape == (3, 4, 8, 8) and st.ssm.dtype == torch.float32
    assert st.conv.shape == (3, 32 + 2 * 16, 3)
    assert m.state_bytes_per_sequence() == 4 * 8 * 8 * 4 + 64 * 3 * 4


def test_init_follows_mamba_ssm_defaults():
    torch.manual_seed(0)
    m = Mamba2(hidden_size=64, d_inner=512, d_xb=256, ngroups=64, d_state=8)
    A = m.A_log.exp()
    dt = F.softplus(m.dt_bias)
    assert A.min() >= 1.0 and A.max() <= 16.0 and A.std() > 1.0
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert torch.equal(m.D, torch.ones(64)) and torch.equal(m.norm.weight, torch.ones(512))
    assert m.conv1d.bias is not None and m.in_proj.bias is None and m.out_proj.bias is None


@pytest.mark.parametrize("kw, match", [
    (dict(d_inner=30), "d_inner = ngroups \\* d_state"),
    (dict(d_xb=12), "d_xb = n_kv \\* d_state"),
    (dict(d_xb=24), "d_xb = n_kv \\* d_state"),  # 3 KV groups do not divide 4 heads
    (dict(d_conv=0), "d_conv must be >= 1"),
])
def test_constructor_errors(kw, match):
    args = dict(hidden_size=40, d_inner=32, d_xb=16, ngroups=4, d_state=8) | kw
    with pytest.raises(ValueError, match=match):
        Mamba2(**args)


def test_forward_matches_spec_float64():
    m = tiny()
    u = rand_x(2, 19)
    with torch.no_grad():
        out, _ = m(u)
        ref = spec_forward(m, u)
    assert rel_err(out, ref) < 1e-12 and out.abs().max() > 1e-3


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("prefill", [1, 2, 9])
def test_prefill_then_decode_equals_full_forward(dtype, tol, prefill):
    m = tiny(dtype)
    u = rand_x(2, 14, dtype=dtype)
    with torch.no_grad():
        full, _ = m(u)
        out, st = m(u[:, :prefill], use_cache=True)
        parts = [out]
        for t in range(prefill, 14):
            out, st = m(u[:, t:t + 1], state=st, use_cache=True)
            parts.append(out)
    assert rel_err(torch.cat(parts, 1), full) < tol
    assert st.conv.shape == (2, 64, 3) and st.ssm.shape == (2, 4, 8, 8)


def test_chunked_continuation_and_empty_state():
    m = tiny()
    u = rand_x(1, 21)
    with torch.no_grad():
        full, st_full = m(u, use_cache=True)
        a, st = m(u[:, :10], state=m.empty_state(1), use_cache=True)
        b, st2 = m(u[:, 10:], state=st, use_cache=True)
    assert rel_err(torch.cat([a, b], 1), full) < 1e-12
    assert rel_err(st2.ssm, st_full.ssm) < 1e-12 and rel_err(st2.conv, st_full.conv) < 1e-14


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_left_padding_equals_unpadded_runs(dtype, tol):
    m = tiny(dtype)
    lens = [11, 6, 1]
    T = max(lens)
    seqs = [rand_x(1, n, dtype=dtype, seed=10 + i) for i, n in enumerate(lens)]
    batch = torch.cat([torch.cat([rand_x(1, T - n, dtype=dtype, seed=99) * 7, s], 1) for s, n in zip(seqs, lens)])
    mask = torch.tensor([[0] * (T - n) + [1] * n for n in lens])
    step = rand_x(3, 1, dtype=dtype, seed=5)
    with torch.no_grad():
        out, st = m(batch, attention_mask=mask, use_cache=True)
        nxt, _ = m(step, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1), state=st,
                   use_cache=True)
        for i, (s, n) in enumerate(zip(seqs, lens)):
            ref, st_i = m(s, use_cache=True)
            assert rel_err(out[i, T - n:], ref[0]) < tol
            assert out[i, :T - n].abs().max() == 0 if n < T else True
            assert rel_err(st.ssm[i], st_i.ssm[0]) < tol
            ref_next, _ = m(step[i:i + 1], state=st_i)
            assert rel_err(nxt[i], ref_next[0]) < tol


def test_backward_reaches_every_parameter():
    m = tiny(torch.float32)
    out, _ = m(rand_x(2, 12, dtype=torch.float32))
    out.square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bf16_runs_and_state_stays_fp32():
    m = tiny(torch.bfloat16)
    u = rand_x(1, 9, dtype=torch.bfloat16)
    with torch.no_grad():
        out, st = m(u, use_cache=True)
        ref, _ = tiny(torch.float32)(u.float())
    assert out.dtype == torch.bfloat16 and st.ssm.dtype == torch.float32 and rel_err(out, ref) < 3e-2


def test_bad_mask_raises():
    m = tiny()
    with pytest.raises(ValueError, match="attention_mask must be"):
        m(rand_x(2, 5), attention_mask=torch.ones(2, 3))


def test_qwen_14mla14m2_model_on_meta_matches_spec():
    """Every name/shape and the total count of the Qwen3-1.7B 14MLA14M2 layout from checkpoint-format.md tables."""
    from hylo_bench.config.hybrid import parse_layout
    from hylo_bench.config.hylo_config import HyLoConfig
    from hylo_bench.models.hybrid import HyLoForCausalLM

    mla_layers, linear_type = parse_layout("14MLA14M2", 28)
    assert mla_layers == list(range(0, 28, 2)) and linear_type == "mamba"
    V = 151936  # Qwen3 vocabulary
    base = {"model_type": "qwen3", "vocab_size": V, "hidden_size": 2048, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128}
    hybrid = {"hidden_size": 2048, "intermediate_size": 6144, "hidden_act": "silu", "n_layer": 28,
              "mla_layers": mla_layers, "rms_norm_eps": 1e-6, "num_attention_heads": 16, "num_key_value_heads": 8,
              "kv_lora_rank": 256, "q_lora_rank": 1344, "use_lora_layer_norm": False, "use_full_kv_head": False,
              "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 64, "qkv_rank_divisor": 8,
              "rope_theta": 1000000.0, "d_model": 2048, "d_inner": 2048, "d_xb": 1024,
              "ssm_cfg": {"expand": 1, "ngroups": 16, "d_state": 128, "repeat_kv_before_conv": False}}
    cfg = HyLoConfig.from_dicts(base, hybrid)  # no linear_type / gdn keys: rule 3 of sec. 3.2 gives Mamba-2
    assert cfg.linear_type == "mamba"
    with torch.device("meta"):
        model = HyLoForCausalLM(cfg)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {"model.embed_tokens.weight": (V, 2048), "model.norm.weight": (2048,), "lm_head.weight": (V, 2048)}
    mla = {"q_a_proj.weight": (1344, 2048), "q_b_proj.weight": (2048, 1344), "kv_a_proj_with_mqa.weight": (320, 2048),
           "kv_b_proj.weight": (1536, 256), "out_proj.weight": (2048, 2048), "q_norm.weight": (128,),
           "k_norm.weight": (128,)}
    for i in range(28):
        p = f"model.layers.{i}."
        expected |= {p + "input_layernorm.weight": (2048,), p + "post_attention_layernorm.weight": (2048,),
                     p + "mlp.gate_proj.weight": (6144, 2048), p + "mlp.up_proj.weight": (6144, 2048),
                     p + "mlp.down_proj.weight": (2048, 6144)}
        mixer = ("mla.", mla) if i % 2 == 0 else ("mamba.", QWEN_M2_SHAPES)
        expected |= {p + mixer[0] + k: s for k, s in mixer[1].items()}
    assert got == expected
    total = sum(math.prod(s) for s in expected.values())
    assert sum(p.numel() for p in model.parameters()) == total == 2_065_541_280
    assert round(total / 1e9, 1) == 2.1  # paper Table 7: Qwen 14MLA14M2 2.1B


def test_matches_transformers_mamba2_mixer_when_xb_is_full_width():
    """With d_xb = d_inner (no KV repeat) the Zebra-Llama layout is the standard Mamba-2 layout with
    ngroups = nheads and headdim = d_state: an independent torch implementation (transformers ``Mamba2Mixer``,
    its norm swapped for the per-head grouping of sec. 4.3 (e)) must give the same output."""
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    cfg = Mamba2Config(hidden_size=32, num_heads=4, head_dim=8, state_size=8, n_groups=4, expand=1, conv_kernel=4,
                       use_conv_bias=True, use_bias=False, chunk_size=8, layer_norm_epsilon=1e-5, num_hidden_layers=1)
    torch.manual_seed(3)
    hf = Mamba2Mixer(cfg, layer_idx=0).double().eval()
    ours = tiny(hidden_size=32, d_inner=32, d_xb=32, ngroups=4, d_state=8)
    assert set(ours.state_dict()) == set(hf.state_dict())
    hf.load_state_dict(ours.state_dict())
    hf.norm.forward = lambda y, gate: ours.norm(y, gate)  # grouped gated norm (mamba_ssm group_size = d_state)
    u = rand_x(2, 13, D=32)
    with torch.no_grad():  # transformers computes A = -exp(A_log.float()) in float32: ~2e-8, not 1e-15
        assert rel_err(ours(u)[0], hf(u)) < 1e-6


@pytest.mark.gpu
def test_layer_fla_backend_matches_torch_backend_bf16():
    pytest.importorskip("fla")
    m = tiny(torch.bfloat16, hidden_size=128, d_inner=256, d_xb=128, ngroups=4, d_state=64).cuda()
    u = rand_x(2, 300, D=128, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        m.backend = "torch"
        ref, st_ref = m(u, use_cache=True)
        m.backend = "fla"
        out, st = m(u, use_cache=True)
    assert rel_err(out, ref) < 1e-2 and rel_err(st.ssm, st_ref.ssm) < 1e-2
