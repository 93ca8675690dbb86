"""``models/loading.py``, the one transformers loader of user models: ``load_causal_lm`` (weights only, a caller's
check before any weight is read, errors naming the flag), ``load_model`` (+ tokenizer and hash) and the sweep's
``build_model`` on top of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hylo_bench.models.loading import load_causal_lm, load_model

BAD = Path(__file__).resolve().parents[1] / "bad_inputs" / "files" / "base_unknown_model_type"


def test_a_config_transformers_rejects_is_named_with_or_without_a_flag():
    with pytest.raises(ValueError) as e:
        load_causal_lm(str(BAD), "cpu")
    assert str(e.value).startswith(f"{BAD / 'config.json'}: transformers cannot build a model from it (ValueError: ")
    with pytest.raises(ValueError) as e:
        load_causal_lm(str(BAD), "cpu", flag="--teacher")
    assert str(e.value).startswith(f"--teacher {BAD}: transformers cannot build a model from {BAD / 'config.json'} "
                                   f"(ValueError: ")


def test_the_check_sees_the_resolved_directory_before_any_weight_is_read(tiny_base_dir):
    seen = []

    def refuse(d: Path):
        seen.append(d)
        raise ValueError(f"--base {d}: refused")

    with pytest.raises(ValueError, match="refused"):
        load_causal_lm(str(BAD), "cpu", check=refuse)  # weights unreadable by transformers: never reached
    assert seen == [BAD]
    model, info = load_causal_lm(str(tiny_base_dir), "cpu", check=seen.append)
    assert seen[-1] == tiny_base_dir and not model.training
    assert info == {"name": str(tiny_base_dir), "path": str(tiny_base_dir), "layout": "transformer",
                    "kind": "transformer"}


def test_load_model_adds_tokenizer_and_hash_and_the_sweep_gets_sdpa(tiny_base_dir):
    import torch

    from hylo_bench.serving.build import build_model

    model, tok, info = load_model(str(tiny_base_dir), device="cpu")
    assert list(info) == ["name", "path", "hash", "layout", "kind"] and len(info["hash"]) == 64
    assert tok("hi")["input_ids"] and model.dtype == torch.float32
    built, binfo = build_model(str(tiny_base_dir), "cpu", torch.float64)
    assert built.dtype == torch.float64 and built.config._attn_implementation == "sdpa"
    assert (binfo["name"], binfo["kind"], binfo["weights"]) == (str(tiny_base_dir), "transformer", "checkpoint")
