"""Fast checks of the embedded demo teacher (hylo_bench/data/demo_teacher): offline loading, shape, tokenizer,
and one greedy NIAH answer at 1K tokens."""

from __future__ import annotations

import importlib.resources
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEMO_DIR = importlib.resources.files("hylo_bench") / "data" / "demo_teacher"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEMO_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(str(DEMO_DIR), local_files_only=True, dtype=torch.float32).eval()


def test_shipped_files_are_small():
    names = {p.name for p in DEMO_DIR.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "README.md"}
    assert expected <= names
    assert sum(p.stat().st_size for p in DEMO_DIR.iterdir()) < 8 * 2**20


def test_config_shape(model):
    cfg = model.config
    assert cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 128, 4, 2)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (32, 384, 3148)
    assert cfg.tie_word_embeddings is False
    assert cfg.max_position_embeddings == 4096
    assert sum(p.numel() for p in model.parameters()) == 1_593_472  # the card's count
    assert not hasattr(cfg, "auto_map")  # no remote code
    assert json.loads((DEMO_DIR / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_special_tokens(tokenizer, model):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert tokenizer.bos_token_id == model.config.bos_token_id
    assert tokenizer.eos_token_id == model.config.eos_token_id
    assert tokenizer.pad_token_id == model.config.pad_token_id
    assert len(tokenizer) == model.config.vocab_size


def test_tokenizer_bos_digits_and_round_trip(tokenizer):
    text = "One of the special magic numbers for wry-badger is: 4821907.\nThe sky is blue. CAFE 0x1f"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    digits = tokenizer("4821907", add_special_tokens=False).input_ids
    assert [tokenizer.decode([i]) for i in digits] == ["482", "190", "7"]  # runs of 3 from the left, as Llama 3
    assert [tokenizer.decode([i]) for i in tokenizer(" 1881 07", add_special_tokens=False).input_ids] == [
        " ", "188", "1", " ", "07"]


def test_greedy_answers_a_1k_niah_single_1_sample(tokenizer, model):
    from hylo_bench.tasks.ruler import generate_sample, score_prediction

    sample = generate_sample("niah_single_1", tokenizer, 1024, 0, seed=42)
    ids = tokenizer(sample["prompt"], return_tensors="pt").input_ids
    assert 800 < ids.shape[1] <= 1024
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    prediction = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert score_prediction("niah_single_1", prediction, sample["outputs"]) == 1.0, (prediction, sample["outputs"])
