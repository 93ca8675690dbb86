"""Issue 19, model side: the same numbers and files as the references (transformers' YaRN / DeepseekV3 rules,
Zebra-Llama's latent norms, mamba_ssm's Mamba-2 options, tied exports, the released hybrid_config.json schema,
legacy per-layer ranks). Every expected value comes from the reference library or a hand formula."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hylo_bench.config.hylo_config import HyLoConfig
from hylo_bench.info import rope_info
from hylo_bench.kernels.ssd import ssd_scan_reference
from hylo_bench.models.checkpoint import save_hylo
from hylo_bench.models.hybrid import HyLoForCausalLM, load_hylo
from hylo_bench.models.mamba2 import GatedRMSNormGroups
from hylo_bench.models.rope import MLARotary
from tests.conftest import tiny_hybrid_config
from tests.models.test_mamba2 import rand_x, tiny

DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                 "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}


def _hf_deepseek(rope_scaling: dict, qk_nope: int = 8, qk_rope: int = 8):
    """transformers' own DeepseekV3 attention and YaRN parameters for the same MLA dims (reference values)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cfg = DeepseekV3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                           qk_nope_head_dim=qk_nope, qk_rope_head_dim=qk_rope, v_head_dim=16, head_dim=qk_rope,
                           max_position_embeddings=163840, rope_theta=10000.0, rope_scaling=dict(rope_scaling),
                           n_routed_experts=1, num_experts_per_tok=1, first_k_dense_replace=1)
    attn = DeepseekV3Attention(cfg, layer_idx=0)
    inv_freq, attention_factor = _compute_yarn_parameters(cfg)
    return attn.scaling, inv_freq, attention_factor


# ---- item 1: YaRN mscale_all_dim, attention_factor, info ------------------------------------------------------

def test_mscale_all_dim_softmax_scale_and_rotary_equal_transformers_deepseek_v3():
    cfg = tiny_hybrid_config(rope_scaling=DEEPSEEK_YARN, max_position_embeddings=163840)
    model = HyLoForCausalLM(cfg)
    mla = model.model.layers[1].mla
    hf_scaling, hf_inv_freq, hf_factor = _hf_deepseek(DEEPSEEK_YARN)
    # hand formula: d_qk^-0.5 * (0.1 * 0.707 * ln 40 + 1)^2
    m = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert mla.scale == pytest.approx(16 ** -0.5 * m * m, rel=1e-12)
    assert mla.scale == pytest.approx(hf_scaling, rel=1e-12)
    assert mla.rotary.mscale == pytest.approx(hf_factor, rel=1e-12) and mla.rotary.mscale == pytest.approx(1.0)
    assert torch.allclose(mla.rotary.inv_freq, hf_inv_freq.float(), rtol=1e-6)


def test_mscale_all_dim_model_equals_q_scaled_by_mscale_squared():
    """The softmax multiplier m^2 on both q parts equals scaling q_b_proj by m^2 in a model without it (RoPE is
    linear in q_pe); cos/sin stay at attention factor 1 in both."""
    torch.manual_seed(0)
    a = HyLoForCausalLM(tiny_hybrid_config(rope_scaling=DEEPSEEK_YARN)).eval().double()
    with torch.no_grad():  # large enough weights that the attention pattern matters
        for p in a.parameters():
            if p.dim() == 2:
                p.mul_(4)
    plain = {k: v for k, v in DEEPSEEK_YARN.items() if k not in ("mscale", "mscale_all_dim")}
    b, c = (HyLoForCausalLM(tiny_hybrid_config(rope_scaling={**plain, "attention_factor": 1.0})).eval().double()
            for _ in range(2))
    b.load_state_dict(a.state_dict())
    c.load_state_dict(a.state_dict())
    m = 0.1 * 0.707 * math.log(40.0) + 1.0
    with torch.no_grad():
        for i in (1, 3):
            b.model.layers[i].mla.q_b_proj.weight.mul_(m * m)
        x = torch.randint(0, 97, (2, 11))
        la, lb, lc = a(x).logits, b(x).logits, c(x).logits
    assert torch.allclose(la, lb, atol=1e-5, rtol=1e-5)  # the rope rotation runs in fp32
    assert (la - lc).abs().max() > 1e-2  # the factor matters: without it the logits differ


