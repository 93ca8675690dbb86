"""Mamba-2 init from attention (checkpoint-format.md sec. 7.3): exact row mapping, untouched rest, init_student."""

from __future__ import annotations

import pytest
import torch

from hylo_bench.models.mamba2 import Mamba2
from hylo_bench.upcycle.init import mamba2_init_from_attention
from tests.conftest import make_base


def _base(n_h=4, n_kv=2, d_h=8, hidden=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return r(n_h * d_h, hidden), r(n_kv * d_h, hidden), r(n_kv * d_h, hidden), r(hidden, n_h * d_h)


def test_rows_map_v_to_x_k_to_b_q_to_c_o_to_out_and_rest_untouched():
    q, k, v, o = _base()
    torch.manual_seed(1)
    fresh = Mamba2(hidden_size=24, d_inner=32, d_xb=16, ngroups=4, d_state=8).state_dict()
    before = {key: t.clone() for key, t in fresh.items()}
    out = mamba2_init_from_attention(q, k, v, o, fresh, d_inner=32, d_xb=16)
    w = out["in_proj.weight"]
    # rows [z: 0-32 | x: 32-48 | B: 48-64 | C: 64-96 | dt: 96-100] (sec. 4.5)
    assert w.shape == (100, 24)
    assert torch.equal(w[32:48], v) and torch.equal(w[48:64], k) and torch.equal(w[64:96], q)
    assert torch.equal(out["out_proj.weight"], o)
    assert torch.equal(w[:32], before["in_proj.weight"][:32]) and torch.equal(w[96:], before["in_proj.weight"][96:])
    for key in ("conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"):
        assert torch.equal(out[key], before[key]), key
    assert all(torch.equal(fresh[key], before[key]) for key in fresh), "input was modified"


def test_casts_to_mixer_dtype_and_checks_shapes():
    q, k, v, o = _base(dtype=torch.float64)
    fresh = {key: t.to(torch.bfloat16) for key, t in
             Mamba2(hidden_size=24, d_inner=32, d_xb=16, ngroups=4, d_state=8).state_dict().items()}
    out = mamba2_init_from_attention(q, k, v, o, fresh, d_inner=32, d_xb=16)
    assert out["in_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(out["in_proj.weight"][48:64], k.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"k_w: expected shape \[32, 24\]"):
        mamba2_init_from_attention(q, k, v, o, fresh, d_inner=32, d_xb=32)
    with pytest.raises(ValueError, match="missing"):
        mamba2_init_from_attention(q, k, v, o, {"in_proj.weight": fresh["in_proj.weight"]}, d_inner=32, d_xb=16)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_init_student_uses_mapping_for_mamba_layers(kind):
    from hylo_bench.config.student import hybrid_config_for
    from hylo_bench.upcycle.transfer import init_student

    base = make_base(kind, vocab_size=97)
    cfg = hybrid_config_for(base.config, [1, 3], "mamba")
    assert cfg.mixer_types == ["mamba", "mla", "mamba", "mla"]
    assert cfg.mamba_dims() == dict(hidden_size=64, d_inner=64, d_xb=32, ngroups=4, d_state=16, d_conv=4)
    torch.manual_seed(0)
    student = init_student(base, cfg)
    for i in (0, 2):
        att, mx = base.model.layers[i].self_attn, student.model.layers[i].mamba
        w = mx.in_proj.weight
        assert torch.equal(w[64:96], att.v_proj.weight) and torch.equal(w[96:128], att.k_proj.weight)
        assert torch.equal(w[128:192], att.q_proj.weight) and torch.equal(mx.out_proj.weight, att.o_proj.weight)
        assert torch.equal(mx.D, torch.ones(4)) and torch.equal(mx.norm.weight, torch.ones(64))
        assert torch.equal(student.model.layers[i].mlp.up_proj.weight, base.model.layers[i].mlp.up_proj.weight)
    x = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert torch.isfinite(student(x).logits).all()


def test_layout_m2_resolves_to_mamba():
    from hylo_bench.config.upcycle import UpcycleConfig
    from hylo_bench.upcycle.run import resolve_layout

    cfg = UpcycleConfig(out="/tmp/unused", layout="2MLA2M2")
    assert resolve_layout(cfg, 4) == ([1, 3], "mamba")
