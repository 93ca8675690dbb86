"""Issue 19 items 7-11 and 19: ``--flavor nvidia`` samples equal what NVIDIA/RULER's generator scripts
(``scripts/data/synthetic/*.py`` at c3f5e3b) would build, and a too-small length names the smallest one that works.
Expected values come from NVIDIA's formulas (written out here) or a brute-force search, not from our code."""

from __future__ import annotations

import random
import re

import pytest
from transformers import AutoTokenizer

from hylo_bench.models.checkpoint import demo_teacher_dir
from hylo_bench.tasks.ruler import TASKS, generate_sample, generators, sampling
from hylo_bench.tasks.ruler.generators import BuildContext, build

CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"


@pytest.fixture(scope="module")
def tok():
    """The shipped demo tokenizer (byte-level BPE, BOS added)."""
    return AutoTokenizer.from_pretrained(demo_teacher_dir())


def _numbered(text: str) -> list[str]:
    parts = re.split(r"(?:^| )(\d+)\. ", text)[1:]
    return parts[1::2]


# ---- item 7: the CWE one-shot example keeps NVIDIA's space after the answer prefix --------------------------------

@pytest.mark.parametrize("length", [2048, 4096])
def test_cwe_example_answer_follows_the_prefix_after_one_space(length):
    ctx = BuildContext(length_tokens=length, flavor="nvidia")
    built = build(TASKS["ruler_cwe"], random.Random(0), 50, ctx)
    example = built.extra["input_example"]
    # NVIDIA: template.format(context=..., query='') + ' ' + ' '.join(f"{i + 1}. {word}" ...)
    _, answers = example.split(CWE_PREFIX)
    assert answers.startswith(" 1. ") and re.fullmatch(r"( \d+\. \S+){10}", answers)
    assert built.input.startswith(example + "\nBelow is a numbered list")
    lm = build(TASKS["ruler_cwe"], random.Random(0), 50, BuildContext(length_tokens=length, flavor="lm-eval"))
    assert lm.extra["input_example"].split(CWE_PREFIX)[1].startswith("1. ")  # lm-eval's cwe_utils: no space


# ---- item 8: FWE vocabulary (L - 50) // 50 --------------------------------------------------------------------

@pytest.mark.parametrize("length, nvidia, lm_eval", [(4096, 80, 81), (131072, 2620, 2621), (8192, 162, 163)])
def test_fwe_vocabulary_size(length, nvidia, lm_eval):
    # NVIDIA freq_words_extraction.sys_kwext: max_seq_length -= tokens_to_generate (50); vocab = max_seq_length // 50
    assert (length - 50) // 50 == nvidia and length // 50 == lm_eval
    assert generators.fwe_vocab_size(length, "nvidia") == nvidia
    assert generators.fwe_vocab_size(length, "lm-eval") == lm_eval


@pytest.mark.parametrize("flavor, distinct", [("nvidia", 80), ("lm-eval", 81)])
def test_fwe_sample_draws_from_that_vocabulary(flavor, distinct):
    # with 20000 words every rank k <= 81 gets int(20000 / (k^2 zeta(2))) >= 1 occurrence, so all words show
    built = build(TASKS["ruler_fwe"], random.Random(3), 20000, BuildContext(length_tokens=4096, flavor=flavor))
    words = built.input.split("Find the three most frequently appeared coded words. ", 1)[1].split("\nQuestion:")[0]
    assert len(set(words.split())) == distinct


# ---- item 9: CWE lists shuffled by a fresh Random(42) ----------------------------------------------------------

@pytest.mark.parametrize("length, repeats", [(2048, (6, 1)), (4096, (30, 3))])
def test_cwe_common_words_sit_where_a_fresh_random42_puts_them(length, repeats):
    num_words = 60
    common_rep, uncommon_rep = repeats
    # NVIDIA get_example: word_list = common * r_c + uncommon * r_u; random.Random(42).shuffle(word_list)
    slots = [i < 10 * common_rep for i in range(10 * common_rep + (num_words - 10) * uncommon_rep)]
    random.Random(42).shuffle(slots)
    want = [p for p, is_common in enumerate(slots) if is_common]
    ctx = BuildContext(length_tokens=length, flavor="nvidia")
    for seed in (1, 2):
        built = build(TASKS["ruler_cwe"], random.Random(seed), num_words, ctx)
        body = built.input.split("\nBelow is a numbered list of words.", 1)[1]
        body = body.split("Memorize the ones that appear most often.\n", 1)[1].rsplit("\nQuestion:", 1)[0]
        entries = _numbered(body)
        assert [p for p, w in enumerate(entries) if w in built.outputs] == want, seed


# ---- item 10: with a chat template, the answer prefix keeps its leading space ----------------------------------

CHAT = ("{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("task", ["niah_single_1", "ruler_vt", "ruler_cwe", "ruler_fwe"])
def test_chat_template_keeps_the_answer_prefix_space(tok, task):
    tok.chat_template = CHAT
    s = generate_sample(task, tok, 4096, 0, chat_template=True, flavor="nvidia")
    head = tok.apply_chat_template([{"role": "user", "content": s["input"]}], tokenize=False,
                                   add_generation_prompt=True)
    # NVIDIA prepare.py: model_template.format(task_template=...) + answer_prefix, the prefix starting with " "
    assert s["prompt"] == head + " " + s["gen_prefix"] and head.endswith("<|assistant|>\n")
    lm = generate_sample(task, tok, 4096, 0, chat_template=True, flavor="lm-eval")
    assert lm["prompt"].endswith("<|assistant|>\n" + lm["gen_prefix"])


# ---- item 11: NVIDIA sizes without the BOS -------------------------------------------------------------------

@pytest.mark.parametrize("task", ["niah_single_1", "ruler_fwe", "ruler_vt"])
def test_nvidia_sizing_counts_tokens_without_bos(tok, task):
    s = generate_sample(task, tok, 4096, 0, flavor="nvidia")
    gen = TASKS[task].max_gen_toks
    # NVIDIA: length = len(TOKENIZER.text_to_tokens(input_text)) + tokens_to_generate, text_to_tokens = tokenize()
    nvidia_count = len(tok.tokenize(s["prompt"]))
    assert s["length"] == nvidia_count + gen <= 4096
    assert s["prompt_tokens"] == nvidia_count + 1 == len(tok(s["prompt"]).input_ids)  # the BOS is still fed
    assert s["length"] >= 0.98 * 4096


# ---- item 19: a too-small length names the smallest one that works ---------------------------------------------

def test_minimum_length_equals_a_brute_force_search(tok):
    above, n = 900, 3
    got = sampling.minimum_length("ruler_cwe", tok, above, num_samples=n)
    brute = None
    for length in range(above + 1, above + 400):
        try:
            for i in range(n):
                generate_sample("ruler_cwe", tok, length, i)
        except ValueError:
            continue
        brute = length
        break
    assert brute is not None and got == brute
    with pytest.raises(ValueError, match=rf"too small for RULER task 'ruler_cwe'.*use a length >= {got} "):
        generate_sample("ruler_cwe", tok, above, n - 1)
