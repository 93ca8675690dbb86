"""The data mixture format (``upcycle --data mixture.yaml``, a recipe's ``data:`` block): weighted sources.

File format (YAML)::

    seed: 42                      # optional; document order and source draws (default 42)
    sources:
      - name: general             # unique; prefixes document ids ("general/<id>")
        path: data/general.jsonl  # local .jsonl ("text" field) / .parquet / .txt file, or a directory of them
        weight: 0.7               # relative share of documents drawn (normalised over sources)
        range: [0.0, 0.2]         # optional fraction [start, end) of the source's shuffled documents
      - name: math
        hub: nvidia/OpenMathInstruct-2   # Hub dataset id, read with `datasets` (only when installed)
        hub_config: null          # optional dataset config name
        split: train              # Hub split (default train)
        text_field: text          # column holding the text (default "text"; also for .jsonl/.parquet)
        format: auto              # rows are text ("text"), conversations ("chat") or either ("auto", default)
        prompt_field: problem     # optional: read each row as a one-turn conversation from these two columns
        response_field: generated_solution
        weight: 0.3
      - name: long-qa
        hub: nvidia/ChatQA2-Long-SFT-data
        weight: 1.0
        enabled: false            # listed but not drawn (as AMD's configs list the datasets they do not enable)
      - name: long-8k
        path: long-8k.jsonl
        weight: 1.0
        seq_lens: [8192]          # drawn only in stages of these lengths (default: every stage)

Conversational rows (``messages``, ShareGPT ``conversations``, ``prompt``/``response``; ``hylo_bench.text.chat``)
are rendered with the base model's chat template (or the recipe's ``chat_template``) when packed. A recipe's
``data:`` block is a mixture in the same format (paths relative to the recipe file).

Relative paths are resolved against the YAML file's folder. ``range`` follows Zebra-Llama's split
(training-recipe.md §6.2: shuffle with a seed, ILD on the first 20 %, E2E on the rest): each source's N documents
are shuffled with a ``Random`` keyed on the seed and the data (``path`` as written, or hub id / config / split),
and ``[floor(start N), floor(end N))`` is kept; two sources on the same data with ranges [0, 0.2] and [0.2, 1]
are therefore disjoint and cover it.

The documents are read and drawn by :mod:`hylo_bench.upcycle.mixture` (the sampler); this module only parses
and validates (no torch, no data read), so recipes and ``info`` check a mixture without loading it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

FORMATS = ("auto", "text", "chat")
"""Row formats of a source: text rows, conversations, or either (hylo_bench.upcycle.data reads them)."""
_SOURCE_KEYS = {"name", "path", "hub", "hub_config", "split", "text_field", "format", "prompt_field",
                "response_field", "weight", "range", "enabled", "seq_lens"}


@dataclass(kw_only=True, slots=True)
class MixtureSource:
    """One source of a mixture (field meanings: module docstring)."""

    name: str
    weight: float
    path: str | None = None
    hub: str | None = None
    hub_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    format: str = "auto"
    prompt_field: str | None = None
    response_field: str | None = None
    range: tuple[float, float] = (0.0, 1.0)
    enabled: bool = True
    seq_lens: list[int] | None = None  # stage lengths (tokens) that draw this source; None = every stage

    def __post_init__(self):
        where = f"mixture source {self.name!r}"
        if self.format not in FORMATS:
            raise ValueError(f"{where}: format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if (self.prompt_field is None) != (self.response_field is None):
            raise ValueError(f"{where}: give both prompt_field and response_field, or neither")
        if self.prompt_field is not None:
            self.format = "chat"
        if self.seq_lens is not None and not (isinstance(self.seq_lens, list) and self.seq_lens and all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.seq_lens)):
            raise ValueError(f"{where}: seq_lens must be a non-empty list of token counts, got {self.seq_lens!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"{where}: enabled must be true or false, got {self.enabled!r}")
        if (self.path is None) == (self.hub is None):
            raise ValueError(f"{where}: give exactly one of 'path' (local file or folder) or 'hub' (dataset id)")
        if not (isinstance(self.weight, (int, float)) and self.weight > 0):
            raise ValueError(f"{where}: weight must be a positive number, got {self.weight!r}")
        lo, hi = self.range
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"{where}: range must be [start, end) with 0 <= start < end <= 1, got {list(self.range)}")


@dataclass
class Mixture:
    """A parsed mixture with its documents loaded: ``docs[i]`` = ``(doc_id, text)`` of source i, in order."""

    sources: list[MixtureSource]
    seed: int = 42
    path: str = ""
    docs: list[list[tuple[str, object]]] = field(default_factory=list)  # (doc_id, text or conversation)
    disabled: list[MixtureSource] = field(default_factory=list)  # listed with enabled: false, never drawn

    @property
    def probabilities(self) -> list[float]:
        total = sum(s.weight for s in self.sources)
        return [s.weight / total for s in self.sources]

    def to_dict(self) -> dict:
        """Settings and per-source document counts (for the manifest)."""
        return {"path": self.path, "seed": self.seed,
                "sources": [asdict(s) | {"range": list(s.range), "probability": p, "num_docs": len(d)}
                            for s, p, d in zip(self.sources, self.probabilities, self.docs)],
                "disabled_sources": [asdict(s) | {"range": list(s.range)} for s in self.disabled]}


def is_mixture(data) -> bool:
    """Whether ``--data`` names a mixture file (``.yaml`` / ``.yml``) or is an inline mixture (a recipe's
    ``data:`` mapping)."""
    return isinstance(data, dict) or str(data).lower().endswith((".yaml", ".yml"))


def parse_mixture(raw: dict, source: str = "<memory>") -> Mixture:
    """Validate a mixture dict (the YAML's content); documents are not loaded.

    Raises:
        ValueError: unknown keys, no sources, duplicate names, or a bad field (source and field named).
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("sources"), list) or not raw["sources"]:
        raise ValueError(f"{source}: expected a mapping with a non-empty 'sources' list (see "
                         f"hylo_bench/config/mixture.py for the format)")
    unknown = set(raw) - {"seed", "sources"}
    if unknown:
        raise ValueError(f"{source}: unknown top-level keys {sorted(unknown)}; expected 'seed' and 'sources'")
    sources, disabled = [], []
    for k, item in enumerate(raw["sources"]):
        if not isinstance(item, dict) or "name" not in item or "weight" not in item:
            raise ValueError(f"{source}: sources[{k}] needs at least 'name', 'weight' and 'path' or 'hub'")
        bad = set(item) - _SOURCE_KEYS
        if bad:
            raise ValueError(f"{source}: sources[{k}] ({item['name']!r}) has unknown keys {sorted(bad)}; "
                             f"allowed: {sorted(_SOURCE_KEYS)}")
        kw = dict(item)
        if "range" in kw:
            r = kw["range"]
            if not (isinstance(r, (list, tuple)) and len(r) == 2):
                raise ValueError(f"{source}: sources[{k}] range must be [start, end], got {r!r}")
            kw["range"] = (float(r[0]), float(r[1]))
        src = MixtureSource(**kw)
        (sources if src.enabled else disabled).append(src)
    if not sources:
        raise ValueError(f"{source}: every source is disabled (enabled: false); enable at least one")
    names = [s.name for s in sources + disabled]
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: source names must be unique, got {names}")
    seed = raw.get("seed", 42)
    if not isinstance(seed, int):
        raise ValueError(f"{source}: seed must be an integer, got {seed!r}")
    return Mixture(sources=sources, seed=seed, path=source, disabled=disabled)
