"""``hylo-bench make-data``: a chat-format training mixture from local text and a teacher, for offline real runs.

What it writes into ``OUT`` (every row a conversation ``{"messages": [...], "kind": ..., "source": ...}``):

* ``instructions.jsonl``: instruction rows built from passages of the text (explain, rewrite, name the word a
  definition describes, summarise, title, continue); the **teacher writes every answer** (greedy, chat template,
  at most ``max_answer_tokens``), so the KL targets are in the teacher's own style.
* ``long-<L>.jsonl`` for each stage length L: long-document rows of about L tokens (rendered with the chat
  template, within 3 % below L), in the spirit of ChatQA2-Long: a stretch of the real text as the document, and
  a question whose answer needs it:

  - ``multi_needle``: 2-6 "secret code" sentences inserted between passages, asked for together (one key with
    several codes, or several keys);
  - ``multi_hop``: a chain of "X points to Y" statements scattered through the document, asked from its start;
  - ``qa``: "how does the document define WORD?" about one or two entries of the text (the answer is the
    entry's own text).

* ``mixture.yaml``: the mixture for ``upcycle --data`` (instructions in every stage; ``long-<L>`` only in stages
  of length L, through the source's ``seq_lens``; each source weighted by its row count),
  ``decontamination.json`` and ``manifest.json``.

Seeds: every draw comes from ``random.Random("make-data:<seed>:<kind>:<L>:<i>")``, string seeds, so no stream
coincides with RULER's integer per-sample seeds. Decontamination: the RULER samples of the evaluation plan
(tasks x lengths x samples at RULER's seed) come from the ``ruler_samples`` callable the caller hands in
(``hylo-bench make-data``: RULER's own sample generator, cached where ``ruler`` reads them); a sample overlaps when
one training row placed every one of its gold answers (codes, chain ends, keys, defined words); the
report lists overlaps (expected none) and the word 13-grams shared between RULER's non-haystack prompt text and
the rows' questions.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger(__name__)

RulerSamples = Callable[..., list[dict]]
"""``ruler_samples(task, tokenizer, length_tokens, num_samples, *, seed, haystack_text, cache_dir, on_sample)``:
RULER's samples ``0 .. num_samples - 1`` of (task, length) as ``hylo-bench ruler`` draws them without a chat
template (dicts with ``index``, ``input`` and the gold ``outputs``); raises ValueError when the task cannot be
sized at that length. ``hylo-bench make-data`` passes ``tasks.ruler.cache.decontamination_samples``."""

MANIFEST = "manifest.json"
LENGTH_SLACK = 0.03  # long rows land in [0.97 L, L] tokens
LONG_KINDS = ("multi_needle", "multi_hop", "qa")
RULER_SYNTHETIC = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                   "niah_multikey_3", "niah_multivalue", "niah_multiquery", "ruler_vt", "ruler_cwe", "ruler_fwe")
"""RULER's 11 synthetic tasks (the 13 without the two QA tasks, which need SQuAD / HotpotQA files)."""


