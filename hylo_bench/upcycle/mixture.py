"""Data mixtures (``upcycle --data mixture.yaml``): reading every source's documents and a deterministic,
resumable sampler. The file format (sources, weights, ranges, ``seq_lens``) is :mod:`hylo_bench.config.mixture`.

Splits (``range``, training-recipe.md §6.2): each source's N documents are shuffled with a ``Random`` keyed on the
seed and the data (``path`` as written, or hub id / config / split), and ``[floor(start N), floor(end N))`` is
kept; two sources on the same data with ranges [0, 0.2] and [0.2, 1] are therefore disjoint and cover it.

Sampling (:class:`MixtureSampler`): draw t picks a source with probability ``weight / sum(weights)`` (over the
sources drawn at the stage's length, ``seq_lens``) using
``u_t = blake2b-64(f"{seed}:draw:{t}") / 2**64`` (counter-based: a function of the draw index alone), then
takes that source's next document in a per-epoch permutation (``Random(f"{seed}:{i}:{epoch}")``); a source that runs out
starts its next epoch. Weights are document shares; token shares also depend on document lengths (the run
records both). The state is a small JSON-able dict (draw count, epoch and position per source):
``load_state_dict(state_dict())`` continues the same sequence. All documents are held in memory.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from pathlib import Path
from typing import TYPE_CHECKING

from hylo_bench.config.mixture import Mixture, MixtureSource, parse_mixture
from hylo_bench.upcycle.documents import DATA_SUFFIXES, read_document_file, row_document, tokenize_document

if TYPE_CHECKING:
    import torch


def _read_local(src: MixtureSource, root: Path) -> list[tuple[str, object]]:
    p = Path(src.path).expanduser()
    p = p if p.is_absolute() else root / p
    if not p.exists():
        raise FileNotFoundError(f"mixture source {src.name!r}: {p} does not exist")
    files = sorted(f for f in p.rglob("*") if f.suffix in DATA_SUFFIXES) if p.is_dir() else [p]
    docs: list[tuple[str, object]] = []
    for f in files:
        if f.suffix not in DATA_SUFFIXES:
            raise ValueError(f"mixture source {src.name!r}: {f}: unsupported file type {f.suffix!r}; use .jsonl, "
                             f".parquet or .txt")
        docs += read_document_file(f, f.name, src.text_field, src.format, _columns(src))
    return docs


def _read_hub(src: MixtureSource) -> list[tuple[str, object]]:
    """The rows of a Hub dataset through ``datasets`` (its cache first; offline without it this fails, naming the
    dataset: there is no fallback to other data)."""
    try:
        import datasets
    except ImportError as e:
        raise ValueError(f"mixture source {src.name!r}: hub dataset {src.hub!r} needs the `datasets` package "
                         f"(pip install datasets), or download it and give a local 'path'") from e
    try:
        ds = datasets.load_dataset(src.hub, src.hub_config, split=src.split)
    except Exception as e:  # noqa: BLE001 - offline, missing, gated: datasets raises many types
        raise ValueError(f"mixture source {src.name!r}: hub dataset {src.hub!r} (config {src.hub_config}, split "
                         f"{src.split!r}) could not be loaded ({type(e).__name__}: {str(e)[:200]}); on a machine "
                         f"that reaches the Hub run `huggingface-cli download --repo-type dataset {src.hub}` first, "
                         f"or give the source a local 'path' (no other data is used in its place)") from None
    where = f"hub dataset {src.hub} ({src.split})"
    return [(f"{src.split}:{n}", row_document(row, f"{where} row {n}", src.text_field, src.format, _columns(src)))
            for n, row in enumerate(ds)]


def _columns(src: MixtureSource) -> tuple[str, str] | None:
    return (src.prompt_field, src.response_field) if src.prompt_field is not None else None


def _data_key(src: MixtureSource) -> str:
    """What the split shuffle is keyed on: the data, not the source name, so that sources reading the same data
    with complementary ranges are disjoint."""
    return f"path={src.path}" if src.path is not None else f"hub={src.hub}/{src.hub_config}/{src.split}"


def load_mixture(path) -> Mixture:
    """Parse ``path`` (YAML file, or a recipe's ``{"source": file, "mixture": mapping}``) and load every enabled
    source's documents (after its ``range``).

    Raises:
        FileNotFoundError: missing YAML or local source. ValueError: bad format, missing ``datasets`` for a
        ``hub`` source, or a source with no documents (in its range).
    """
    import yaml

    if isinstance(path, dict):  # a recipe's inline mixture: {"source": recipe file, "mixture": {...}}
        p = Path(path.get("source") or ".")
        mix = parse_mixture(path.get("mixture"), f"{p}: data")
        root = p.parent
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"--data {p}: no such mixture file")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
            raise ValueError(f"--data {p}: not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
        mix = parse_mixture(raw, str(p))
        root = p.parent
    for src in mix.sources:
        docs = _read_hub(src) if src.hub is not None else _read_local(src, root)
        order = list(range(len(docs)))
        random.Random(f"{mix.seed}:{_data_key(src)}:split").shuffle(order)
        lo, hi = int(src.range[0] * len(docs)), int(src.range[1] * len(docs))
        kept = [(f"{src.name}/{docs[j][0]}", docs[j][1]) for j in order[lo:hi]]
        if not kept:
            raise ValueError(f"mixture source {src.name!r}: no documents (read {len(docs)}, range "
                             f"{list(src.range)})")
        mix.docs.append(kept)
    return mix


def _unit_hash(key: str) -> float:
    """A uniform number in [0, 1) from the 64-bit BLAKE2b digest of ``key`` (stable across runs and platforms)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2 ** 64


class MixtureSampler:
    """Deterministic weighted document stream over a :class:`Mixture` (algorithm: module docstring).

    Args:
        mixture: with documents loaded. seed: the stream's seed (default: the mixture's).
    """

    def __init__(self, mixture: Mixture, seed: int | None = None, seq_len: int | None = None):
        self.mixture = mixture
        self.seed = mixture.seed if seed is None else seed
        self._cum = []
        acc = 0.0
        for p, src in zip(mixture.probabilities, mixture.sources):
            if seq_len is None or src.seq_lens is None or seq_len in src.seq_lens:
                acc += p
            self._cum.append(acc)
        if acc == 0.0:
            raise ValueError(f"{mixture.path}: no source is drawn at {seq_len} tokens (every source's seq_lens "
                             f"leaves it out); add a source without seq_lens")
        n = len(mixture.sources)
        self.draws = 0
        self.epoch, self.pos, self.counts = [0] * n, [0] * n, [0] * n
        self._perm: dict[int, tuple[int, list[int]]] = {}

    def _order(self, i: int) -> list[int]:
        cached = self._perm.get(i)
        if cached is None or cached[0] != self.epoch[i]:
            order = list(range(len(self.mixture.docs[i])))
            random.Random(f"{self.seed}:{i}:{self.epoch[i]}").shuffle(order)
            self._perm[i] = (self.epoch[i], order)
        return self._perm[i][1]

    def next_document(self) -> tuple[int, str, str]:
        """``(source index, doc_id, text)`` of the next draw."""
        u = _unit_hash(f"{self.seed}:draw:{self.draws}")
        i = min(bisect.bisect_right(self._cum, u * self._cum[-1]), len(self._cum) - 1)
        while i > 0 and self._cum[i] == self._cum[i - 1]:  # a source not drawn at this length has zero width
            i -= 1
        order = self._order(i)
        j = order[self.pos[i]]
        self.pos[i] += 1
        if self.pos[i] == len(order):
            self.epoch[i], self.pos[i] = self.epoch[i] + 1, 0
        self.draws += 1
        self.counts[i] += 1
        doc_id, text = self.mixture.docs[i][j]
        return i, doc_id, text

    def state_dict(self) -> dict:
        """JSON-able state: seed, draws, and epoch / position / draw count per source."""
        return {"seed": self.seed, "draws": self.draws, "epoch": list(self.epoch), "pos": list(self.pos),
                "counts": list(self.counts), "sources": [s.name for s in self.mixture.sources]}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict` of a sampler over the same mixture).

        Raises:
            ValueError: when the state belongs to another mixture (source names) or seed.
        """
        names = [s.name for s in self.mixture.sources]
        if state.get("sources") != names or state.get("seed") != self.seed:
            raise ValueError(f"sampler state for sources {state.get('sources')} (seed {state.get('seed')}) does not "
                             f"match this mixture ({names}, seed {self.seed}); the mixture file changed")
        self.draws = state["draws"]
        self.epoch, self.pos, self.counts = list(state["epoch"]), list(state["pos"]), list(state["counts"])
        self._perm.clear()


def mixture_windows(sampler: MixtureSampler, tokenizer, seq_len: int, num_windows: int) -> tuple[torch.Tensor, dict]:
    """Draw documents until ``num_windows`` windows of ``seq_len`` tokens are full (EOS after each document).

    The tail of the last document drawn is dropped (the next call starts with a new document).

    Returns:
        ([num_windows, seq_len] int64 windows, ``{"docs": [...], "tokens": [...]}`` per source: documents drawn
        and tokens placed in the windows).
    """
    rows, drawn = mixture_rows(sampler, tokenizer, seq_len, num_windows)
    return rows.input_ids, drawn


def mixture_rows(sampler: MixtureSampler, tokenizer, seq_len: int, num_windows: int, chat_template: str | None = None):
    """:func:`mixture_windows` (the same windows) as ``hylo_bench.upcycle.packing.PackedRows`` with per-document
    ``position_ids`` (conversations rendered with ``chat_template`` or the tokenizer's, with their assistant mask);
    returns (rows, drawn)."""
    from hylo_bench.upcycle.packing import Packer

    packer = Packer(seq_len, num_windows, eos_id=tokenizer.eos_token_id)
    n = len(sampler.mixture.sources)
    docs, tokens = [0] * n, [0] * n
    while not packer.full:
        i, doc_id, doc = sampler.next_document()
        placed = packer.add(*tokenize_document(tokenizer, doc, chat_template, f"{sampler.mixture.path}: {doc_id}"))
        docs[i] += 1
        tokens[i] += placed
    return packer.finish(), {"docs": docs, "tokens": tokens}
