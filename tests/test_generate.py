"""``hylo-bench generate``: the released-format round trip upcycle -> from_pretrained -> generate (CLI), chat
templates, sampling options, streaming and ``--strip-think`` (exact strings and token ids)."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import GenerationConfig
from typer.testing import CliRunner

from hylo_bench.cli import app
from hylo_bench.generate import GenerateConfig, generate_text
from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.upcycle import run as run_mod

runner = CliRunner()
PROMPT = "The devil is"
NEW = 12


@pytest.fixture(scope="module")
def upcycled(tiny_base_dir, tmp_path_factory):
    """(OUT of a tiny `hylo-bench upcycle` run, the student as it was in memory when saved)."""
    out = tmp_path_factory.mktemp("gen") / "student"
    saved = {}
    real = run_mod._save_student

    def keep(student, tokenizer, d, ctx=None):
        real(student, tokenizer, d, ctx)
        saved[str(d)] = student

    mp = pytest.MonkeyPatch()
    mp.setattr(run_mod, "_save_student", keep)
    try:
        res = runner.invoke(app, ["upcycle", "--base", str(tiny_base_dir), "--out", str(out), "--stages",
                                  "128:ild@256,128@256", "--batch-size", "2", "--device", "cpu", "--eval-windows",
                                  "1", "--no-stage-checkpoints", "--allow-demo-data"])
    finally:
        mp.undo()
    assert res.exit_code == 0, res.output
    return out, saved[str(out)].eval()


def _greedy(model, ids):
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=NEW, do_sample=False, pad_token_id=2)[0, len(ids):].tolist()


def test_round_trip_upcycle_from_pretrained_generate(upcycled, tiny_tokenizer):
    out, student = upcycled
    ids = tiny_tokenizer(PROMPT).input_ids
    expected = _greedy(student, ids)
    loaded = HyLoForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert _greedy(loaded, ids) == expected
    assert len(expected) == NEW and len(set(expected)) > 1

    res = runner.invoke(app, ["generate", str(out), "--prompt", PROMPT, "--max-new-tokens", str(NEW),
                              "--device", "cpu", "--dtype", "fp32"])
    assert res.exit_code == 0, res.output
    assert res.stdout == tiny_tokenizer.decode(expected, skip_special_tokens=True) + "\n"
    assert f"{len(ids)} prompt + {NEW} new tokens" in " ".join(res.stderr.split())


def test_chat_template_is_applied_and_missing_one_is_named(upcycled, tiny_tokenizer, tmp_path):
    out, student = upcycled
    res = runner.invoke(app, ["generate", str(out), "--prompt", "hi", "--chat", "--device", "cpu"])
    assert res.exit_code == 2
    assert f"{str(out).rstrip('/')}: the tokenizer has no chat template" in " ".join(res.stderr.split())

    chat_dir = tmp_path / "chat"
    shutil.copytree(out, chat_dir)
    tok = type(tiny_tokenizer).from_pretrained(chat_dir)
    tok.chat_template = ("{% for m in messages %}<|bos|>Q: {{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %} A:{% endif %}")
    tok.save_pretrained(chat_dir)
    ids = tok("<|bos|>Q: The devil is A:", add_special_tokens=False).input_ids
    assert ids[0] == 0 and ids.count(0) == 1  # one BOS, from the template
    res = runner.invoke(app, ["generate", str(chat_dir), "--prompt", "The devil is", "--chat",
                              "--max-new-tokens", str(NEW), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert res.stdout == tok.decode(_greedy(student, ids), skip_special_tokens=True) + "\n"


def test_sampling_is_seeded_and_options_are_checked(upcycled, tiny_tokenizer):
    out, student = upcycled
    cfg = {"model": str(out), "prompt": PROMPT, "max_new_tokens": NEW, "temperature": 1.5, "top_p": 0.95, "top_k": 50}
    a = generate_text(student, tiny_tokenizer, GenerateConfig(**cfg, seed=1)).token_ids
    b = generate_text(student, tiny_tokenizer, GenerateConfig(**cfg, seed=1)).token_ids
    c = generate_text(student, tiny_tokenizer, GenerateConfig(**cfg, seed=2)).token_ids
    greedy = generate_text(student, tiny_tokenizer, GenerateConfig(model=str(out), prompt=PROMPT,
                                                                   max_new_tokens=NEW)).token_ids
    assert a == b and a != c
    assert greedy == _greedy(student, tiny_tokenizer(PROMPT).input_ids)
    # top_k = 1 samples the argmax: the greedy tokens at any temperature
    assert generate_text(student, tiny_tokenizer, GenerateConfig(**(cfg | {"top_k": 1}))).token_ids == greedy
    for bad, match in (({"top_p": 0.0}, "top_p must be in"), ({"temperature": -1.0}, "temperature must be >= 0"),
                       ({"top_k": 0}, "top_k must be >= 1"), ({"dtype": "int8"}, "dtype 'int8'")):
        with pytest.raises(ValueError, match=match):
            GenerateConfig(**(cfg | bad))
    res = runner.invoke(app, ["generate", str(out), "--prompt", "x", "--top-p", "1.5"])
    assert res.exit_code == 2 and "top_p must be in (0, 1]" in res.stderr


class _ScriptedModel(torch.nn.Module):
    """Stands in for a model that 'generates' a fixed token sequence, one token at a time into the streamer."""

    def __init__(self, new_ids):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.new_ids = new_ids
        self.generation_config = GenerationConfig()

    def generate(self, input_ids, attention_mask, streamer=None, generation_config=None):
        assert generation_config.do_sample is False and generation_config.max_new_tokens == 64
        if streamer is not None:
            streamer.put(input_ids[0])
            for t in self.new_ids:
                streamer.put(torch.tensor([t]))
            streamer.end()
        return torch.cat([input_ids, torch.tensor([self.new_ids])], 1)


@pytest.mark.parametrize("raw, shown", [
    ("<think>\n\n</think>\n\nThe devil is here.", "The devil is here."),
    ("<think>\nhmm, the devil\n</think>\n\nIt is here. <think>again", "It is here. "),
    ("No thoughts at all.", "No thoughts at all."),
])
def test_streamed_output_strips_think_spans(tiny_tokenizer, raw, shown):
    new_ids = tiny_tokenizer(raw, add_special_tokens=False).input_ids
    assert tiny_tokenizer.decode(new_ids) == raw
    pieces = []
    cfg = GenerateConfig(model="scripted", prompt=PROMPT, max_new_tokens=64, strip_think=True)
    result = generate_text(_ScriptedModel(new_ids), tiny_tokenizer, cfg, on_text=pieces.append)
    assert result.text == shown and "".join(pieces) == shown and result.token_ids == new_ids
    plain = generate_text(_ScriptedModel(new_ids), tiny_tokenizer,
                          GenerateConfig(model="scripted", prompt=PROMPT, max_new_tokens=64))
    assert plain.text == raw


def test_prompt_that_opens_a_think_span_is_stripped_to_the_answer(tiny_tokenizer):
    new_ids = tiny_tokenizer("reasoning here</think>\n\nAnswer.", add_special_tokens=False).input_ids
    pieces = []
    cfg = GenerateConfig(model="scripted", prompt="Question? <think>", max_new_tokens=64, strip_think=True)
    result = generate_text(_ScriptedModel(new_ids), tiny_tokenizer, cfg, on_text=pieces.append)
    assert result.text == "Answer." and "".join(pieces) == "Answer."
