"""Tests for hylo_bench.upcycle.init: SVD MLA init and GDN init from attention (checkpoint-format.md sec. 7)."""

from __future__ import annotations

import pytest
import torch

from hylo_bench.upcycle.init import gdn_init_from_attention, repeat_kv_rows, svd_init_mla


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _base_weights(n_h, n_kv, d_h, hidden, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_h * d_h, hidden, generator=gen, dtype=dtype)
    k = torch.randn(n_kv * d_h, hidden, generator=gen, dtype=dtype)
    v = torch.randn(n_kv * d_h, hidden, generator=gen, dtype=dtype)
    o = torch.randn(hidden, n_h * d_h, generator=gen, dtype=dtype)
    return q, k, v, o


def _mla(q, k, v, o, *, n_h, n_kv, d_h, r_q, r_kv, d_n, d_r, n_kvm, d_v=None, **kw):
    return svd_init_mla(
        q, k, v, o, num_heads=n_h, num_kv_heads=n_kv, head_dim=d_h, q_lora_rank=r_q, kv_lora_rank=r_kv,
        qk_nope_head_dim=d_n, qk_rope_head_dim=d_r, v_head_dim=d_h if d_v is None else d_v,
        num_mla_kv_heads=n_kvm, **kw,
    )


def _expand_heads(w, n_kv, d_h, n_rep):
    """Hand-written GQA expansion: output head h is input head h // n_rep."""
    return torch.cat([w[(h // n_rep) * d_h:(h // n_rep + 1) * d_h] for h in range(n_kv * n_rep)])


def _kv_target(k, v, *, n_kv, d_h, d_n, n_kvm):
    """Per MLA KV head j: [first d_N rows of (expanded) K head j ; all rows of V head j]."""
    g = n_kvm // n_kv
    k_rep, v_rep = _expand_heads(k, n_kv, d_h, g), _expand_heads(v, n_kv, d_h, g)
    blocks = []
    for j in range(n_kvm):
        blocks += [k_rep[j * d_h:j * d_h + d_n], v_rep[j * d_h:(j + 1) * d_h]]
    return torch.cat(blocks), torch.cat([k_rep, v_rep])


def test_repeat_kv_rows_matches_hand_expansion():
    w = torch.arange(3 * 2 * 5, dtype=torch.float64).reshape(3 * 2, 5)
    assert torch.equal(repeat_kv_rows(w, 3, 2, 4), _expand_heads(w, 3, 2, 4))


@pytest.mark.parametrize("d_n,d_r", [(6, 2), (4, 4)], ids=["dN6-dR2", "dN4-dR4"])
def test_q_full_rank_rebuilds_wq(d_n, d_r):
    n_h, n_kv, d_h, hidden = 4, 2, 8, 48
    q, k, v, o = _base_weights(n_h, n_kv, d_h, hidden)
    out = _mla(q, k, v, o, n_h=n_h, n_kv=n_kv, d_h=d_h, r_q=n_h * d_h, r_kv=8, d_n=d_n, d_r=d_r, n_kvm=n_kv)
    assert _rel_err(out["q_b_proj.weight"] @ out["q_a_proj.weight"], q) < 1e-10
    assert torch.equal(out["out_proj.weight"], o)


def test_q_select_keeps_first_nope_and_last_rope_rows():
    n_h, n_kv, d_h, hidden, d_n, d_r = 3, 1, 8, 40, 3, 2
    q, k, v, o = _base_weights(n_h, n_kv, d_h, hidden, seed=1)
    out = _mla(q, k, v, o, n_h=n_h, n_kv=n_kv, d_h=d_h, r_q=n_h * d_h, r_kv=4, d_n=d_n, d_r=d_r, n_kvm=n_kv)
    rows = [r for h in range(n_h) for r in [*range(h * d_h, h * d_h + d_n), *range((h + 1) * d_h - d_r, (h + 1) * d_h)]]
    assert out["q_b_proj.weight"].shape == (n_h * (d_n + d_r), n_h * d_h)
    assert _rel_err(out["q_b_proj.weight"] @ out["q_a_proj.weight"], q[rows]) < 1e-10


@pytest.mark.parametrize("n_kvm", [2, 4], ids=["g1", "g2"])
def test_kv_full_rank_rebuilds_stacked_nope_and_v(n_kvm):
    n_h, n_kv, d_h, hidden, d_n, d_r = 4, 2, 8, 48, 5, 3
    q, k, v, o = _base_weights(n_h, n_kv, d_h, hidden, seed=2)
    r_kv = min(2 * n_kvm * d_h, hidden)
    out = _mla(q, k, v, o, n_h=n_h, n_kv=n_kv, d_h=d_h, r_q=8, r_kv=r_kv, d_n=d_n, d_r=d_r, n_kvm=n_kvm)
    target, _ = _kv_target(k, v, n_kv=n_kv, d_h=d_h, d_n=d_n, n_kvm=n_kvm)
    kv_a = out["kv_a_proj_with_mqa.weight"]
    assert kv_a.shape == (r_kv + d_r, hidden)
    assert out["kv_b_proj.weight"].shape == (n_kvm * (d_n + d_h), r_kv)
    assert _rel_err(out["kv_b_proj.weight"] @ kv_a[:r_kv], target) < 1e-10


def test_q_truncation_error_equals_dropped_singular_values():
    n_h, n_kv, d_h, hidden, r_q = 4, 2, 8, 48, 10
    q, k, v, o = _base_weights(n_h, n_kv, d_h, hidden, seed=3)
    out = _mla(q, k, v, o, n_h=n_h, n_kv=n_kv, d_h=d_h, r_q=r_q, r_kv=8, d_n=4, d_r=4, n_kvm=n_kv)
    s = torch.linalg.svdvals(q)
    expected = s[r_q:].square().sum().sqrt()
    err = (out["q_b_proj.weight"] @ out["q_a_proj.weight"] - q).norm()
    assert abs(float(err / expected) - 1.0) < 1e-10


def test_kv_truncation_is_row_selection_of_best_rank_r_approximation():
    n_h, n_kv, d_h, hidden, d_n, n_kvm, r_kv = 4, 2, 8, 48, 5, 4, 12
    q, k, v, o = _base_weights(n_h, n_kv, d_h, hidden, seed=4)
    out = _mla(q, k, v, o, n_h=n_h, n_kv=n_kv, d_h=d_h, r_q=8, r_kv=r_kv, d_n=d_n, d_r=3, n_kvm=n_kvm)
    _, w_kv = _kv_target(k, v, n_kv=n_kv, d_h=d_h, d_n=d_n, n_kvm=n_kvm)
    u, s, vh = torch.linalg.svd(w_kv, full_matrices=False)
    approx = (u[:, :r_kv] * s[:r_kv]) @ vh[:r_kv]
    half = n_kvm * d_h
    rows = []
    for j in range(n_kvm):
        rows += [*range(j * d_h, j * d_h + d_n), *range(half + j * d_h, half + (j + 1) * d_h)]
    got = out["kv_b_proj.weight"] @ out["kv_a_proj_with_mqa.weight"][:r_kv]
    assert _rel_err(got, approx[rows]) < 1e-10


def test_rope_key_rows_are_head_averaged_last_key_rows():
    n_h, n_kv, d_h, hidden, d_r, r_kv = 4, 2, 8, 48, 3, 6
    q, k, v, o = _base_weights(n_h, n_kv, d_h, hidden, seed=5)
    out = _mla(q, k, v, o, n_h=n_h, n_kv=n_kv, d_h=d_h, r_q=8, r_kv=r_kv, d_n=5, d_r=d_r, n_kvm=n_kv)
    expected = sum(k[j * d_h + d_h - d_r:(j + 1) * d_h] for j in range(n_kv)) / n_kv
    assert _rel_err(out["kv_a_proj_with_mqa.weight"][r_kv:], expected) < 1e-14


# (name, H, n_h, d_h, n_kv, r_q, r_kv, d_R, d_N, d_V) and checkpoint-format.md sec. 4.2 shapes.
_RELEASED = {
    "llama-3.2-1b": (
        (2048, 32, 64, 8, 1344, 128, 32, 32, 64),
        {"q_a_proj.weight": (1344, 2048), "q_b_proj.weight": (2048, 1344),
         "kv_a_proj_with_mqa.weight": (160, 2048), "kv_b_proj.weight": (768, 128),
         "out_proj.weight": (2048, 2048)},
    ),
    "qwen3-1.7b": (
        (2048, 16, 128, 8, 1344, 256, 64, 64, 128),
        {"q_a_proj.weight": (1344, 2048), "q_b_proj.weight": (2048, 1344),
         "kv_a_proj_with_mqa.weight": (320, 2048), "kv_b_proj.weight": (1536, 256),
         "out_proj.weight": (2048, 2048), "q_norm.weight": (128,), "k_norm.weight": (128,)},
    ),
}


@pytest.mark.parametrize("name", list(_RELEASED))
def test_released_layout_shapes(name):
    (hidden, n_h, d_h, n_kv, r_q, r_kv, d_r, d_n, d_v), expected = _RELEASED[name]

    def meta(*shape):  # the meta device runs the SVD shape logic without the 2048 x 2048 cost
        return torch.empty(*shape, device="meta", dtype=torch.bfloat16)

    norms = {"q_norm_w": meta(d_h), "k_norm_w": meta(d_h)} if "q_norm.weight" in expected else {}
    out = _mla(meta(n_h * d_h, hidden), meta(n_kv * d_h, hidden), meta(n_kv * d_h, hidden), meta(hidden, n_h * d_h),
               n_h=n_h, n_kv=n_kv, d_h=d_h, r_q=r_q, r_kv=r_kv, d_n=d_n, d_r=d_r, n_kvm=8, d_v=d_v, **norms)
    assert {key: tuple(t.shape) for key, t in out.items()} == expected
    assert all(t.dtype == torch.bfloat16 for t in out.values())


def test_low_precision_input_is_cast_back_and_close():
    n_h, n_kv, d_h, hidden = 4, 2, 8, 48
    q, k, v, o = (w.to(torch.bfloat16) for w in _base_weights(n_h, n_kv, d_h, hidden, seed=6))
    qn, kn = torch.rand(d_h, dtype=torch.bfloat16), torch.rand(d_h, dtype=torch.bfloat16)
    out = _mla(q, k, v, o, n_h=n_h, n_kv=n_kv, d_h=d_h, r_q=n_h * d_h, r_kv=8, d_n=4, d_r=4, n_kvm=n_kv,
               q_norm_w=qn, k_norm_w=kn)
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    assert torch.equal(out["q_norm.weight"], qn) and torch.equal(out["k_norm.weight"], kn)
    rebuilt = out["q_b_proj.weight"].double() @ out["q_a_proj.weight"].double()
    assert _rel_err(rebuilt, q.double()) < 2e-2


@pytest.mark.parametrize(
    "override,match",
    [
        ({"d_v": 4}, "v_head_dim"),
        ({"r_q": 33}, "q_lora_rank"),
        ({"r_kv": 49}, "kv_lora_rank"),
        ({"d_n": 6, "d_r": 4}, "qk_nope_head_dim"),
        ({"n_kvm": 3}, "num_mla_kv_heads"),
    ],
    ids=["dV-ne-dh", "rq-too-large", "rkv-too-large", "dqk-too-large", "nkvm-not-multiple"],
)
def test_mla_value_errors(override, match):
    n_h, n_kv, d_h, hidden = 4, 2, 8, 48
    q, k, v, o = _base_weights(n_h, n_kv, d_h, hidden)
    args = {"n_h": n_h, "n_kv": n_kv, "d_h": d_h, "r_q": 8, "r_kv": 8, "d_n": 4, "d_r": 4, "n_kvm": n_kv}
    with pytest.raises(ValueError, match=match):
        _mla(q, k, v, o, **{**args, **override})


def _gdn_params(d_k, d_v, hidden, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return {
        "q_proj.weight": torch.randn(d_k, hidden, generator=gen),
        "k_proj.weight": torch.randn(d_k, hidden, generator=gen),
        "v_proj.weight": torch.randn(d_v, hidden, generator=gen),
        "g_proj.weight": torch.randn(d_v, hidden, generator=gen),
        "a_proj.weight": torch.randn(2, hidden, generator=gen),
        "b_proj.weight": torch.randn(2, hidden, generator=gen),
        "A_log": torch.rand(2, generator=gen),
        "dt_bias": torch.rand(2, generator=gen),
        "q_conv1d.weight": torch.randn(d_k, 1, 4, generator=gen),
        "k_conv1d.weight": torch.randn(d_k, 1, 4, generator=gen),
        "v_conv1d.weight": torch.randn(d_v, 1, 4, generator=gen),
        "o_norm.weight": torch.ones(d_v // 2),
        "o_proj.weight": torch.randn(hidden, d_v, generator=gen),
    }


@pytest.mark.parametrize("d_k", [12, 24], ids=["dk-lt-nh_dh", "dk-gt-nh_dh"])
def test_gdn_init_copies_overlap_and_leaves_rest(d_k):
    n_h, n_kv, d_h, hidden, d_v = 4, 2, 4, 16, 24  # n_h * d_h = 16 = H; GQA g = 2
    q, k, v, o = _base_weights(n_h, n_kv, d_h, hidden, dtype=torch.float32, seed=8)
    fresh = _gdn_params(d_k, d_v, hidden)
    before = {key: t.clone() for key, t in fresh.items()}
    out = gdn_init_from_attention(q, k, v, o, fresh, num_heads=n_h, num_kv_heads=n_kv, head_dim=d_h)

    a = min(d_k, n_h * d_h)
    # Hand-indexed GQA expansion: K~ rows of query head h come from KV head h // 2.
    k_exp = torch.cat([k[0:4], k[0:4], k[4:8], k[4:8]])
    v_exp = torch.cat([v[0:4], v[0:4], v[4:8], v[4:8]])
    assert torch.equal(out["q_proj.weight"][:a], q[:a])
    assert torch.equal(out["k_proj.weight"][:a], k_exp[:a])
    assert torch.equal(out["v_proj.weight"][:16], v_exp)
    assert torch.equal(out["o_proj.weight"][:, :16], o)
    assert torch.equal(out["q_proj.weight"][a:], before["q_proj.weight"][a:])
    assert torch.equal(out["k_proj.weight"][a:], before["k_proj.weight"][a:])
    assert torch.equal(out["v_proj.weight"][16:], before["v_proj.weight"][16:])
    assert torch.equal(out["o_proj.weight"][:, 16:], before["o_proj.weight"][:, 16:])
    for key in fresh:
        assert torch.equal(fresh[key], before[key]), f"input {key} was modified"
        if key not in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"):
            assert torch.equal(out[key], before[key]) and out[key].data_ptr() != fresh[key].data_ptr()
    assert out.keys() == fresh.keys()


def test_gdn_init_casts_to_gdn_dtype_and_checks_keys():
    n_h, n_kv, d_h, hidden = 4, 4, 4, 16
    q, k, v, o = _base_weights(n_h, n_kv, d_h, hidden, dtype=torch.float64, seed=9)
    fresh = {key: t.to(torch.bfloat16) for key, t in _gdn_params(12, 24, hidden).items()}
    out = gdn_init_from_attention(q, k, v, o, fresh, num_heads=n_h, num_kv_heads=n_kv, head_dim=d_h)
    assert all(t.dtype == torch.bfloat16 for t in out.values())
    assert torch.equal(out["k_proj.weight"][:12], k[:12].to(torch.bfloat16))
    del fresh["o_proj.weight"]
    with pytest.raises(ValueError, match="o_proj.weight"):
        gdn_init_from_attention(q, k, v, o, fresh, num_heads=n_h, num_kv_heads=n_kv, head_dim=d_h)
