"""Distillation data: the run's corpus (``--data`` read once, decontaminated), the demo mixture, and fixed-length
token windows (reading documents: :mod:`hylo_bench.upcycle.documents`).

``--data`` is ``demo`` (the shipped public-domain text plus RULER-style needle-retrieval rows with several
answers each, drawn from a random stream disjoint from evaluation), or a path: a ``.txt`` file (documents
separated by blank lines), a ``.jsonl`` file (``text`` field per line), a directory of such files, or a mixture
``.yaml`` (``hylo_bench.upcycle.mixture``).
Windows are deterministic given the seed, so a resumed run sees the same batches. The ``*_rows`` variants return
the same windows as :class:`hylo_bench.upcycle.packing.PackedRows`, with ``position_ids`` that restart at every
document, so training can keep documents from attending across each other.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from hylo_bench.config.mixture import is_mixture
from hylo_bench.upcycle.decontam import decontaminate_documents
from hylo_bench.upcycle.documents import (
    Document,
    document_text,
    load_documents,
    load_documents_with_ids,
    shipped_text,
    split_documents,
    tokenize_document,
)
from hylo_bench.upcycle.mixture import MixtureSampler, load_mixture, mixture_rows
from hylo_bench.upcycle.packing import PackedRows, pack_documents, positions_from_starts

TRAIN_SEED_BASE = 10_000


def retrieval_examples(tokenizer, seq_len: int, count: int, seed: int) -> list[list[int]]:
    """``count`` needle-retrieval rows (BOS ... EOS) of at most ``seq_len`` tokens, several answers each.

    Rows come from :class:`hylo_bench.upcycle.needles.DenseRows` (RULER's NIAH wording, noise or essay haystack,
    1-8 needles, one or more questions each followed by its answer), drawn from ``random.Random(TRAIN_SEED_BASE +
    seed)``; the evaluation uses RULER's generator at seed 42, a different stream. Row lengths are spread over
    [seq_len / 2, seq_len - 16] and rows are cut at ``seq_len``.
    """
    import numpy as np

    from hylo_bench.upcycle.needles import DenseConfig, DenseRows

    rng = random.Random(TRAIN_SEED_BASE + seed)
    rows = DenseRows(tokenizer, np.zeros(0, np.int64), shipped_text(), DenseConfig(seed=TRAIN_SEED_BASE + seed,
                                                                                   batch_size=1, fit_short_rows=True))
    out = []
    for _ in range(count):
        ids, _, _ = rows.needle_row(rng, rng.randint(seq_len // 2, max(seq_len // 2, seq_len - 16)))
        out.append(ids[:seq_len].tolist())
    return out


def pack_windows(examples: list[list[int]], filler: list[int], seq_len: int) -> torch.Tensor:
    """One window per example: the example (truncated to ``seq_len``) followed by filler tokens.

    Returns:
        [len(examples), seq_len] int64 token ids.
    """
    return example_rows(examples, filler, [1] * len(filler), seq_len).input_ids


def example_rows(examples: list[list[int]], filler: list[int], filler_pos: list[int], seq_len: int) -> PackedRows:
    """:func:`pack_windows` with positions: the example is one document; the filler is read from a packed
    stream whose positions ``filler_pos`` mark its documents (0 = start), and its first piece in a row starts a
    new segment (position 0). The filler wraps around to its start when used up."""
    rows, starts = [], []
    pos = 0
    for ex in examples:
        row = ex[:seq_len]
        st = [True] + [False] * (len(row) - 1)
        need = seq_len - len(row)
        while need > 0:
            take = filler[pos:pos + need]
            if not take:
                pos = 0
                continue
            st += [True] + [p == 0 for p in filler_pos[pos + 1:pos + len(take)]]
            row = row + take
            pos += len(take)
            need -= len(take)
        rows.append(row)
        starts.append(st)
    ids = torch.tensor(rows, dtype=torch.long).view(len(rows), seq_len)
    return PackedRows(ids, positions_from_starts(torch.tensor(starts, dtype=torch.bool).view(len(rows), seq_len)),
                      num_docs=len(examples))


def text_windows(docs: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Concatenate documents (EOS between them) and cut into [N, seq_len] windows (the tail is dropped).

    Raises:
        ValueError: when the text is shorter than one window.
    """
    return text_rows(docs, tokenizer, seq_len).input_ids


def text_rows(docs: list[Document], tokenizer, seq_len: int, chat_template: str | None = None) -> PackedRows:
    """:func:`text_windows` with per-document positions (:func:`hylo_bench.upcycle.packing.pack_documents`);
    conversations are rendered with their chat template and carry the assistant mask
    (:func:`tokenize_document`).

    Raises:
        ValueError: when the text is shorter than one window.
    """
    toks = (tokenize_document(tokenizer, d, chat_template, f"document {k}") for k, d in enumerate(docs))
    rows = pack_documents(toks, seq_len, eos_id=tokenizer.eos_token_id)
    if len(rows) == 0:
        n = rows.dropped["tokens"] if rows.dropped else 0
        raise ValueError(f"the data has {n} tokens, fewer than one window of {seq_len}")
    return rows


