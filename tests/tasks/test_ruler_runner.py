"""RULER runner end to end: tiny random Llama, scripted oracle/empty models, results JSON, sample cache."""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from rich.console import Console
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from hylo_bench.tasks.ruler import RulerConfig, evaluate_model, generate_sample, render_tables, run, tokenizer_hash
from hylo_bench.tasks.ruler import cache as ruler_cache
from hylo_bench.text.haystack import default_haystack_text

INFO = {"name": "tiny/llama", "path": "/nowhere", "hash": "abc123", "layout": "transformer", "kind": "hf"}
TOP_KEYS = {
    "kind", "hylo_bench_version", "git_sha", "created_utc", "model", "tokenizer_hash", "seed", "samples_per_task",
    "chat_template", "flavor", "records", "mean", "provenance", "avg", "weighted_avg_inc", "weighted_avg_dec",
    "status", "planned", "run_id",
}  # fmt: skip
RECORD_KEYS = {
    "task", "seq_len", "score", "n", "seed", "nulls", "prompt_tokens_mean", "prompt_tokens_min", "prompt_tokens_max",
    "flavor", "generator_version",
}  # fmt: skip
PROVENANCE_KEYS = {
    "model_hash", "tokenizer_hash", "generator_version", "flavor", "seed", "samples_per_task", "batch_size", "dtype",
    "device", "num_processes", "engine", "chat_template", "strip_think", "torch_version", "transformers_version",
    "python_version", "hylo_bench_version", "git_sha", "haystack_sha256", "qa_data_sha256", "backend",
}  # fmt: skip


def build_small_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the shipped essay (under a second), adding BOS."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet)
    tok.train_from_iterator([default_haystack_text()], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_small_tokenizer()


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class ScriptedLM(torch.nn.Module):
    """Answers each prompt (looked up by its token ids) with a fixed text, then EOS."""

    def __init__(self, tokenizer, answers: dict[tuple[int, ...], str]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer, self.answers = tokenizer, answers

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        assert do_sample is False
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            answer = self.answers[tuple(ids[mask.bool()].tolist())]
            new = self.tokenizer(answer, add_special_tokens=False).input_ids[: max_new_tokens - 1]
            rows.append(new + [self.tokenizer.eos_token_id])
        width = max(len(r) for r in rows)
        new_BT = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new_BT], dim=1)


def _cfg(tmp_path, **kw) -> RulerConfig:
    base = dict(model="tiny", lengths=[1024], tasks=["niah_single_1", "ruler_vt"], samples=2, results_dir=tmp_path)
    return RulerConfig(**{**base, **kw})


def _quiet() -> Console:
    return Console(file=io.StringIO())


def _scripted(tok, cfg: RulerConfig, oracle: bool) -> ScriptedLM:
    answers = {}
    for task in cfg.tasks:
        for length in cfg.lengths:
            for i in range(cfg.samples):
                s = generate_sample(task, tok, length, i, cfg.seed, chat_template=cfg.chat_template, flavor=cfg.flavor,
                                    qa_path=cfg.qa_path(task))
                ids = tok(s["prompt"], add_special_tokens=not cfg.chat_template).input_ids
                answers[tuple(ids)] = " " + ", ".join(s["outputs"]) if oracle else ""
    return ScriptedLM(tok, answers)


def tiny_llama_config(tok) -> LlamaConfig:
    """A 2-layer Llama (hidden 32) over the test tokenizer, long enough for 1K RULER prompts."""
    return LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1280, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip


def test_tiny_llama_end_to_end_writes_valid_results(tok, tmp_path, one_thread):
    torch.manual_seed(0)
    config = tiny_llama_config(tok)
    cfg = _cfg(tmp_path)
    summary = evaluate_model(LlamaForCausalLM(config), tok, INFO, cfg, console=_quiet())

    assert set(summary) == {"model", "flavor", "backend", "scores", "mean", "avg", "weighted_avg_inc",
                            "weighted_avg_dec", "results_path", "engine_stats"} and summary["model"] == "tiny/llama"
    assert summary["engine_stats"] is None  # transformers generate(): no engine counters
    assert set(summary["scores"]) == {"niah_single_1", "ruler_vt"}
    assert all(0.0 <= v["1024"] <= 100.0 for v in summary["scores"].values())
    files = list(tmp_path.glob("ruler-tiny_llama-*.json"))
    assert [str(f) for f in files] == [summary["results_path"]]
    doc = json.loads(files[0].read_text())
    assert TOP_KEYS <= set(doc) and doc["kind"] == "ruler" and doc["flavor"] == "nvidia"
    prov = doc["provenance"]
    assert set(prov) == PROVENANCE_KEYS
    assert prov["model_hash"] == "abc123" and prov["tokenizer_hash"] == tokenizer_hash(tok)
    assert (prov["dtype"], prov["device"], prov["batch_size"], prov["flavor"]) == ("float32", "cpu", 1, "nvidia")
    assert (prov["engine"], prov["num_processes"]) == ("generate", 1)
    assert prov["torch_version"] == torch.__version__ and prov["transformers_version"] == transformers.__version__
    assert prov["generator_version"] == ruler_cache.GENERATOR_VERSION and prov["qa_data_sha256"] == {}
    assert doc["model"] == INFO and doc["tokenizer_hash"] == tokenizer_hash(tok)
    assert doc["seed"] == 42 and doc["samples_per_task"] == 2 and doc["chat_template"] is False
    got = [(r["task"], r["seq_len"], r["n"]) for r in doc["records"]]
    assert got == [("niah_single_1", 1024, 2), ("ruler_vt", 1024, 2)]
    for r in doc["records"]:
        assert set(r) == RECORD_KEYS
        assert r["prompt_tokens_min"] <= r["prompt_tokens_mean"] <= r["prompt_tokens_max"] <= 1024 - 30
    assert doc["mean"] == {"1024": pytest.approx(sum(r["score"] for r in doc["records"]) / 2)}
    assert summary["mean"] == doc["mean"]
    assert doc["weighted_avg_inc"] == doc["weighted_avg_dec"] == doc["avg"] == doc["mean"]["1024"]
    assert all(r["flavor"] == "nvidia" and r["generator_version"] == ruler_cache.GENERATOR_VERSION
               for r in doc["records"])
    assert len(list((tmp_path / "cache").glob("*.jsonl"))) == 2
    tables = render_tables(summary)
    assert len(tables) == 2 and tables[0].row_count == 3
    assert [c.header for c in tables[1].columns] == ["1024", "Avg.", "wAvg. (inc)", "wAvg. (dec)"]


@pytest.mark.parametrize("flavor", ["nvidia", "lm-eval"])
def test_oracle_scores_100_and_empty_model_scores_0(tok, tmp_path, flavor):
    # nvidia's CWE prompt carries its one-shot example: > 1024 tokens with this 1024-token vocabulary
    length = 2048 if flavor == "nvidia" else 1024
    cfg = _cfg(tmp_path, tasks=["niah_multivalue", "ruler_cwe", "ruler_fwe"], batch_size=2, flavor=flavor,
               lengths=[length])
    oracle = evaluate_model(_scripted(tok, cfg, oracle=True), tok, INFO, cfg, console=_quiet())
    key = str(length)
    assert oracle["scores"] == {t: {key: 100.0} for t in cfg.tasks} and oracle["mean"] == {key: 100.0}
    empty = evaluate_model(_scripted(tok, cfg, oracle=False), tok, INFO, cfg, console=_quiet())
    assert empty["scores"] == {t: {key: 0.0} for t in cfg.tasks}
    doc = json.loads(open(empty["results_path"]).read())
    assert [r["nulls"] for r in doc["records"]] == [2, 2, 2]
    assert doc["flavor"] == doc["provenance"]["flavor"] == flavor
    assert {r["flavor"] for r in doc["records"]} == {flavor}