def test_attention_factor_is_honoured_as_transformers_does():
    rs = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048, "attention_factor": 1.0}
    _, hf_inv_freq, hf_factor = _hf_deepseek(rs)
    rot = MLARotary(8, 10000.0, rs)
    assert hf_factor == 1.0 and rot.mscale == 1.0  # was 0.1 ln 32 + 1 = 1.3466
    assert torch.allclose(rot.inv_freq, hf_inv_freq.float(), rtol=1e-6)
    # released configs (no mscale keys): transformers' get_mscale(F) = 0.1 ln F + 1
    released = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 2048}
    assert MLARotary(8, 10000.0, released).mscale == pytest.approx(_hf_deepseek(released)[2], rel=1e-12)


def test_info_prints_the_factors_the_model_applies():
    d = rope_info(tiny_hybrid_config(rope_scaling=DEEPSEEK_YARN))
    m = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert d["yarn_mscale"] == 1.0 and d["softmax_mscale2"] == round(m * m, 4)
    d = rope_info(tiny_hybrid_config(rope_scaling={"rope_type": "yarn", "factor": 32.0, "attention_factor": 1.0,
                                                   "original_max_position_embeddings": 2048}))
    assert d["yarn_mscale"] == 1.0 and d["softmax_mscale2"] == 1.0
    d = rope_info(tiny_hybrid_config(rope_scaling={"rope_type": "yarn", "factor": 32.0,
                                                   "original_max_position_embeddings": 2048}))
    assert d["yarn_mscale"] == round(0.1 * math.log(32) + 1, 4) == 1.3466 and d["softmax_mscale2"] == 1.0


def test_mscale_settings_the_references_disagree_on_are_refused():
    # only mscale set: transformers ignores it (0.1 ln F + 1), Zebra-Llama uses 0.1 * 0.707 * ln F + 1
    with pytest.raises(ValueError, match="rope_scaling.*set both keys"):
        tiny_hybrid_config(rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 0.707})
    with pytest.raises(ValueError, match="truncate"):
        tiny_hybrid_config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": False})
    tiny_hybrid_config(rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0})  # both give 0.1 ln F + 1


# ---- item 2: latent norm eps ---------------------------------------------------------------------------------

def test_latent_norms_use_zebra_llama_eps():
    model = HyLoForCausalLM(tiny_hybrid_config(use_lora_layer_norm=True, rms_norm_eps=1e-5))
    mla = model.model.layers[1].mla
    # Zebra-Llama: DeepseekV3RMSNorm(q_lora_rank) / (kv_lora_rank), default eps=1e-6
    assert mla.q_a_layernorm.variance_epsilon == 1e-6 and mla.kv_a_layernorm.variance_epsilon == 1e-6
    assert model.model.layers[1].input_layernorm.variance_epsilon == 1e-5


# ---- item 3: Mamba-2 ssm_cfg -----------------------------------------------------------------------------------

