"""N-gram decontamination of distillation data against evaluation sets (``upcycle --decontam DIR``).

A training document is dropped when it shares at least one word 13-gram with any evaluation text
(training-recipe.md §6.3: hylo-bench runs its own n-gram overlap check; 13-grams as in the GPT-3 paper,
arXiv 2005.14165 App. C, and lm-eval's decontamination tooling).

Normalisation, applied identically to both sides (:func:`normalize_words`): ``str.lower()``; every character
for which ``str.isalnum()`` is false (punctuation, symbols, whitespace, control characters) becomes a space;
split on whitespace. So ``"Don't stop!"`` -> ``["don", "t", "stop"]`` and ``"3.14"`` -> ``["3", "14"]``. No
Unicode normalisation, no stemming, no stop-word removal. Texts with fewer than 13 words yield no 13-gram:
they never cause (and are never subject to) a drop.

Evaluation texts (:func:`load_eval_texts`): for a directory, every ``<task>/<split>.jsonl`` file directly below
it (the ``hylo-bench eval --data-dir`` layout; every split present is used) and every ``.txt`` file anywhere
below it; a single ``.jsonl`` or ``.txt`` file is also accepted. Each string field of a JSONL row (nested
lists and dicts included) is a separate text, so no n-gram spans two fields; a ``.txt`` file is split into
documents at blank lines. RULER prompts are synthetic and are not covered (its QA tasks draw from SQuAD v2 dev
and HotpotQA dev: pass those rows as files to cover them).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hylo_bench.io_utils import atomic_write_json
from hylo_bench.upcycle.documents import split_documents

logger = logging.getLogger(__name__)

NGRAM_WORDS = 13
REPORT_FILE = "decontamination.json"
NORMALISATION = ("lowercase (str.lower); characters with str.isalnum() false -> space; split on whitespace; "
                 "word n-grams")


def normalize_words(text: str) -> list[str]:
    """Words of ``text`` after the module's normalisation (lowercase, non-alphanumerics -> space, split)."""
    return "".join(c if c.isalnum() else " " for c in text.lower()).split()


