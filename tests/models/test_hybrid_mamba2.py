"""HyLoForCausalLM with MLA + Mamba-2 layers: cache, generate, left padding, save/load, Zebra-Llama-format loading."""

from __future__ import annotations

import json

import pytest
import torch

from hylo_bench.models.checkpoint import CheckpointMismatchError, save_hylo
from hylo_bench.models.hybrid import HyLoForCausalLM, load_hylo
from hylo_bench.models.mamba2 import Mamba2State
from tests.conftest import tiny_hybrid_config


def m2_config(**kw):
    return tiny_hybrid_config(linear_type="mamba", **kw)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = HyLoForCausalLM(m2_config()).eval().double()
    with torch.no_grad():  # stronger SSM so the recurrent path dominates the tiny model's logits
        for layer in (m.model.layers[0], m.model.layers[2]):
            layer.mamba.in_proj.weight.mul_(5)
            layer.mamba.D.uniform_(-1, 1)
    return m


def test_layer_plan_and_names(model):
    assert model.config.mixer_types == ["mamba", "mla", "mamba", "mla"]
    sd = model.state_dict()
    # tiny dims: H 64, n_h 4, n_kv 2, d_h 16 -> d_inner 64, d_xb 32, 4 heads of 16 (sec. 4.5 relations)
    assert tuple(sd["model.layers.0.mamba.in_proj.weight"].shape) == (2 * 64 + 2 * 32 + 4, 64)
    assert tuple(sd["model.layers.2.mamba.conv1d.weight"].shape) == (64 + 2 * 32, 1, 4)
    assert tuple(sd["model.layers.2.mamba.conv1d.bias"].shape) == (128,)
    assert not any(".gdn." in k for k in sd)


def test_cache_prefill_decode_equals_full_forward(model):
    x = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        full = model(x).logits
        out = model(x[:, :7], use_cache=True)
        cache, parts = out.past_key_values, [out.logits]
        for t in range(7, 13):
            out = model(x[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            parts.append(out.logits)
    assert torch.allclose(full, torch.cat(parts, 1), atol=1e-10, rtol=0)
    states = [s for s in cache.layers_state if isinstance(s, Mamba2State)]
    assert len(states) == 2 and all(s.ssm.shape == (2, 4, 16, 16) and s.conv.shape == (2, 128, 3) for s in states)
    assert cache.memory_bytes()["linear_state"] == 2 * (2 * 4 * 16 * 16 * 8 + 2 * 128 * 3 * 8)


def test_generate_with_cache_equals_greedy_recompute(model):
    x = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        g = model.generate(x, max_new_tokens=8, do_sample=False)
        y = x
        for _ in range(8):
            y = torch.cat([y, model(y).logits[:, -1:].argmax(-1)], 1)
    assert g.tolist() == y.tolist()


def test_left_padded_batch_equals_one_by_one(model):
    lens = [9, 4, 6]
    T = max(lens)
    seqs = [torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lens)]
    batch = torch.cat([torch.cat([torch.full((1, T - n), 2), s], 1) for s, n in zip(seqs, lens)])
    mask = torch.tensor([[0] * (T - n) + [1] * n for n in lens])
    with torch.no_grad():
        logits = model(batch, attention_mask=mask).logits
        gen = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2)[:, T:]
        for i, (s, n) in enumerate(zip(seqs, lens)):
            ref = model(s).logits[0]
            assert torch.allclose(logits[i, T - n:], ref, atol=1e-9, rtol=0), i
            ref_gen = model.generate(s, max_new_tokens=6, do_sample=False, pad_token_id=2)[0, n:]
            assert gen[i].tolist() == ref_gen.tolist(), i


def test_save_load_round_trip_is_bit_exact(model, tmp_path):
    m = HyLoForCausalLM(m2_config()).eval()
    save_hylo(m, tmp_path)
    hybrid = json.loads((tmp_path / "hybrid_config.json").read_text())
    assert hybrid["d_inner"] == 64 and hybrid["d_xb"] == 32 and "linear_type" not in hybrid  # Zebra-Llama schema
    assert json.loads((tmp_path / "config.json").read_text())["hylo_bench"]["linear_type"] == "mamba"
    assert hybrid["ssm_cfg"] == {"expand": 1, "ngroups": 4, "d_state": 16, "repeat_kv_before_conv": False}
    assert "gdn_num_heads" not in hybrid
    loaded = load_hylo(tmp_path, dtype=None)
    assert loaded.config.mixer_types == m.config.mixer_types
    for k, v in m.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    x = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        assert torch.equal(m(x).logits, loaded(x).logits)
    bf16 = load_hylo(tmp_path)  # default: bf16, gate parameters kept in fp32
    assert bf16.model.layers[0].mamba.in_proj.weight.dtype == torch.bfloat16
    assert bf16.model.layers[0].mamba.A_log.dtype == torch.float32