@dataclass(kw_only=True)
class MakeDataConfig:
    """Settings of ``hylo-bench make-data`` (CLI flags map 1:1)."""

    out: str
    teacher: str = "demo"
    text: list[str] = field(default_factory=list)  # text files / folders (default: the shipped book)
    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 8192])
    long_rows: int = 64  # per length
    long_tokens: int | None = None  # per length, overrides long_rows: ceil(long_tokens / L) rows at length L
    instruction_rows: int = 256
    max_answer_tokens: int = 128
    seed: int = 1
    batch_size: int = 16
    device: str | None = None
    ruler_tasks: list[str] = field(default_factory=lambda: list(RULER_SYNTHETIC))
    ruler_lengths: list[int] | None = None  # default: ``lengths``
    ruler_samples: int = 50
    ruler_seed: int = 42  # RULER's default seed: the samples `hylo-bench ruler` scores
    ruler_results_dir: str | None = None  # where ``ruler --results-dir`` will read its sample cache (default OUT)
    overwrite: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    def rows_at(self, length: int) -> int:
        """Long-document rows at stage length ``length`` (tokens): ``ceil(long_tokens / length)`` when
        ``long_tokens`` is set (the same tokens at every length, so a short stage does not repeat its few rows
        more often than a long one), else ``long_rows``."""
        return self.long_rows if self.long_tokens is None else -(-self.long_tokens // length)


def _rng(seed: int, *parts: Any) -> random.Random:
    return random.Random(":".join(["make-data", str(seed), *map(str, parts)]))


# --- text pieces -------------------------------------------------------------------------------------------------

_ENTRY = re.compile(r"^([A-Z][A-Z'\- ]{1,40}), ((?:n|v|adj|adv|pp|pron|prep|conj|interj|x)\.(?:[a-z.]*))\s+(.*)$",
                    re.S)


def read_passages(paths: list[str]) -> list[tuple[str, str]]:
    """``(id, passage)`` blank-line blocks of the text files (default: the shipped book).

    Raises:
        FileNotFoundError: a missing path. ValueError: no text.
    """
    from hylo_bench.upcycle.documents import load_documents_with_ids, shipped_text_path

    docs = []
    for p in paths or [str(shipped_text_path())]:
        docs += [(i, d) for i, d in load_documents_with_ids(p) if isinstance(d, str)]
    docs = [(i, " ".join(d.split())) for i, d in docs]
    docs = [(i, d) for i, d in docs if len(d.split()) >= 4]
    if not docs:
        raise ValueError(f"--text {', '.join(paths)}: no text passages found")
    return docs


def entries(passages: list[tuple[str, str]]) -> list[tuple[int, str, str]]:
    """``(passage index, WORD, definition)`` of the passages that are dictionary entries ("WORD, n. ...")."""
    out = []
    for k, (_, p) in enumerate(passages):
        m = _ENTRY.match(p)
        if m and len(m.group(3).split()) >= 3:
            out.append((k, m.group(1).strip(), m.group(3).strip()))
    return out


def _words(text: str, n: int) -> str:
    w = text.split()
    return " ".join(w[:n]) + (" ..." if len(w) > n else "")


# --- instruction rows (teacher answers) --------------------------------------------------------------------------

def instruction_prompts(passages: list[tuple[str, str]], n: int, seed: int) -> list[tuple[str, str, str]]:
    """``n`` ``(family, source id, user prompt)`` triples drawn from the passages."""
    ents = entries(passages)
    out = []
    for i in range(n):
        rng = _rng(seed, "instruction", i)
        family = rng.choice(["explain", "rewrite", "which_word", "summary", "title", "continue"]
                            if ents else ["summary", "title", "continue"])
        if family in ("explain", "rewrite", "which_word"):
            k, word, definition = rng.choice(ents)
            src = passages[k][0]
            entry = _words(passages[k][1], 120)
            prompt = {"explain": f"Here is an entry from a satirical dictionary:\n\n{entry}\n\nExplain the joke in "
                                 f"one or two sentences.",
                      "rewrite": f"Rewrite this definition in plain modern English:\n\n{entry}",
                      "which_word": f"Which word does this satirical definition describe? Answer with the word and "
                                    f"one sentence of explanation.\n\n{_words(definition, 80)}"}[family]
        else:
            k = rng.randrange(len(passages))
            span = " ".join(p for _, p in passages[k:k + rng.randint(1, 3)])
            src = passages[k][0]
            if family == "continue":
                w = span.split()
                cut = max(4, len(w) // 2)
                prompt = f"Continue the following text for a few sentences:\n\n{' '.join(w[:min(cut, 150)])}"
            else:
                ask = "Summarize the following passage in one sentence." if family == "summary" else \
                    "Give a short title for the following passage."
                prompt = f"{ask}\n\n{_words(span, 200)}"
        out.append((family, src, prompt))
    return out


def teacher_answers(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int,
                    on_batch: Callable[[int], None] | None = None) -> list[str]:
    """Greedy answers of a chat model to user prompts (chat template with the generation prompt, batched)."""
    from hylo_bench.decode.greedy import generate_batch

    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         tokenize=False) for p in prompts]
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in ids]
    out: list[str] = []
    for i in range(0, len(ids), batch_size):
        out += [a.strip() for a in generate_batch(model, tokenizer, ids[i:i + batch_size], max_new_tokens)]
        if on_batch:
            on_batch(len(ids[i:i + batch_size]))
    return out


# --- long-document rows ------------------------------------------------------------------------------------------

@dataclass
class LongRow:
    kind: str
    document_parts: list[str]  # passages and inserted statements, in order
    question: str
    answer: str
    placed: list[str]  # values this row placed (codes, chain ends, asked keys)
    source: str


def _code(rng: random.Random) -> str:
    return f"{rng.randint(0, 999):03d}-{rng.randint(0, 9999):04d}"  # not RULER's 7-digit numbers


def _key(rng: random.Random) -> str:
    from hylo_bench.text.haystack import random_word

    return random_word(rng).replace("-", " ")