def word_ngrams(words: list[str], n: int = NGRAM_WORDS) -> list[str]:
    """All contiguous n-word windows of ``words``, each joined with single spaces (empty when fewer than n)."""
    return [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _jsonl_texts(path: Path, label: str) -> list[tuple[str, str, str]]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--decontam {path}:{n}: not a JSON line ({e})") from e
        out += [(label, f"line {n}", s) for s in _strings(row)]
    return out


def load_eval_texts(path: str | Path) -> list[tuple[str, str, str]]:
    """Evaluation texts as ``(source, row, text)``: source ``"<task>/<split>"`` (JSONL: the file's folder and
    stem) or the file's path relative to ``path`` (text files), row ``"line N"`` or ``"block N"`` (1-based).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a bad JSON line (file and line named), an unsupported single file, or no evaluation text.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"--decontam {p}: no such file or directory; expected DIR/<task>/<split>.jsonl "
                                f"(as for `hylo-bench eval --data-dir`) and/or .txt files")
    texts: list[tuple[str, str, str]] = []
    if p.is_file():
        if p.suffix not in (".jsonl", ".txt"):
            raise ValueError(f"--decontam {p}: unsupported file type {p.suffix!r}; use .jsonl or .txt")
        jsonl, txt, root = ([p], [], p.parent) if p.suffix == ".jsonl" else ([], [p], p.parent)
    else:
        jsonl, txt, root = sorted(p.glob("*/*.jsonl")), sorted(p.rglob("*.txt")), p
    for f in jsonl:
        texts += _jsonl_texts(f, f"{f.parent.name}/{f.stem}")
    for f in txt:
        label = str(f.relative_to(root))
        texts += [(label, f"block {k}", d) for k, d in enumerate(split_documents(f.read_text(encoding="utf-8")), 1)]
    if not texts:
        raise ValueError(f"--decontam {p}: no evaluation text found (expected <task>/<split>.jsonl files or .txt "
                         f"files)")
    return texts


@dataclass
class EvalIndex:
    """Word n-grams of the evaluation texts: ``ngrams[g] = (source, row)`` of the first text containing g."""

    n: int = NGRAM_WORDS
    ngrams: dict[str, tuple[str, str]] = field(default_factory=dict)
    texts_per_source: Counter = field(default_factory=Counter)
    short_texts_per_source: Counter = field(default_factory=Counter)

    @classmethod
    def build(cls, texts: list[tuple[str, str, str]], n: int = NGRAM_WORDS) -> EvalIndex:
        """Index ``(source, row, text)`` triples (from :func:`load_eval_texts`)."""
        idx = cls(n=n)
        for source, row, text in texts:
            grams = word_ngrams(normalize_words(text), n)
            idx.texts_per_source[source] += 1
            if not grams:
                idx.short_texts_per_source[source] += 1
            for g in grams:
                idx.ngrams.setdefault(g, (source, row))
        return idx

    def first_match(self, text: str) -> tuple[str, str, str] | None:
        """``(ngram, source, row)`` of the first n-gram of ``text`` found in the index, else None."""
        for g in word_ngrams(normalize_words(text), self.n):
            hit = self.ngrams.get(g)
            if hit is not None:
                return g, hit[0], hit[1]
        return None


def decontaminate(docs: list[tuple[str, str]], index: EvalIndex) -> tuple[list[tuple[str, str]], dict]:
    """Drop the documents that share an n-gram with the index.

    Args:
        docs: ``(doc_id, text)`` training documents, in order.
        index: from :meth:`EvalIndex.build`.

    Returns:
        (kept documents in their order, report ``{"ngram_words", "normalisation", "num_docs", "num_dropped",
        "dropped_by_source", "dropped": [{"doc_id", "eval_source", "eval_row", "ngram"}], "eval_sources"}``).
    """
    kept, dropped = [], []
    for doc_id, text in docs:
        hit = index.first_match(text)
        if hit is None:
            kept.append((doc_id, text))
        else:
            dropped.append({"doc_id": doc_id, "eval_source": hit[1], "eval_row": hit[2], "ngram": hit[0]})
    report = {"ngram_words": index.n, "normalisation": NORMALISATION, "num_docs": len(docs),
              "num_dropped": len(dropped), "dropped_by_source": dict(Counter(d["eval_source"] for d in dropped)),
              "dropped": dropped,
              "eval_sources": {s: {"texts": c, f"texts_under_{index.n}_words": index.short_texts_per_source[s]}
                               for s, c in sorted(index.texts_per_source.items())},
              "num_eval_ngrams": len(index.ngrams)}
    return kept, report


def decontaminate_documents(docs: list[tuple[str, str]], eval_paths: list[str], out_dir: str | Path | None = None,
                            n: int = NGRAM_WORDS) -> tuple[list[tuple[str, str]], dict]:
    """Load the evaluation sets, drop contaminated training documents, log and save the report.

    Args:
        docs: ``(doc_id, text)`` training documents. eval_paths: ``--decontam`` paths (directories or files).
        out_dir: when given, the report is written to ``out_dir/decontamination.json`` (atomic).

    Returns:
        (kept documents, report with ``"eval_paths"`` added).

    Raises:
        FileNotFoundError / ValueError: from :func:`load_eval_texts`; ValueError when every document is dropped.
    """
    texts = [t for path in eval_paths for t in load_eval_texts(path)]
    kept, report = decontaminate(docs, EvalIndex.build(texts, n))
    report = {"eval_paths": [str(p) for p in eval_paths]} | report
    if out_dir is not None:
        atomic_write_json(Path(out_dir) / REPORT_FILE, report)
    by_source = ", ".join(f"{k}: {v}" for k, v in report["dropped_by_source"].items()) or "none"
    logger.info("decontamination (%d-gram overlap with %s): dropped %d of %d training documents (%s)", n,
                ", ".join(report["eval_paths"]), report["num_dropped"], report["num_docs"], by_source)
    for d in report["dropped"][:20]:
        logger.info("  dropped %s: shares %r with %s %s", d["doc_id"], d["ngram"], d["eval_source"], d["eval_row"])
    if not kept:
        raise ValueError(f"--decontam {', '.join(report['eval_paths'])}: every one of the {len(docs)} training "
                         f"documents shares a {n}-gram with the evaluation sets; check --data")
    return kept, report
