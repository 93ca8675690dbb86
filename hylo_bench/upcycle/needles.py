"""Retrieval training rows: RULER-format needle retrieval with many answers per row.

Used to train the embedded demo teacher (``scripts/make_demo_teacher.py``) and as the retrieval half of the
``--data demo`` distillation mixture (:mod:`hylo_bench.upcycle.data`).

A RULER NIAH sample has one answer (about 9 tokens) per 1K-token prompt, so a model trained on such samples alone
gets almost no signal for *retrieval* (the answer loss stays at the format-only level, see the card's build
history). A dense row keeps RULER's exact wording (intro, needle sentence, question, answer prefix) and haystacks
(the noise line or the shipped essay), but plants 1-8 needles with distinct keys and asks for several of them in a
row, each question followed by its answer::

    A special magic number is hidden ... afterwards.\\n{haystack with needles}\\n
    What is the special magic number for {k2} mentioned in the provided text? The special magic number for {k2}
    mentioned in the provided text is {v2}.\\nWhat is ... for {k1} ... is {v1}.<eos>

The first question/answer pair is exactly a RULER prompt and answer (niah_single_1/2 for one needle, the
niah_multikey_1 shape for several). Later questions add retrieval signal; the target after an intermediate answer
("\\n", the start of the next question) is not trained, so the model learns to stop (EOS) after an answer.

Rows are a pure function of ``(seed, step)`` (one ``random.Random`` per step), so the data does not depend on the
number of loader workers. Row lengths follow a curriculum: short rows first (retrieval among few distractors is
learned quickly), growing linearly to ``max_len`` over ``ramp_steps``; after the ramp a quarter of the rows sit at
1024 tokens, the evaluation length.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from hylo_bench.text.haystack import NEEDLE, NOISE_LINE, essay_words, random_number, random_word, split_sentences

INTRO = ("A special magic number is hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the number afterwards.\n")
QUESTION = ("\nWhat is the special magic number for {key} mentioned in the provided text? "
            "The special magic number for {key} mentioned in the provided text is")


def group_digits(tok, group: int = 3):
    """Re-split numbers into runs of up to ``group`` digits (left to right, as Llama 3 / GPT-4 tokenizers do).

    ``tok`` is a ``tokenizers.Tokenizer`` whose pre-tokenizer isolates single digits (no merges involve digits).
    The pre-tokenizer becomes ``Split(\\d{1,group}, isolated)`` then byte-level, and every 2..group-digit string
    gets a vocabulary entry and merges (``"1 2" -> "12"``, ``"12 3" -> "123"``) appended after the trained ones, so
    "1234567" encodes as "123", "456", "7". Ids of existing tokens do not change. Returns a new Tokenizer.
    """
    import json

    from tokenizers import Regex, Tokenizer, pre_tokenizers

    if group == 1:
        return tok
    data = json.loads(tok.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    as_pairs = bool(merges) and isinstance(merges[0], list)
    next_id = max(vocab.values()) + 1
    for width in range(2, group + 1):
        for n in range(10**width):
            s = f"{n:0{width}d}"
            if s in vocab:
                continue
            vocab[s] = next_id
            next_id += 1
            merges.append([s[:-1], s[-1]] if as_pairs else f"{s[:-1]} {s[-1]}")
    new = Tokenizer.from_str(json.dumps(data))
    new.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(rf"\d{{1,{group}}}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return new


@dataclass(kw_only=True)
class DenseConfig:
    """Knobs of :class:`DenseRows` (lengths in tokens)."""

    seed: int
    batch_size: int
    min_len: int = 128
    max_len: int = 1536
    ramp_steps: int = 2000
    start_len: int = 256
    text_frac: float = 0.1
    max_needles: int = 8
    single_query_frac: float = 0.4
    fit_short_rows: bool = False
    """Cap needles and questions so short rows keep their length (off in the shipped demo teacher's build, which
    predates it; on for the distillation data)."""


class DenseRows:
    """Batches ``(ids [B, T], ans [B, T-1], ctx [B, T-1])`` for step ``s`` (see the module docstring).

    ``ans`` marks answer targets (the space, the number, the period, and EOS after the last answer); ``ctx`` marks
    the other targets (prompt and plain-text rows, trained with a small LM weight). Padding and the target after
    an intermediate answer are in neither.
    """

    def __init__(self, tokenizer, text_ids: np.ndarray, essay: str, cfg: DenseConfig):
        self.tok = tokenizer
        self.text, self.cfg = text_ids, cfg
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.words = essay_words(essay)
        n = len(self._encode([" ".join(self.words[:20000])])[0])
        self.tokens_per_word = n / 20000
        self.tokens_per_line = len(self._encode(["\n" + NOISE_LINE])[0])

    def _encode(self, pieces: list[str]) -> list[list[int]]:
        return self.tok(pieces, add_special_tokens=False, verbose=False).input_ids

    def max_len_at(self, step: int) -> int:
        c = self.cfg
        return min(c.max_len, int(c.start_len + (c.max_len - c.start_len) * step / max(1, c.ramp_steps)))

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        rng = random.Random(c.seed * 1_000_003 + step)
        top = self.max_len_at(step)
        rows = []
        for _ in range(c.batch_size):
            if rng.random() < c.text_frac:
                rows.append(self._text_row(rng, top))
                continue
            length = 1024 if step >= c.ramp_steps and rng.random() < 0.25 else rng.randint(min(c.min_len, top), top)
            rows.append(self.needle_row(rng, length))
        width = max(len(r[0]) for r in rows)
        ids = np.full((len(rows), width), self.pad, np.int64)
        ans = np.zeros((len(rows), width - 1), np.float32)
        ctx = np.zeros((len(rows), width - 1), np.float32)
        for i, (seq, a, x) in enumerate(rows):
            ids[i, :len(seq)] = seq
            ans[i, :len(seq) - 1] = a
            ctx[i, :len(seq) - 1] = x
        return torch.from_numpy(ids), torch.from_numpy(ans), torch.from_numpy(ctx)

    def _text_row(self, rng: random.Random, length: int):
        off = rng.randrange(len(self.text) - length)
        seq = np.concatenate([[self.bos], self.text[off:off + length - 1]]).astype(np.int64)
        return seq, np.zeros(len(seq) - 1, np.float32), np.ones(len(seq) - 1, np.float32)

    def needle_row(self, rng: random.Random, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One row of about ``length`` tokens (BOS first, EOS last): ``(ids [n], ans [n-1], ctx [n-1])``, the masks
        over next-token targets. The length is estimated from average token rates, so a row can miss it by a
        few percent either way."""
        c = self.cfg
        m = 1 if rng.random() < 0.35 else rng.randint(2, c.max_needles)
        keys: list[str] = []
        while len(keys) < m:
            k = random_word(rng)
            if k not in keys:
                keys.append(k)
        values = [random_number(rng) for _ in range(m)]
        needles = [NEEDLE.format(type_needle_v="numbers", key=k, value=v) for k, v in zip(keys, values)]
        q = 1 if rng.random() < c.single_query_frac else rng.randint(1, m + 1)
        if c.fit_short_rows:  # fewer needles/questions where their fixed text (~32 + 20 per needle + 42 per
            m_fit = max(1, (length - 74) // 62)  # question tokens) would not fit the length
            if m > m_fit:
                m, keys, values, needles = m_fit, keys[:m_fit], values[:m_fit], needles[:m_fit]
            q = max(1, min(q, (length - 32 - 20 * m) // 42))
        asked = [rng.randrange(m) for _ in range(q)]
        overhead = 32 + 20 * m + 42 * q
        budget = max(0, length - overhead)
        if rng.random() < 0.4:  # noise haystack (niah_single_1), needles on their own lines
            lines = [NOISE_LINE] * max(1, int(budget / self.tokens_per_line))
            for idx, needle in zip(sorted(rng.sample(range(len(lines) + 1), m), reverse=True) if m <= len(lines) + 1
                                   else [len(lines)] * m, needles):
                lines.insert(idx, needle)
            context = "\n".join(lines)
        else:  # essay haystack (niah_single_2, niah_multikey_1): from the start (as RULER) or a random offset
            n = max(1, int(budget / self.tokens_per_word))
            start = 0 if rng.random() < 0.5 else rng.randrange(max(1, len(self.words) - n))
            sents = split_sentences(" ".join(self.words[start:start + n]))
            cuts = sorted(rng.randint(0, len(sents)) for _ in range(m))
            parts, prev = [], 0
            for cut, needle in zip(cuts, needles):
                parts += sents[prev:cut] + [needle]
                prev = cut
            context = " ".join(parts + sents[prev:])
        pieces = [INTRO + context]
        kinds = ["ctx"]
        for i in asked:
            pieces += [QUESTION.format(key=keys[i]), f" {values[i]}."]
            kinds += ["ctx", "ans"]
        enc = self._encode(pieces)
        seq = [self.bos]
        ans, ctx = [], []
        for j, (e, kind) in enumerate(zip(enc, kinds)):
            n = len(e)
            first_of_question = kind == "ctx" and j > 1
            ans += [1.0 if kind == "ans" else 0.0] * n
            ctx += [0.0 if kind == "ans" else 1.0] * n
            if first_of_question:  # the "\n" after an intermediate answer: not trained (EOS comes after the last)
                ctx[len(seq) - 1] = 0.0
            seq += e
        seq.append(self.eos)
        ans.append(1.0)
        ctx.append(0.0)
        return np.asarray(seq, np.int64), np.asarray(ans, np.float32), np.asarray(ctx, np.float32)


class _RustTokenizer:
    """The part of an HF fast tokenizer :class:`DenseRows` uses, rebuilt from its JSON inside a loader worker
    (sending the HF object to forked workers left them hanging at exit)."""

    def __init__(self, tokenizer_json: str, bos: int, eos: int, pad: int | None):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos, eos, pad

    def __call__(self, pieces: list[str], add_special_tokens: bool = False, verbose: bool = False):
        from types import SimpleNamespace

        enc = self.tok.encode_batch(pieces, add_special_tokens=add_special_tokens)
        return SimpleNamespace(input_ids=[e.ids for e in enc])


class DenseDataset(torch.utils.data.IterableDataset):
    """Steps ``start .. stop-1`` of :class:`DenseRows`, split round-robin over loader workers (order-stable).

    ``tokenizer`` is an HF fast tokenizer; workers rebuild it from its JSON.
    """

    def __init__(self, tokenizer, text_ids: np.ndarray, essay: str, cfg: DenseConfig, start: int, stop: int):
        super().__init__()
        self.tok_args = (tokenizer.backend_tokenizer.to_str(), tokenizer.bos_token_id, tokenizer.eos_token_id,
                         tokenizer.pad_token_id)
        self.text_ids, self.essay, self.cfg, self.start, self.stop = text_ids, essay, cfg, start, stop

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        rows = DenseRows(_RustTokenizer(*self.tok_args), self.text_ids, self.essay, self.cfg)
        for step in range(self.start + wid, self.stop, nw):
            yield rows.batch(step)