def _insert(rng: random.Random, parts: list[str], sentences: list[str]) -> list[str]:
    out = list(parts)
    for s in sentences:
        out.insert(rng.randint(0, len(out)), s)
    return out


def long_row(kind: str, rng: random.Random, passages: list[tuple[str, str]], n_passages: int, start: int,
             max_words: int | None = None, length: int = 8192) -> LongRow:
    """One long row of ``kind`` over ``n_passages`` consecutive passages from ``start`` (wrapping); ``max_words``
    cuts the last passage to that many words (to fill a row to its length). Rows for short ``length`` (tokens)
    carry fewer statements (at 1K: up to 3 codes per key, 4 keys, 3 hops; from 4K: 4, 6, 4)."""
    scale = 0 if length < 1024 else (1 if length < 4096 else 2)
    picked = [passages[(start + j) % len(passages)] for j in range(n_passages)]
    if max_words is not None:
        picked[-1] = (picked[-1][0], " ".join(picked[-1][1].split()[:max_words]))
        if not picked[-1][1]:
            picked.pop()
    parts = [p for _, p in picked]
    src = picked[0][0] if picked else passages[start % len(passages)][0]
    if kind == "multi_needle":
        if rng.random() < 0.5:  # one key, several codes
            key = _key(rng)
            codes = [_code(rng) for _ in range(rng.randint(2, 2 + scale))]
            stmts = [f"A secret code for the {key} is {c}." for c in codes]
            q = f"What are all the secret codes for the {key} given in the document?"
            a = f"The secret codes for the {key} are {', '.join(codes[:-1])} and {codes[-1]}."
            placed = codes + [key]
        else:  # several keys, one code each; two or three of them asked
            keys = [_key(rng) for _ in range(rng.randint(2 + min(scale, 1), 2 + 2 * scale))]
            codes = [_code(rng) for _ in keys]
            stmts = [f"The secret code for the {k} is {c}." for k, c in zip(keys, codes)]
            asked = rng.sample(range(len(keys)), rng.randint(2, min(2 + min(scale, 1), len(keys))))
            q = "What are the secret codes for " + ", ".join(f"the {keys[i]}" for i in asked[:-1]) + \
                f" and the {keys[asked[-1]]} in the document?"
            a = " ".join(f"The {keys[i]}: {codes[i]}." for i in asked)
            placed = codes + keys
        return LongRow(kind, _insert(rng, parts, stmts), q, a, placed, src)
    if kind == "multi_hop":
        hops = rng.randint(2, 2 + scale)
        names = [_key(rng) for _ in range(hops)]
        end = _code(rng)
        stmts = [f"The {names[i]} points to the {names[i + 1]}." for i in range(hops - 1)]
        stmts.append(f"The {names[-1]} points to the code {end}.")
        doc = _insert(rng, parts, stmts)
        q = (f"Start at the {names[0]} and follow the 'points to' statements in the document. Which code do you "
             f"reach, and through which steps?")
        a = " -> ".join(f"the {n}" for n in names) + f" -> {end}. The code is {end}."
        return LongRow(kind, doc, q, a, [end] + names, src)
    if kind == "qa":
        ents = [(k, w, d) for k, w, d in entries(picked)]
        if not ents:
            return long_row("multi_needle", rng, passages, n_passages, start, max_words, length)
        chosen = rng.sample(ents, min(len(ents), rng.randint(1, 2)))
        if len(chosen) == 1:
            q = f"According to the document, how is the word {chosen[0][1]} defined?"
        else:
            q = f"According to the document, how are the words {chosen[0][1]} and {chosen[1][1]} defined?"
        a = " ".join(f"{w}: {_words(d, 60)}" for _, w, d in chosen)
        return LongRow(kind, parts, q, a, [w for _, w, _ in chosen], src)
    raise ValueError(f"long row kind {kind!r}: expected one of {', '.join(LONG_KINDS)}")


def row_messages(row: LongRow) -> list[dict[str, str]]:
    doc = "\n\n".join(row.document_parts)
    return [{"role": "user", "content": f"Read the document below and answer the question after it.\n\n"
                                        f"Document:\n{doc}\n\nQuestion: {row.question}"},
            {"role": "assistant", "content": row.answer}]