def test_chat_template_prompts(tmp_path):
    tok = build_small_tokenizer()
    tok.chat_template = "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    s = generate_sample("niah_single_1", tok, 1024, 0, 42, chat_template=True)
    assert s["prompt"].startswith("<s>[user] A special magic number is hidden")
    # NVIDIA appends its answer prefix (" The special ...") to the template, here one that ends in a space
    assert s["prompt"].endswith("provided text?\n[assistant]  " + s["gen_prefix"])
    assert s["prompt_tokens"] == len(tok(s["prompt"], add_special_tokens=False).input_ids)
    assert 0.95 * 1024 <= s["prompt_tokens"] + 128 <= 1024
    cfg = _cfg(tmp_path, tasks=["niah_single_1"], chat_template=True)
    out = evaluate_model(_scripted(tok, cfg, oracle=True), tok, INFO, cfg, console=_quiet())
    assert out["scores"] == {"niah_single_1": {"1024": 100.0}}
    assert json.loads(open(out["results_path"]).read())["chat_template"] is True
    assert list((tmp_path / "cache").glob(f"*-nvidia-*-chat-v{ruler_cache.GENERATOR_VERSION}.jsonl"))


def test_sample_cache_is_reused_and_extended(tok, tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, tasks=["niah_single_1"])
    model = _scripted(tok, _cfg(tmp_path, tasks=["niah_single_1"], samples=3), oracle=True)
    first = evaluate_model(model, tok, INFO, cfg, console=_quiet())
    calls = []
    real = ruler_cache.generate_sample

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(ruler_cache, "generate_sample", counting)
    again = evaluate_model(model, tok, INFO, cfg, console=_quiet())
    assert calls == [] and again["scores"] == first["scores"]
    evaluate_model(model, tok, INFO, _cfg(tmp_path, tasks=["niah_single_1"], samples=3), console=_quiet())
    assert calls == [2]
    cached = ruler_cache.read_samples(next((tmp_path / "cache").glob("niah_single_1-1024-*.jsonl")))
    assert [s["index"] for s in cached] == [0, 1, 2]
    assert cached[1] == generate_sample("niah_single_1", tok, 1024, 1, 42)


def test_run_loads_model_through_load_model(tok, tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, tasks=["ruler_vt"], samples=1)
    model = _scripted(tok, cfg, oracle=True)
    fake = types.ModuleType("hylo_bench.models.loading")
    fake.load_model = lambda spec, device=None, dtype=None: (model, tok, {**INFO, "name": spec})
    monkeypatch.setitem(sys.modules, "hylo_bench.models.loading", fake)
    out = run(cfg, console=_quiet())
    assert out["model"] == "tiny" and out["scores"] == {"ruler_vt": {"1024": 100.0}}


def test_config_validation_is_actionable(tmp_path):
    with pytest.raises(ValueError, match="valid tasks: niah_single_1"):
        _cfg(tmp_path, tasks=["niah_single_1", "ruler_qa"])
    with pytest.raises(ValueError, match="missing.txt"):
        _cfg(tmp_path, haystack_path=tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="lengths must be"):
        _cfg(tmp_path, lengths=[])
    with pytest.raises(ValueError, match="samples must be"):
        _cfg(tmp_path, samples=0)
    assert _cfg(tmp_path).to_dict()["results_dir"] == str(tmp_path)


def test_tokenizer_hash_is_stable_and_discriminates(tok):
    assert tokenizer_hash(tok) == tokenizer_hash(tok)
    assert tokenizer_hash(tok) != tokenizer_hash(build_small_tokenizer(vocab_size=900))