def build_windows(data: str, tokenizer, seq_len: int, num_windows: int, seed: int,
                  docs: list[str] | None = None) -> torch.Tensor:
    """``num_windows`` training windows [num_windows, seq_len] for one stage, deterministic in ``seed``.

    ``demo``: half retrieval examples packed with text filler, half plain text windows. A path: text windows
    (cycled when the budget asks for more windows than the data holds). ``docs``: the text documents to use
    instead of reading ``data`` (e.g. after decontamination); the demo's retrieval rows are synthetic and stay.
    """
    return build_rows(data, tokenizer, seq_len, num_windows, seed, docs).input_ids


def build_rows(data: str, tokenizer, seq_len: int, num_windows: int, seed: int,
               docs: list[Document] | None = None, chat_template: str | None = None) -> PackedRows:
    """:func:`build_windows` (the same windows) with per-document ``position_ids`` (and the assistant mask of
    conversations, rendered with ``chat_template`` or the tokenizer's)."""
    rng = random.Random(seed)
    if data == "demo":
        text = text_rows(docs if docs is not None else split_documents(shipped_text()), tokenizer, seq_len)
        examples = retrieval_examples(tokenizer, seq_len, num_windows // 2, seed)
        if examples:
            ret = example_rows(examples, text.input_ids.flatten().tolist(), text.position_ids.flatten().tolist(),
                               seq_len)
        else:
            ret = PackedRows(torch.empty(0, seq_len, dtype=torch.long), torch.empty(0, seq_len, dtype=torch.long))
        idx = [rng.randrange(len(text)) for _ in range(num_windows - len(ret))]
        rows = PackedRows(torch.cat([ret.input_ids, text.input_ids[idx]]),
                          torch.cat([ret.position_ids, text.position_ids[idx]]), text.splits, text.dropped,
                          text.num_docs + len(examples))
    else:
        text = text_rows(docs if docs is not None else load_documents(data), tokenizer, seq_len, chat_template)
        rows = text.select([i % len(text) for i in range(num_windows)])
    order = list(range(len(rows)))
    rng.shuffle(order)
    return rows.select(order)


@dataclass
class Corpus:
    """A run's ``--data`` once read: plain documents (``docs``, None = read ``data`` lazily as before) or a
    mixture (``hylo_bench.upcycle.mixture``), after ``--decontam`` when given (``decontam_report``)."""

    data: Any  # the --data string, or a recipe's inline mixture mapping
    docs: list[Document] | None = None
    mixture: Any = None
    decontam_report: dict | None = None
    chat_template: str | None = None  # for conversations (None: the tokenizer's)

    def windows(self, tokenizer, seq_len: int, num_windows: int, seed: int) -> torch.Tensor:
        """[num_windows, seq_len] windows deterministic in ``seed`` (a mixture: a fresh sampler with that seed)."""
        return self.rows(tokenizer, seq_len, num_windows, seed).input_ids

    def rows(self, tokenizer, seq_len: int, num_windows: int, seed: int) -> PackedRows:
        """:meth:`windows` with per-document ``position_ids`` (``hylo_bench.upcycle.packing``)."""
        if self.mixture is not None:
            sampler = MixtureSampler(self.mixture, seed=seed, seq_len=seq_len)
            return mixture_rows(sampler, tokenizer, seq_len, num_windows, self.chat_template)[0]
        return build_rows(self.data, tokenizer, seq_len, num_windows, seed, docs=self.docs,
                          chat_template=self.chat_template)


def load_corpus(data, decontam: list[str] | None = None, chat_template: str | None = None) -> Corpus:
    """Read ``--data`` (a mixture ``.yaml`` or a recipe's inline mixture mapping is loaded with its documents) and
    apply ``--decontam``.

    Without ``decontam`` plain data is left to :func:`build_windows` (read per call, as before). With it, the
    documents (of every mixture source; ids ``<source>/<id>``) are filtered by ``decontam.decontaminate_documents``
    (a conversation is compared by its turns' text).

    Raises:
        FileNotFoundError / ValueError: unreadable data, mixture or eval sets (messages name the flag).
    """
    mixture = load_mixture(data) if is_mixture(data) else None
    if not decontam:
        return Corpus(data=data, mixture=mixture, chat_template=chat_template)

    def check(docs):
        kept, report = decontaminate_documents([(i, document_text(d)) for i, d in docs], list(decontam))
        keep = {doc_id for doc_id, _ in kept}
        return [(i, d) for i, d in docs if i in keep], report

    if mixture is None:
        kept, report = check(load_documents_with_ids(data))
        return Corpus(data=data, docs=[d for _, d in kept], decontam_report=report, chat_template=chat_template)
    kept, report = check([d for src in mixture.docs for d in src])
    keep = {doc_id for doc_id, _ in kept}
    for k, src in enumerate(mixture.docs):
        mixture.docs[k] = [d for d in src if d[0] in keep]
        if not mixture.docs[k]:
            raise ValueError(f"--decontam: every document of mixture source {mixture.sources[k].name!r} was dropped")
    return Corpus(data=data, mixture=mixture, decontam_report=report, chat_template=chat_template)