def test_wrong_mamba_shape_names_key_and_both_shapes(tmp_path):
    m = HyLoForCausalLM(m2_config())
    save_hylo(m, tmp_path)
    hybrid = json.loads((tmp_path / "hybrid_config.json").read_text())
    hybrid["d_xb"] = 16
    (tmp_path / "hybrid_config.json").write_text(json.dumps(hybrid))
    with pytest.raises(CheckpointMismatchError) as e:
        load_hylo(tmp_path)
    msg = str(e.value)
    # d_xb 16 -> in_proj [2*64 + 2*16 + 4, 64] = [164, 64] expected, [196, 64] stored; conv [96,1,4] vs [128,1,4]
    assert "wrong shape for model.layers.0.mamba.in_proj.weight: expected [164, 64], found [196, 64]" in msg
    assert "model.layers.2.mamba.conv1d.weight: expected [96, 1, 4], found [128, 1, 4]" in msg


def test_gdn_config_with_mamba_weights_is_refused(tmp_path):
    save_hylo(HyLoForCausalLM(m2_config()), tmp_path)
    hybrid = json.loads((tmp_path / "hybrid_config.json").read_text())
    hybrid.update(linear_type="gdn", gdn_num_heads=2, gdn_head_dim=16)
    (tmp_path / "hybrid_config.json").write_text(json.dumps(hybrid))
    with pytest.raises(CheckpointMismatchError, match=r"layer 0: hybrid_config.json makes it Gated DeltaNet .* "
                                                      r"Mamba-2 mixer under model.layers.0.mamba"):
        load_hylo(tmp_path)


def test_zebra_llama_format_checkpoint_loads(tmp_path):
    """A checkpoint written from the spec: Zebra-Llama hybrid_config.json (no linear_type, no gdn keys) and
    ``model.layers.{i}.mamba.*`` / ``mla.*`` keys with sec. 4.5 shapes, stored in float32."""
    from safetensors.torch import save_file

    H, E, X, nh, N, V = 64, 64, 32, 4, 16, 97
    hybrid = {"hidden_size": H, "intermediate_size": 128, "hidden_act": "silu", "n_layer": 2, "mla_layers": [1],
              "rms_norm_eps": 1e-5, "num_attention_heads": 4, "num_key_value_heads": 2, "kv_lora_rank": 32,
              "q_lora_rank": 48, "use_lora_layer_norm": False, "use_full_kv_head": False, "qk_rope_head_dim": 8,
              "v_head_dim": 16, "qk_nope_head_dim": 8, "qkv_rank_divisor": 8, "max_position_embeddings": 4096,
              "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
              "rope_type": "yarn", "d_model": H, "d_inner": E, "d_xb": X,
              "ssm_cfg": {"expand": 1, "ngroups": nh, "d_state": N, "repeat_kv_before_conv": False}}
    base = {"model_type": "llama", "vocab_size": V, "hidden_size": H, "num_attention_heads": 4,
            "num_key_value_heads": 2, "tie_word_embeddings": True}
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "mlp.gate_proj.weight": (128, H), p + "mlp.up_proj.weight": (128, H),
                   p + "mlp.down_proj.weight": (H, 128)}
    shapes |= {"model.layers.0.mamba." + k: s for k, s in {
        "in_proj.weight": (2 * E + 2 * X + nh, H), "conv1d.weight": (E + 2 * X, 1, 4), "conv1d.bias": (E + 2 * X,),
        "dt_bias": (nh,), "A_log": (nh,), "D": (nh,), "norm.weight": (E,), "out_proj.weight": (H, E)}.items()}
    shapes |= {"model.layers.1.mla." + k: s for k, s in {
        "q_a_proj.weight": (48, H), "q_b_proj.weight": (4 * 16, 48), "kv_a_proj_with_mqa.weight": (32 + 8, H),
        "kv_b_proj.weight": (2 * (8 + 16), 32), "out_proj.weight": (H, 4 * 16)}.items()}
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=g, dtype=torch.float32) * 0.1 for k, s in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps(base))
    (tmp_path / "hybrid_config.json").write_text(json.dumps(hybrid))
    save_file(sd, tmp_path / "model.safetensors")
    m = load_hylo(tmp_path, dtype=None)
    assert m.config.linear_type == "mamba" and m.config.mixer_types == ["mamba", "mla"]
    assert all(torch.equal(v, sd[k]) for k, v in m.state_dict().items())
    with torch.no_grad():
        out = m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


@pytest.mark.parametrize("change, match", [
    (dict(ssm_cfg={"ngroups": 4, "d_state": 16, "repeat_kv_before_conv": True}), "repeat_kv_before_conv = true"),
    (dict(d_inner=48), "d_inner = 48 must equal ssm_cfg.ngroups \\* ssm_cfg.d_state = 4 \\* 16"),
    (dict(d_xb=24), "d_xb = 24 must be n_kv \\* d_state"),
    (dict(d_model=32), "'d_model' = 32 must equal hidden_size = 64"),
])
def test_bad_mamba_config_is_named(change, match):
    with pytest.raises(ValueError, match=match):
        m2_config(**change)
