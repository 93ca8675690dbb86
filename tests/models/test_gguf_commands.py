"""Every model argument takes a .gguf file: a tiny Llama written as GGUF (tests/gguf_fixture.py) goes through the
conversion, ``info``, ``generate``, ``ruler``, ``upcycle``, ``sweep`` and the ``hylo`` lm-eval model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from hylo_bench.cli import app
from hylo_bench.models import gguf as G
from tests.gguf_fixture import CHATML, write_tiny_llama_gguf

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_tokenizer):
    from tests.conftest import make_base

    d = tmp_path_factory.mktemp("gguf")
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHATML
    model = make_base("llama", vocab_size=len(tok))
    write_tiny_llama_gguf(d / "tiny-llama.gguf", model, tok)
    return d / "tiny-llama.gguf", model


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HYLO_BENCH_CACHE", str(tmp_path_factory.getbasetemp() / "gguf-cache"))


def test_conversion_gives_the_original_weights_and_is_reused(tiny_gguf, monkeypatch):
    from transformers import AutoModelForCausalLM

    from hylo_bench.models.loading import load_model

    path, original = tiny_gguf
    ours, tok, info = load_model(str(path), device="cpu", dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    x = torch.randint(0, original.config.vocab_size, (2, 17))
    with torch.no_grad():
        a, b, c = original(x).logits, theirs(x).logits, ours(x).logits
    assert (b - a).abs().max().item() < 1e-5 and (c - b).abs().max().item() < 1e-5
    d = G.converted_dir(path, "float32")
    assert info["path"] == str(d) and info["kind"] == "transformer"
    cfg = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_hidden_layers"] == 4
    conv = G.conversion_info(d)
    assert conv["sha256"] == G.file_sha256(path) and conv["quantization"] == {"F32": 39}
    assert tok.chat_template == CHATML
    monkeypatch.setattr(G, "check_gguf", lambda *a, **k: pytest.fail("converted again"))
    assert load_model(str(path), device="cpu")[2]["path"] == str(d)


def test_info_on_a_gguf(tiny_gguf):
    path, original = tiny_gguf
    res = runner.invoke(app, ["info", str(path), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["kind"] == "transformer" and d["params"] == sum(p.numel() for p in original.parameters())
    assert d["kv_cache_bytes_per_token"] == 2 * 4 * 2 * 16 * 2  # K and V, 4 layers, 2 KV heads of 16, bf16
    assert d["embeddings"]["tied"] is False and d["converted_from"]["source"] == str(path.resolve())


def test_generate_ruler_and_upcycle_on_a_gguf(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    res = runner.invoke(app, ["generate", str(path), "--prompt", "Hello", "--max-new-tokens", "4", "--chat",
                              "--device", "cpu"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["ruler", "--model", str(path), "--lengths", "1k", "--tasks", "niah_single_1",
                              "--samples", "2", "--device", "cpu", "--results-dir", str(tmp_path / "r"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out["scores"]) == {"niah_single_1"}
    res = runner.invoke(app, ["upcycle", "--base", str(path), "--out", str(tmp_path / "s"), "--stages",
                              "64:ild@256", "--batch-size", "2", "--eval-windows", "1", "--device", "cpu",
                              "--allow-demo-data", "--no-tensorboard", "--results-dir", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    man = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert man["settings"]["base"] == str(path) and man["base_dir"] == str(G.converted_dir(path, "float32"))
    assert man["embeddings"] == {"base_tied": False, "lm_head": "untied",
                                 "note": "lm_head copied from the base's lm_head"}


def test_sweep_and_the_lm_eval_model_on_a_gguf(tiny_gguf, tmp_path, monkeypatch):
    from hylo_bench.serving import sweep as S
    from hylo_bench.serving import sweep_worker
    from hylo_bench.tasks.lm_eval_bridge import HyLoLM

    path, original = tiny_gguf

    def in_process(spec, timeout_s):
        (tmp_path / "s.json").write_text(json.dumps(spec))
        sweep_worker.main([str(tmp_path / "s.json"), str(tmp_path / "w.json")])
        return json.loads((tmp_path / "w.json").read_text())

    monkeypatch.setattr(S, "run_worker", in_process)
    env = S.run(S.SweepConfig(model=str(path), contexts_tokens=[16], batch_sizes=[1], out=tmp_path / "sw.json",
                              decode_steps=2, prefill_chunk_tokens=8, device="cpu"))
    assert [(r["seq_len"], r["status"]) for r in env["records"]] == [(16, "ok")]
    lm = HyLoLM(pretrained=str(path), device="cpu", dtype="float32")
    x = torch.randint(0, original.config.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.allclose(lm.model(x).logits, original(x).logits, atol=1e-5)