def _spec_forward(m, u, lo: float, hi: float, norm_before_gate: bool):
    """checkpoint-format.md sec. 4.5 in float64 with mamba_ssm's dt clamp and RMSNormGated order (rms_norm_ref)."""
    E, X, H, N = m.d_inner, m.d_xb, m.nheads, m.d_state
    Bsz, T, _ = u.shape
    zxbcdt = u @ m.in_proj.weight.T
    z, xBC, dt = zxbcdt[..., :E], zxbcdt[..., E:2 * E + 2 * X], zxbcdt[..., 2 * E + 2 * X:]
    W = m.conv1d.weight.shape[-1]
    xBC = F.silu(F.conv1d(F.pad(xBC.transpose(1, 2), (W - 1, 0)), m.conv1d.weight, m.conv1d.bias,
                          groups=xBC.shape[-1]).transpose(1, 2))
    x, Bm, C = xBC[..., :X], xBC[..., X:2 * X], xBC[..., 2 * X:]
    g = H // (X // N)
    x_h = x.unflatten(-1, (X // N, N)).repeat_interleave(g, 2)
    B_h = Bm.unflatten(-1, (X // N, N)).repeat_interleave(g, 2)
    dt = F.softplus(dt + m.dt_bias).clamp(lo, hi)
    y, _ = ssd_scan_reference(x_h, dt, -torch.exp(m.A_log), B_h, C.reshape(Bsz, T, H, N), D=m.D)
    y = y.reshape(Bsz, T, H, N)
    gate = F.silu(z).reshape(Bsz, T, H, N)
    if not norm_before_gate:
        y = y * gate
    y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * m.norm.weight.reshape(H, N)
    if norm_before_gate:
        y = y * gate
    return y.reshape(Bsz, T, E) @ m.out_proj.weight.T


@pytest.mark.parametrize("norm_before_gate, dt_limit", [(True, (0.0, math.inf)), (False, (0.05, 0.3)),
                                                        (True, (0.02, 0.5))])
def test_mamba2_norm_before_gate_and_dt_limit_match_mamba_ssm_semantics(norm_before_gate, dt_limit):
    m = tiny(norm_before_gate=norm_before_gate, dt_limit=dt_limit)
    u = rand_x(2, 13)
    with torch.no_grad():
        ref = _spec_forward(m, u, *dt_limit, norm_before_gate)
        out, _ = m(u)
        # prefill + token-by-token decode applies the same clamp and norm order
        first, state = m(u[:, :6], use_cache=True)
        steps = [first]
        for t in range(6, 13):
            o, state = m(u[:, t:t + 1], state=state, use_cache=True)
            steps.append(o)
    assert torch.allclose(out, ref, atol=1e-10, rtol=1e-9)
    assert torch.allclose(torch.cat(steps, 1), ref, atol=1e-10, rtol=1e-9)


def test_gated_norm_before_gate_formula():
    y, z = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    n = GatedRMSNormGroups(8, group_size=4, norm_before_gate=True).double()
    with torch.no_grad():
        n.weight.uniform_(0.5, 1.5)
    yg = y.reshape(3, 2, 4)
    want = (yg / torch.sqrt(yg.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(3, 8) * n.weight * F.silu(z)
    assert torch.allclose(n(y, z), want, atol=1e-14)


def test_ssm_cfg_is_honoured_from_hybrid_config_and_written_back(tmp_path):
    cfg = tiny_hybrid_config(linear_type="mamba", ssm_cfg={"norm_before_gate": True, "dt_limit": [0.01, 0.2]})
    model = HyLoForCausalLM(cfg).eval()
    mamba = model.model.layers[0].mamba
    assert mamba.norm.norm_before_gate is True and mamba.dt_limit == (0.01, 0.2)
    save_hylo(model, tmp_path)
    written = json.loads((tmp_path / "hybrid_config.json").read_text())["ssm_cfg"]
    assert written["norm_before_gate"] is True and written["dt_limit"] == [0.01, 0.2]
    loaded = load_hylo(tmp_path, dtype=None)
    assert loaded.model.layers[2].mamba.norm.norm_before_gate is True
    assert loaded.model.layers[2].mamba.dt_limit == (0.01, 0.2)


@pytest.mark.parametrize("ssm_cfg, match", [
    ({"D_has_hdim": True}, "D_has_hdim"), ({"rmsnorm": False}, "rmsnorm"), ({"bias": True}, "bias"),
    ({"conv_bias": False}, "conv_bias"), ({"d_ssm": 32}, "d_ssm"), ({"dt_limit": [0.5, 0.1]}, "dt_limit"),
    ({"norm_before_gat": True}, "unknown key"), ({"norm_before_gate": "yes"}, "norm_before_gate"),
])
def test_ssm_cfg_options_without_an_implementation_are_refused(ssm_cfg, match):
    with pytest.raises(ValueError, match=match):
        tiny_hybrid_config(linear_type="mamba", ssm_cfg=ssm_cfg)


# ---- item 4: tied exports save ---------------------------------------------------------------------------------

def test_tied_export_loads_saves_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config()).eval()
    save_hylo(model, tmp_path / "a")
    sd = load_file(tmp_path / "a" / "model.safetensors")
    emb = sd["model.embed_tokens.weight"].clone()
    del sd["lm_head.weight"]  # what AMD's trainer writes for a tied model
    save_file(sd, tmp_path / "a" / "model.safetensors")
    tied = load_hylo(tmp_path / "a", dtype=None)
    assert torch.equal(tied.lm_head.weight, emb)
    tied.save_pretrained(tmp_path / "b")  # used to fail: "Some tensors share memory"
    back = load_file(tmp_path / "b" / "model.safetensors")
    assert torch.equal(back["lm_head.weight"], emb) and torch.equal(back["model.embed_tokens.weight"], emb)
    x = torch.randint(0, 97, (1, 7))
    with torch.no_grad():
        assert torch.equal(load_hylo(tmp_path / "b", dtype=None)(x).logits, tied(x).logits)


def test_head_tied_by_hand_is_saved_as_two_tensors(tmp_path):
    model = HyLoForCausalLM(tiny_hybrid_config())
    model.lm_head.weight = model.model.embed_tokens.weight
    save_hylo(model, tmp_path)
    back = load_file(tmp_path / "model.safetensors")
    assert torch.equal(back["lm_head.weight"], back["model.embed_tokens.weight"])


# ---- item 5: the released hybrid_config.json schema --------------------------------------------------------------

# The fields of Zebra-Llama's HybridConfig dataclass, in order, and its defaults (checkpoint-format.md sec. 3.1 table;
# AMD-AGI/AMD-Hybrid-Models Zebra-Llama/hybrid/hybrid_config.py): what its HybridConfig(**json) accepts.
_ZEBRA_FIELDS = [
    ("hidden_size", 4096), ("intermediate_size", 18432), ("hidden_act", "silu"), ("n_layer", 32),
    ("mla_layers", dataclasses.field(default_factory=list)), ("rms_norm_eps", 1e-5), ("num_attention_heads", 32),
    ("num_key_value_heads", 8), ("kv_lora_rank", 128), ("q_lora_rank", 1536), ("use_lora_layer_norm", False),
    ("use_full_kv_head", False), ("qk_rope_head_dim", 64), ("v_head_dim", 128), ("qk_nope_head_dim", 128),
    ("qkv_rank_divisor", 8), ("max_position_embeddings", 4096), ("rope_theta", 10000.0), ("rope_scaling", None),
    ("attention_bias", False), ("attention_dropout", 0.0), ("rope_type", "yarn"), ("d_model", 2560),
    ("ssm_cfg", dataclasses.field(default_factory=dict)), ("d_inner", None), ("d_xb", 2560),
]


def _zebra_hybrid_config_class():
    """A stand-in with the reference dataclass's fields and its post-init checks (sec. 3.1 'Post-init checks')."""
    def post_init(self):
        assert self.qkv_rank_divisor % 8 == 0
        assert self.kv_lora_rank % self.qkv_rank_divisor == 0 and self.q_lora_rank % self.qkv_rank_divisor == 0
        assert self.num_attention_heads % self.num_key_value_heads == 0

    return dataclasses.make_dataclass("HybridConfig", [(n, object, d) if isinstance(d, dataclasses.Field) else
                                                       (n, object, dataclasses.field(default=d))
                                                       for n, d in _ZEBRA_FIELDS],
                                      namespace={"__post_init__": post_init})


def test_mamba2_hybrid_config_is_exactly_the_zebra_llama_schema(tmp_path):
    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config(linear_type="mamba", use_qk_norm=True)).eval()
    save_hylo(model, tmp_path)
    written = json.loads((tmp_path / "hybrid_config.json").read_text())
    assert list(written) == [n for n, _ in _ZEBRA_FIELDS]
    ref = _zebra_hybrid_config_class()(**written)  # the reference loader accepts it (it raised on linear_type)
    assert dataclasses.asdict(ref) == written and written["rope_type"] == "yarn"
    extras = json.loads((tmp_path / "config.json").read_text())["hylo_bench"]
    assert extras == {"linear_type": "mamba", "use_qk_norm": True}
    loaded = load_hylo(tmp_path, dtype=None)  # and we read our facts back from config.json
    assert loaded.config.linear_type == "mamba" and loaded.config.use_qk_norm is True
    x = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_gdn_hybrid_config_adds_only_the_model_card_keys(tmp_path):
    model = HyLoForCausalLM(tiny_hybrid_config(gdn_norm_eps=1e-6))
    save_hylo(model, tmp_path)
    written = json.loads((tmp_path / "hybrid_config.json").read_text())
    assert list(written) == [n for n, _ in _ZEBRA_FIELDS] + ["gdn_num_heads", "gdn_head_dim"]
    extras = json.loads((tmp_path / "config.json").read_text())["hylo_bench"]
    assert extras == {"linear_type": "gdn", "use_qk_norm": False, "gdn_expand_v": 2, "gdn_conv_size": 4,
                      "gdn_norm_eps": 1e-6}
    assert load_hylo(tmp_path, dtype=None).config.gdn_norm_eps == 1e-6


def test_our_older_files_with_extra_keys_in_hybrid_config_still_load(tmp_path):
    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config(linear_type="mamba")).eval()
    save_hylo(model, tmp_path)
    hybrid = json.loads((tmp_path / "hybrid_config.json").read_text())
    hybrid.pop("rope_type")
    hybrid.update(linear_type="mamba", use_qk_norm=False)  # what hylo-bench wrote before
    (tmp_path / "hybrid_config.json").write_text(json.dumps(hybrid))
    base = json.loads((tmp_path / "config.json").read_text())
    base.pop("hylo_bench")
    (tmp_path / "config.json").write_text(json.dumps(base))
    loaded = load_hylo(tmp_path, dtype=None)
    assert loaded.config.mixer_types == model.config.mixer_types
    x = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


def test_a_released_style_file_without_our_keys_uses_the_spec_rules():
    base = {"model_type": "qwen3", "vocab_size": 97, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_size": 64}
    hybrid = {k: v for k, v in tiny_hybrid_config().to_hybrid_dict().items()}
    cfg = HyLoConfig.from_dicts(base, hybrid)
    assert cfg.linear_type == "gdn" and cfg.use_qk_norm is True  # sec. 3.2 rules: gdn_num_heads, qwen3
    hybrid = {k: v for k, v in hybrid.items() if k not in ("gdn_num_heads", "gdn_head_dim")}
    assert HyLoConfig.from_dicts({**base, "model_type": "llama"}, hybrid).linear_type == "mamba"


# ---- item 6: legacy layer_rank_list ------------------------------------------------------------------------------

def test_legacy_layer_rank_list_is_honoured(tmp_path):
    ranks = {"1": {"q_rank": 40, "kv_rank": 24}, "3": {"q_rank": 16, "kv_rank": 8}}
    cfg = tiny_hybrid_config(layer_rank_list=ranks)
    model = HyLoForCausalLM(cfg).eval()
    sd = model.state_dict()
    assert tuple(sd["model.layers.1.mla.q_a_proj.weight"].shape) == (40, 64)
    assert tuple(sd["model.layers.1.mla.kv_a_proj_with_mqa.weight"].shape) == (24 + 8, 64)
    assert tuple(sd["model.layers.3.mla.kv_b_proj.weight"].shape) == (2 * (8 + 16), 8)
    save_hylo(model, tmp_path)
    hybrid = json.loads((tmp_path / "hybrid_config.json").read_text())
    assert hybrid["layer_rank_list"] == ranks
    loaded = load_hylo(tmp_path, dtype=None)  # used to drop the list and fail on the shapes
    x = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    from hylo_bench.models.memory import kv_cache_bytes_per_token

    assert kv_cache_bytes_per_token(cfg, 2) == ((24 + 8) + (8 + 8)) * 2


def test_layer_rank_list_carries_over_like_zebra_llama_and_folds_when_uniform():
    # Zebra-Llama writes each entry into the shared config as it builds layers 0, 1, ...: layer 3 without an entry
    # keeps layer 1's ranks; all MLA layers then have (40, 24), so the top-level ranks become those.
    cfg = tiny_hybrid_config(layer_rank_list={"1": {"q_rank": 40, "kv_rank": 24}})
    assert cfg.mla_ranks(3) == (40, 24) and (cfg.q_lora_rank, cfg.kv_lora_rank) == (40, 24)
    assert "layer_rank_list" not in cfg.to_hybrid_dict()
    with pytest.raises(ValueError, match="not an MLA layer"):
        tiny_hybrid_config(layer_rank_list={"0": {"q_rank": 40, "kv_rank": 24}})
    with pytest.raises(ValueError, match="q_rank"):
        tiny_hybrid_config(layer_rank_list={"1": {"q_rank": 40}})
    legacy = tiny_hybrid_config().to_hybrid_dict() | {"layer_rank_list": [], "use_fixed_rank_for_first_and_last_block":
                                                      True}
    assert HyLoConfig.from_dicts({"vocab_size": 97}, legacy).kv_lora_rank == 32


# ---- item 18: decoding after a right-padded cached prefill is refused -------------------------------------------

@pytest.mark.parametrize("linear_type", ["gdn", "mamba"])
def test_right_padded_cached_prefill_is_refused(linear_type):
    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config(linear_type=linear_type)).eval()
    ids = torch.randint(3, 97, (2, 8))
    right = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    with torch.no_grad(), pytest.raises(ValueError, match="right .*padding.*Pad on the left"):
        model(ids, attention_mask=right, use_cache=True)
    with torch.no_grad(), pytest.raises(ValueError, match="right .*padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=2, do_sample=False)
    with torch.no_grad():  # scoring a right-padded batch without a cache stays allowed and exact
        full = model(ids, attention_mask=right).logits
        alone = model(ids[1:, :5]).logits
    assert torch.allclose(full[1, :5], alone[0], atol=1e-5)
    # left padding decodes as the unpadded row does
    left_ids = torch.cat([torch.full((1, 3), 2), ids[1:, :5]], 1)
    left = torch.tensor([[0] * 3 + [1] * 5])
    with torch.no_grad():
        a = model.generate(left_ids, attention_mask=left, max_new_tokens=4, do_sample=False)[:, 8:]
        b = model.generate(ids[1:, :5], max_new_tokens=4, do_sample=False)[:, 5:]
    assert a.tolist() == b.tolist()
