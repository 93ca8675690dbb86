"""HyLoForCausalLM: forward, cache, generate, padding, save/load round trip and strict-load errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hylo_bench.config.hybrid import default_mla_layers, parse_layout
from hylo_bench.config.hylo_config import HyLoConfig
from hylo_bench.models.checkpoint import CheckpointMismatchError, save_hylo
from hylo_bench.models.hybrid import HyLoForCausalLM, load_hylo
from hylo_bench.models.rope import rope_inv_freq_and_mscale, yarn_correction_range
from tests.conftest import tiny_hybrid_config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HyLoForCausalLM(tiny_hybrid_config()).eval().double()


def test_layout_parsing_and_released_placements():
    assert parse_layout("7MLA21GDN", 28) == ([1, 5, 9, 13, 17, 21, 25], "gdn")
    assert parse_layout("6MLA22GDN", 28)[0] == [0, 5, 10, 16, 21, 26]
    assert parse_layout("4MLA12M2", 16) == ([1, 5, 10, 14], "mamba")
    assert default_mla_layers(4, 2) == [1, 3]
    with pytest.raises(ValueError, match="base model has 28"):
        parse_layout("7MLA20GDN", 28)


def test_yarn_values_match_spec_table():
    # checkpoint-format.md §5.3: Llama-1B 8K (2, 8), mscale 1.1386; Qwen 64K (11, 20), mscale 1.0693
    assert yarn_correction_range(32, 5e5, 2048) == (2, 8)
    assert yarn_correction_range(64, 1e6, 32768) == (11, 20)
    _, m = rope_inv_freq_and_mscale(32, 5e5, {"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 2048})
    assert m == pytest.approx(0.1 * math.log(4) + 1) and round(m, 4) == 1.1386
    inv, m1 = rope_inv_freq_and_mscale(64, 1e6, {"rope_type": "yarn", "factor": 1.0})
    assert m1 == 1.0 and torch.allclose(inv, 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)))


def test_parameter_names_follow_released_layout(model):
    names = set(model.state_dict())
    for key in ("model.layers.1.mla.q_a_proj.weight", "model.layers.1.mla.kv_a_proj_with_mqa.weight",
                "model.layers.1.mla.kv_b_proj.weight", "model.layers.1.mla.out_proj.weight",
                "model.layers.0.gdn.A_log", "model.layers.0.gdn.q_conv1d.weight", "lm_head.weight",
                "model.layers.2.mlp.gate_proj.weight", "model.norm.weight"):
        assert key in names, key
    sd = model.state_dict()
    assert tuple(sd["model.layers.1.mla.kv_a_proj_with_mqa.weight"].shape) == (32 + 8, 64)
    assert tuple(sd["model.layers.1.mla.kv_b_proj.weight"].shape) == (2 * (8 + 16), 32)
    assert sd["lm_head.weight"].data_ptr() != sd["model.embed_tokens.weight"].data_ptr()  # untied


def test_labels_loss_is_shifted_cross_entropy(model):
    x = torch.randint(0, 97, (2, 9))
    out = model(x, labels=x)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 97), x[:, 1:].reshape(-1))
    assert torch.allclose(out.loss, ref)


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
    assert torch.allclose(full, torch.cat(parts, 1), atol=1e-10)
    # the MLA cache holds kv_lora_rank + qk_rope_head_dim elements per token per MLA layer
    mla = [s for s in cache.layers_state if hasattr(s, "latent")]
    assert len(mla) == 2 and all(tuple(s.latent.shape) == (2, 13, 32 + 8) for s in mla)


def test_generate_with_cache_equals_greedy_recompute(model):
    x = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        g = model.generate(x, max_new_tokens=6, do_sample=False)
        y = x
        for _ in range(6):
            y = torch.cat([y, model(y).logits[:, -1:].argmax(-1)], 1)
    assert g.tolist() == y.tolist()


def test_left_padding_does_not_leak(model):
    x = torch.randint(3, 97, (1, 8))
    padded = torch.cat([torch.full((1, 4), 2), x], 1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 8)], 1).long()
    with torch.no_grad():
        a = model(padded, attention_mask=mask).logits[:, 4:]
        b = model(x).logits
        ga = model.generate(padded, attention_mask=mask, max_new_tokens=5, do_sample=False)[:, 12:]
        gb = model.generate(x, max_new_tokens=5, do_sample=False)[:, 8:]
    assert torch.allclose(a, b, atol=1e-9)
    assert ga.tolist() == gb.tolist()


def test_save_load_round_trip_is_bit_exact(model, tmp_path):
    save_hylo(model.float(), tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"config.json", "hybrid_config.json", "model.safetensors"}
    hybrid = json.loads((tmp_path / "hybrid_config.json").read_text())
    assert hybrid["mla_layers"] == [1, 3] and hybrid["kv_lora_rank"] == 32 and hybrid["gdn_num_heads"] == 2
    loaded = load_hylo(tmp_path, dtype=None)
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    x = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)
    model.double()


def test_wrong_shape_names_key_and_both_shapes(tmp_path):
    torch.manual_seed(0)
    m = HyLoForCausalLM(tiny_hybrid_config())
    save_hylo(m, tmp_path)
    hybrid = json.loads((tmp_path / "hybrid_config.json").read_text())
    hybrid["kv_lora_rank"] = 16
    (tmp_path / "hybrid_config.json").write_text(json.dumps(hybrid))
    with pytest.raises(CheckpointMismatchError) as e:
        load_hylo(tmp_path)
    msg = str(e.value)
    assert "model.layers.1.mla.kv_a_proj_with_mqa.weight" in msg and "[24, 64]" in msg and "[40, 64]" in msg
    assert "model.layers.3.mla.kv_b_proj.weight" in msg  # every offending key is listed


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    m = HyLoForCausalLM(tiny_hybrid_config())
    save_hylo(m, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd.pop("model.layers.0.gdn.A_log")
    sd["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"missing key model.layers.0.gdn.A_log[\s\S]*unexpected key "
                                                      r"model.layers.0.extra.weight"):
        load_hylo(tmp_path)


def test_truncated_safetensors_and_bad_config_are_named(tmp_path):
    m = HyLoForCausalLM(tiny_hybrid_config())
    save_hylo(m, tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ValueError, match="model.safetensors: cannot read safetensors header"):
        load_hylo(tmp_path)
    good = tiny_hybrid_config().to_hybrid_dict()
    for change, message in ((dict(n_layer="four"), "'n_layer' should be int, got str"),
                            (dict(kv_lora_rank="64"), "'kv_lora_rank' should be int, got str"),
                            (dict(gdn_num_heads=3.5), "'gdn_num_heads' should be int, got float"),
                            (dict(kv_lora_rank=None), "'kv_lora_rank' should be int, got NoneType")):
        (tmp_path / "hybrid_config.json").write_text(json.dumps(good | change))
        with pytest.raises(ValueError, match=message):
            load_hylo(tmp_path)
    for key in ("kv_lora_rank", "gdn_head_dim"):
        (tmp_path / "hybrid_config.json").write_text(json.dumps({k: v for k, v in good.items() if k != key}))
        with pytest.raises(ValueError, match=f"missing required key.*{key}"):
            load_hylo(tmp_path)


def test_legacy_hybrid_config_is_normalised():
    base = {"model_type": "llama", "vocab_size": 97, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_size": 64}
    hybrid = tiny_hybrid_config().to_hybrid_dict()
    hybrid.update(rope_type="yarn", layer_rank_list=[], q_energy_ratio=None,
                  rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    cfg = HyLoConfig.from_dicts(base, hybrid)
    assert cfg.mla_rope_scaling == {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 8192}


def test_pytorch_model_bin_loads_like_safetensors(tmp_path):
    torch.manual_seed(0)
    m = HyLoForCausalLM(tiny_hybrid_config())
    save_hylo(m, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(m.state_dict(), tmp_path / "pytorch_model.bin")
    loaded = load_hylo(tmp_path, dtype=None)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in m.state_dict().items())


@pytest.mark.gpu
def test_mla_padded_flash_prefill_equals_the_float64_reference():
    """On CUDA the MLA prefill pads d_V up to d_qk for flash attention; the output equals exact attention."""
    from hylo_bench.models.attention import causal_attention

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 300, 192, generator=g) for _ in range(2))
    v = torch.randn(2, 4, 300, 128, generator=g)
    scale = 192 ** -0.5
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(300, 300, dtype=torch.bool).tril(), float("-inf"))
    ref = s.softmax(-1) @ v.double()
    out = causal_attention(*(t.cuda().bfloat16() for t in (q, k, v)), scale)
    assert out.shape == (2, 4, 300, 128)
    err = (out.double().cpu() - ref).norm() / ref.norm()
    assert err < 2e-2, err


def _masked_reference(q, k, v, scale, mask_BT):
    """Attention with an explicit [B, T, T] mask in float64: causal among real tokens, a padding query sees itself."""
    T = q.shape[2]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None] & mask_BT[:, None, :]
    allowed[:, torch.arange(T), torch.arange(T)] = True
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return s.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ v.double()


def test_left_padded_attention_equals_the_masked_float64_reference():
    """The left-padded prefill path (per row, no [B, T, T] mask) gives the masked SDPA's output, padding rows too."""
    from hylo_bench.models.attention import left_padded_causal_attention, left_padding

    g = torch.Generator().manual_seed(1)
    B, H, T = 3, 2, 17
    q, k = (torch.randn(B, H, T, 12, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, T, 8, generator=g, dtype=torch.float64)
    pads = [0, 5, 16]
    mask = torch.arange(T)[None] >= torch.tensor(pads)[:, None]
    assert left_padding(mask) == pads
    out = left_padded_causal_attention(q, k, v, 0.3, pads)
    torch.testing.assert_close(out, _masked_reference(q, k, v, 0.3, mask), rtol=0, atol=1e-12)
    right = mask.flip(1)  # right padding is not left padding: the masked path keeps it
    assert left_padding(right) is None