def sized_long_row(kind: str, i: int, length: int, tokenizer, passages: list[tuple[str, str]],
                   passage_tokens: list[int], seed: int, chat_template: str | None = None) -> tuple[LongRow, int]:
    """A long row of ``kind`` whose rendered conversation has the most tokens <= ``length``: whole passages from an
    estimate, then the longest word prefix of the next passage that still fits. The row's draws depend only on
    (seed, kind, length, i).

    Returns:
        (row, its token count).

    Raises:
        ValueError: ``length`` too small for a row of even one passage.
    """
    start = _rng(seed, "start", kind, length, i).randrange(len(passages))
    template = chat_template or tokenizer.chat_template

    def build(n: int, max_words: int | None = None) -> tuple[LongRow, int]:
        row = long_row(kind, _rng(seed, kind, length, i), passages, n, start, max_words, length)
        text = tokenizer.apply_chat_template(row_messages(row), tokenize=False, chat_template=template)
        return row, len(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)

    avg = max(1.0, sum(passage_tokens) / len(passage_tokens))
    n = max(1, int(length * (1 - LENGTH_SLACK / 2) / (avg + 2)))
    row, count = build(n)
    while count > length and n > 1:
        n = max(1, int(n * length / count) - 1) if count > 1.2 * length else n - 1
        row, count = build(n)
    if count > length:
        n = 0  # even one passage is too long: fill from a cut first passage
    else:
        while count < (1 - LENGTH_SLACK) * length:  # grow by the missing tokens' worth of passages, then by one
            step = max(1, int(((1 - LENGTH_SLACK / 2) * length - count) / (avg + 2)))
            bigger, c = build(n + step)
            while c > length and step > 1:
                step = max(1, step // 2)
                bigger, c = build(n + step)
            if c > length:
                break
            n, row, count = n + step, bigger, c
    if n == 0 or count < (1 - LENGTH_SLACK) * length:  # fill the rest with a word prefix of the next passage
        k = (start + n) % len(passages)
        words = len(passages[k][1].split())
        base = count if n else build(0 + 1, 0)[1]  # n == 0: the row with an empty document
        per_word = max(passage_tokens[k], 1) / max(words, 1)
        w = min(words, max(0, int((length - base) / per_word * (1 - LENGTH_SLACK / 3))))
        cand, c = build(n + 1, w)
        for _ in range(8):  # a few corrections of the estimate (the tokens per word of a prefix vary)
            if c > length and w > 0:
                w = max(0, w - max(1, int((c - length) / per_word) + 1))
            elif c < (1 - LENGTH_SLACK) * length and w < words:
                grown = min(words, w + max(1, int(((1 - LENGTH_SLACK / 3) * length - c) / per_word)))
                bigger, cb = build(n + 1, grown)
                if cb > length:
                    break
                w, cand, c = grown, bigger, cb
                continue
            else:
                break
            cand, c = build(n + 1, w)
        if not (1 - LENGTH_SLACK) * length <= c <= length:  # not monotone here (a qa row's answer moved): bisect
            lo, hi = 0, words
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if build(n + 1, mid)[1] <= length:
                    lo = mid
                else:
                    hi = mid - 1
            cand, c = build(n + 1, lo)
        if c <= length and (c >= count or n == 0):
            row, count = cand, c
        if count > length:
            raise ValueError(f"--lengths {length}: a {kind} row without any text already has {count} tokens")
    return row, count


# --- decontamination against RULER -------------------------------------------------------------------------------

def _ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    w = re.sub(r"[^0-9a-z]+", " ", text.lower()).split()
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def ruler_decontamination(rows: list[dict], cfg: MakeDataConfig, tokenizer, haystack_text: str,
                          cache_dir: Path, ruler_samples: RulerSamples,
                          on_sample: Callable[[], None] | None = None) -> dict:
    """The report described in the module docstring. ``rows``: every written row (with ``placed`` values);
    ``ruler_samples``: the RULER sample source (:data:`RulerSamples`)."""

    def norm(v: Any) -> str:  # RULER keys are "adjective-noun", ours "adjective noun"
        return str(v).lower().replace("-", " ").strip()

    rows_with: dict[str, set[int]] = {}  # placed value -> the rows that hold it
    for k, r in enumerate(rows):
        for v in r.get("placed", []):
            rows_with.setdefault(norm(v), set()).add(k)
    placed = set(rows_with)
    questions = [r["messages"][0]["content"].rsplit("Question:", 1)[-1] for r in rows if r.get("kind") in LONG_KINDS]
    row_grams = set().union(*(_ngrams(q) for q in questions)) if questions else set()
    hay_grams = _ngrams(haystack_text)
    checked, overlaps, gram_hits, skipped, single_hits = 0, [], 0, [], {}
    for length in cfg.ruler_lengths or cfg.lengths:
        for task in cfg.ruler_tasks:
            try:
                samples = ruler_samples(task, tokenizer, length, cfg.ruler_samples, seed=cfg.ruler_seed,
                                        haystack_text=haystack_text, cache_dir=cache_dir, on_sample=on_sample)
            except ValueError as e:
                skipped.append({"task": task, "length": length, "reason": str(e)[:200]})
                continue
            for s in samples:
                checked += 1
                golds = [norm(g) for g in s["outputs"]]
                hits = [g for g in golds if g in placed]
                single_hits[task] = single_hits.get(task, 0) + len(hits)
                holders = set.intersection(*(rows_with.get(g, set()) for g in golds)) if golds else set()
                if holders:  # one training row holds every gold answer of this sample
                    overlaps.append({"task": task, "length": length, "index": s["index"], "golds": s["outputs"],
                                     "rows": sorted(holders)[:5]})
                gram_hits += len((_ngrams(s["input"]) - hay_grams) & row_grams)
    return {"ruler_seed": cfg.ruler_seed, "tasks": list(cfg.ruler_tasks),
            "lengths": list(cfg.ruler_lengths or cfg.lengths),
            "samples_per_task": cfg.ruler_samples, "ruler_samples_checked": checked,
            "placed_values": len(placed), "gold_overlaps": overlaps, "num_gold_overlaps": len(overlaps),
            "shared_13grams_outside_haystack": gram_hits, "skipped": skipped,
            "single_gold_hits_by_task": single_hits,
            "note": "an overlap is a RULER sample all of whose gold answers one training row placed (a code, chain "
                    "end, key or defined word); single gold words found among placed values are only counted "
                    "(single_gold_hits_by_task: CWE's golds are common words, which the QA rows' dictionary "
                    "headwords share). The long rows' documents are passages of the text RULER's essay haystack is "
                    "made of, so 13-grams shared through the haystack are expected and not counted"}


# --- the command -------------------------------------------------------------------------------------------------

def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an output folder holding files this command did not write (unless ``overwrite``).

    Raises:
        ValueError: naming what was found.
    """
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: is a file; give a folder")
    if not out.is_dir() or overwrite:
        return
    found = sorted(p.name for p in out.iterdir())
    ours = (out / MANIFEST).is_file() and json.loads((out / MANIFEST).read_text()).get("kind") == "make-data"
    if found and not ours:
        raise ValueError(f"--out {out}: holds files make-data did not write ({', '.join(found[:5])}"
                         f"{' ...' if len(found) > 5 else ''}); use a new folder or --overwrite")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    from hylo_bench.io_utils import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def mixture_spec(lengths: list[int], seed: int, rows: dict[str, int]) -> dict:
    """``mixture.yaml``: instructions in every stage, ``long-<L>`` only in stages of length L. Each source's weight
    is its row count (``rows[name]``), so every row of a stage is drawn equally often: a few hundred instruction rows
    next to thousands of long rows are not repeated ten times per pass over the long ones."""
    from hylo_bench.config.units import format_length

    def weight(name: str) -> float:
        return float(max(rows.get(name, 0), 1))

    sources = [{"name": "instructions", "path": "instructions.jsonl", "weight": weight("instructions"),
                "format": "chat"}]
    sources += [{"name": f"long-{format_length(L)}", "path": f"long-{format_length(L)}.jsonl",
                 "weight": weight(f"long-{format_length(L)}"), "format": "chat", "seq_lens": [L]} for L in lengths]
    return {"seed": seed, "sources": sources}


def make_data(cfg: MakeDataConfig, progress: Callable[[str, int], Callable[[int], None]] | None = None,
              ruler_samples: RulerSamples | None = None) -> dict:
    """Write the mixture (module docstring); returns the manifest.

    Args:
        progress: ``progress(description, total) -> advance(n)`` for a progress bar (None: silent).
        ruler_samples: the RULER sample source of the decontamination check (:data:`RulerSamples`); None skips
            the check (``decontamination.json`` says so).

    Raises:
        ValueError / FileNotFoundError: bad settings, an output folder with foreign files, a teacher without a
        chat template, unreadable text.
    """
    import yaml

    from hylo_bench.config.units import format_length
    from hylo_bench.io_utils import atomic_write_json, atomic_write_text
    from hylo_bench.models.loading import load_model

    out = Path(cfg.out)
    check_out_dir(out, cfg.overwrite)
    if not cfg.lengths or any(L < 64 for L in cfg.lengths):
        raise ValueError(f"--lengths {cfg.lengths}: expected stage lengths of at least 64 tokens")
    if (cfg.long_rows < 0 or cfg.instruction_rows < 0 or (cfg.long_tokens or 0) < 0 or cfg.max_answer_tokens < 1
            or cfg.batch_size < 1):
        raise ValueError("--long-rows / --long-tokens / --instruction-rows must be >= 0, --max-answer-tokens and "
                         "--batch-size >= 1")
    passages = read_passages(cfg.text)
    t0 = time.perf_counter()
    model, tokenizer, info = load_model(cfg.teacher, device=cfg.device)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--teacher {cfg.teacher}: its tokenizer has no chat template; make-data writes "
                         f"conversations and needs a chat (instruct) teacher")

    def noop(n: int) -> None:
        return None

    out.mkdir(parents=True, exist_ok=True)
    prompts = instruction_prompts(passages, cfg.instruction_rows, cfg.seed)
    advance = progress("teacher answers", len(prompts)) if progress else noop
    answers = teacher_answers(model, tokenizer, [p for _, _, p in prompts], cfg.max_answer_tokens, cfg.batch_size,
                              advance)
    instr = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": a}], "kind": fam,
              "source": src} for (fam, src, p), a in zip(prompts, answers) if a]
    _write_jsonl(out / "instructions.jsonl", instr)
    passage_tokens = [len(tokenizer(p, add_special_tokens=False).input_ids) for _, p in passages]
    all_rows, counts = list(instr), {"instructions": len(instr)}
    for L in cfg.lengths:
        rows = []
        advance = progress(f"long rows at {format_length(L)}", cfg.rows_at(L)) if progress else noop
        for i in range(cfg.rows_at(L)):
            kind = LONG_KINDS[i % len(LONG_KINDS)]
            row, n_tok = sized_long_row(kind, i, L, tokenizer, passages, passage_tokens, cfg.seed)
            rows.append({"messages": row_messages(row), "kind": row.kind, "source": row.source,
                         "tokens": n_tok, "placed": row.placed})
            advance(1)
        _write_jsonl(out / f"long-{format_length(L)}.jsonl", rows)
        counts[f"long-{format_length(L)}"] = len(rows)
        all_rows += rows
    atomic_write_text(out / "mixture.yaml", "# hylo-bench make-data: upcycle --data this file\n"
                      + yaml.safe_dump(mixture_spec(cfg.lengths, cfg.seed, counts), sort_keys=False))
    from hylo_bench.text.haystack import default_haystack_text

    ruler_dir = Path(cfg.ruler_results_dir or out) / "cache"
    if ruler_samples is None:
        report = {"ruler_seed": cfg.ruler_seed, "tasks": list(cfg.ruler_tasks), "ruler_samples_checked": 0,
                  "num_gold_overlaps": 0, "shared_13grams_outside_haystack": 0,
                  "note": "not checked: no RULER sample source was given (make_data(..., ruler_samples=...))"}
    else:
        n_ruler = len(cfg.ruler_tasks) * len(cfg.ruler_lengths or cfg.lengths) * cfg.ruler_samples
        advance = progress("RULER samples (decontamination)", n_ruler) if progress else noop
        report = ruler_decontamination(all_rows, cfg, tokenizer, default_haystack_text(), ruler_dir, ruler_samples,
                                       on_sample=lambda: advance(1))
    atomic_write_json(out / "decontamination.json", report)
    manifest = {"kind": "make-data", "config": cfg.to_dict(), "teacher": info, "rows": counts,
                "tokens": {f"long-{format_length(L)}": sum(r.get("tokens", 0) for r in all_rows
                                                            if r.get("kind") in LONG_KINDS and
                                                            r.get("tokens", 0) <= L and r.get("tokens", 0) >=
                                                            (1 - LENGTH_SLACK) * L - 1) for L in cfg.lengths},
               "decontamination": {k: report[k] for k in ("ruler_samples_checked", "num_gold_overlaps",
                                                          "shared_13grams_outside_haystack")},
               "seconds": round(time.perf_counter() - t0, 1), "mixture": str(out / "mixture.yaml")}
    atomic_write_json(out / MANIFEST, manifest)
    logger.info("make-data: %s rows in %s; RULER decontamination: %d samples checked, %d gold overlaps", counts,
                out, report["ruler_samples_checked"], report["num_gold_overlaps"])
    return manifest
