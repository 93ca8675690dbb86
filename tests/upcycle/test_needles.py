"""Needle-retrieval rows (hylo_bench/upcycle/needles.py): exact RULER wording, masks on the answers only,
determinism per step, and the 3-digit number split of the demo tokenizer."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer

from hylo_bench.models.checkpoint import demo_teacher_dir
from hylo_bench.tasks.ruler import generate_sample
from hylo_bench.upcycle.data import retrieval_examples
from hylo_bench.upcycle.documents import shipped_text
from hylo_bench.upcycle.needles import DenseConfig, DenseDataset, DenseRows, group_digits


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(demo_teacher_dir())


@pytest.fixture(scope="module")
def text_ids(tok):
    return np.asarray(tok(shipped_text()[:50_000], add_special_tokens=False).input_ids)


def _rows(tok, text_ids, **kw):
    return DenseRows(tok, text_ids, shipped_text(), DenseConfig(seed=7, batch_size=6, **kw))


def test_group_digits_splits_left_to_right_and_keeps_other_ids():
    vocab = {c: i for i, c in enumerate(["<s>", *"0123456789", "a", "b"])}
    base = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    base.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True)])
    grouped = group_digits(base, 3)
    assert grouped.get_vocab_size() == len(vocab) + 100 + 1000  # "00".."99" and "000".."999"
    assert [grouped.id_to_token(i) for i in grouped.encode("1234567ab05").ids] == ["123", "456", "7", "a", "b", "05"]
    assert all(grouped.token_to_id(t) == i for t, i in vocab.items())  # existing ids unchanged


def test_needle_row_uses_ruler_wording_and_marks_only_answers(tok, text_ids):
    rows = _rows(tok, text_ids)
    rng = random.Random(3)
    for _ in range(20):
        ids, ans, ctx = rows.needle_row(rng, 600)
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        assert len(ans) == len(ctx) == len(ids) - 1
        assert not np.any((ans > 0) & (ctx > 0))
        text = tok.decode(ids[1:-1])
        assert text.startswith("A special magic number is hidden within the following text. Make sure to memorize it. "
                               "I will quiz you about the number afterwards.\n")
        needles = dict(re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.", text))
        asked = re.findall(r"\nWhat is the special magic number for (\S+) mentioned in the provided text\? The special "
                           r"magic number for \1 mentioned in the provided text is (\d{7})\.", text)
        assert 1 <= len(needles) <= 8 and asked
        assert all(needles[k] == v for k, v in asked)  # every answer is its key's needle value
        answer_text = tok.decode([ids[j + 1] for j in np.flatnonzero(ans)])
        assert answer_text == "".join(f" {v}." for _, v in asked) + tok.eos_token
        # the piece-wise encoding equals encoding the whole text (no tokenisation seams)
        assert tok(text, add_special_tokens=False).input_ids == ids[1:-1].tolist()
        # the "\n" that follows an intermediate answer is not trained (the model learns EOS after an answer)
        untrained = np.flatnonzero((ans == 0) & (ctx == 0))
        assert len(untrained) == len(asked) - 1
        assert all(tok.decode([ids[j + 1]]) == "\n" for j in untrained)


def test_first_question_is_a_ruler_prompt(tok, text_ids):
    """A single-needle row's prompt has the shape of RULER's niah_single prompt (same text up to the haystack)."""
    sample = generate_sample("niah_single_2", tok, 1024, 0, seed=42)
    rows = _rows(tok, text_ids)
    rng = random.Random(0)
    ids, ans, _ = rows.needle_row(rng, 1024)
    prompt = tok.decode(ids[1:int(np.flatnonzero(ans)[0]) + 1])
    tail = r"\nWhat is the special magic number for \S+ mentioned in the provided text\? The special magic number " \
           r"for \S+ mentioned in the provided text is$"
    assert re.search(tail, prompt) and re.search(tail, sample["prompt"])
    assert prompt[:130] == sample["prompt"][:130]


def test_batches_depend_on_step_only(tok, text_ids):
    a = _rows(tok, text_ids).batch(5)
    b = _rows(tok, text_ids).batch(5)
    c = _rows(tok, text_ids).batch(6)
    assert all((x == y).all() for x, y in zip(a, b))
    assert a[0].shape != c[0].shape or not (a[0] == c[0]).all()
    ids, ans, ctx = a
    assert ids.shape[0] == 6 and ans.shape == ctx.shape == (6, ids.shape[1] - 1)


def test_curriculum_caps_row_length(tok, text_ids):
    rows = _rows(tok, text_ids, start_len=200, max_len=1000, ramp_steps=100, min_len=100, fit_short_rows=True)
    assert (rows.max_len_at(0), rows.max_len_at(50), rows.max_len_at(100),
            rows.max_len_at(10**6)) == (200, 600, 1000, 1000)
    lengths = [(r != tok.pad_token_id).sum().item() for r in rows.batch(0)[0]]
    assert max(lengths) <= 200 * 1.3  # lengths come from average token rates: some slack


def test_loader_workers_do_not_change_the_data(tok, text_ids):
    import torch

    cfg = DenseConfig(seed=1, batch_size=3)
    one = list(torch.utils.data.DataLoader(DenseDataset(tok, text_ids, shipped_text(), cfg, 0, 4), batch_size=None))
    two = list(torch.utils.data.DataLoader(DenseDataset(tok, text_ids, shipped_text(), cfg, 0, 4), batch_size=None,
                                           num_workers=2))
    assert len(one) == len(two) == 4
    assert all((x == y).all() for b1, b2 in zip(one, two) for x, y in zip(b1, b2))


def test_demo_retrieval_examples_fit_the_window(tok):
    rows = retrieval_examples(tok, 512, 6, seed=0)
    assert len(rows) == 6
    assert all(len(r) <= 512 and r[0] == tok.bos_token_id for r in rows)
    assert retrieval_examples(tok, 512, 6, seed=0) == rows
    assert retrieval_examples(tok, 512, 6, seed=1) != rows