class DyingLM(ScriptedLM):
    """ScriptedLM that records every prompt it answers and raises once ``die_after`` predictions are made."""

    def __init__(self, tokenizer, answers, die_after: int | None = None):
        super().__init__(tokenizer, answers)
        self.die_after, self.seen = die_after, []

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        if self.die_after is not None and len(self.seen) >= self.die_after:
            raise RuntimeError("killed")
        self.seen += [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(input_ids, attention_mask)]
        return super().generate(input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id)


def _half_oracle(tok, cfg: RulerConfig) -> dict[tuple[int, ...], str]:
    """Right answers for even sample indices, a wrong one for odd indices (scores strictly between 0 and 100)."""
    answers = {}
    for task in cfg.tasks:
        for length in cfg.lengths:
            for i in range(cfg.samples):
                s = generate_sample(task, tok, length, i, cfg.seed, flavor=cfg.flavor)
                answers[tuple(tok(s["prompt"]).input_ids)] = " " + ", ".join(s["outputs"]) if i % 2 == 0 else " no"
    return answers


def test_resume_scores_only_the_missing_samples(tok, tmp_path):
    cfg = _cfg(tmp_path / "full", samples=3, batch_size=2)
    answers = _half_oracle(tok, cfg)
    full = evaluate_model(DyingLM(tok, answers), tok, INFO, cfg, console=_quiet())
    assert 0.0 < full["scores"]["niah_single_1"]["1024"] < 100.0

    cfg = _cfg(tmp_path / "killed", samples=3, batch_size=2)
    with pytest.raises(RuntimeError, match="killed"):  # task 1: batches [0, 1], [2]; task 2: [0, 1], then dies
        evaluate_model(DyingLM(tok, answers, die_after=4), tok, INFO, cfg, console=_quiet())
    pred_files = sorted((tmp_path / "killed" / "predictions").glob("*.jsonl"))
    assert [len(f.read_text().splitlines()) for f in pred_files] == [3, 2]  # niah_single_1, ruler_vt

    resumed_cfg = _cfg(tmp_path / "killed", samples=3, batch_size=2, resume=True)
    model = DyingLM(tok, answers)
    resumed = evaluate_model(model, tok, INFO, resumed_cfg, console=_quiet())
    vt2 = generate_sample("ruler_vt", tok, 1024, 2, 42)
    assert model.seen == [tuple(tok(vt2["prompt"]).input_ids)]
    assert resumed["scores"] == full["scores"] and resumed["mean"] == full["mean"]
    doc = json.loads(Path(resumed["results_path"]).read_text())
    assert [r["n"] for r in doc["records"]] == [3, 3] and doc["config"]["resume"] is True
    assert [len(f.read_text().splitlines()) for f in pred_files] == [3, 3]

    fresh = DyingLM(tok, answers)  # without resume every sample is decoded again
    assert evaluate_model(fresh, tok, INFO, cfg, console=_quiet())["scores"] == full["scores"]
    assert len(fresh.seen) == 6


def test_resume_skips_torn_lines_and_stale_prompts(tok, tmp_path):
    cfg = _cfg(tmp_path, tasks=["niah_single_1"], samples=2, resume=True)
    answers = _half_oracle(tok, cfg)
    evaluate_model(DyingLM(tok, answers), tok, INFO, cfg, console=_quiet())
    (path,) = (tmp_path / "predictions").glob("*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and rows[0]["prediction"] == answers[tuple(
        tok(generate_sample("niah_single_1", tok, 1024, 0, 42)["prompt"]).input_ids)]
    rows[0]["prompt_sha256"] = "0" * 64  # a prediction for another prompt must not be reused
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[1]) + "\n" + '{"index": 1, "pro')
    model = DyingLM(tok, answers)
    evaluate_model(model, tok, INFO, cfg, console=_quiet())
    assert len(model.seen) == 1
    rows_after = [json.loads(line) for line in path.read_text().splitlines()]  # merged in index order, torn line gone
    assert [r["index"] for r in rows_after] == [0, 1] and rows_after[1] == rows[1]
