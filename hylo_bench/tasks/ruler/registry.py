"""RULER task registry: the task table of ruler.md section 2, loaded from ``hylo_bench/tasks/ruler_tasks.yaml``."""

from __future__ import annotations

import dataclasses
import importlib.resources
from types import MappingProxyType
from typing import Mapping

import yaml

GENERATORS = ("niah", "vt", "cwe", "fwe", "qa")
"""Generators implemented in :mod:`hylo_bench.tasks.ruler.generators`."""
FLAVORS = ("nvidia", "lm-eval")
"""``nvidia``: NVIDIA/RULER as of ``c3f5e3b``; ``lm-eval``: lm-evaluation-harness 0.4.13's port (docs/ruler.md)."""

METRICS = ("string_match_all", "string_match_part")
NEEDLE_TYPES = ("words", "numbers", "uuids")
HAYSTACKS = {
    "niah": ("repeat", "essay", "needle"), "vt": ("noise",), "cwe": ("words",), "fwe": ("coded",),
    "qa": ("squad", "hotpotqa"),
}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RulerTask:
    """One RULER task (a row of ruler.md section 2).

    Attributes:
        name: lm-eval task name, e.g. ``"niah_single_1"`` or ``"ruler_vt"``.
        original_name: name in NVIDIA/RULER ``scripts/synthetic.yaml``.
        generator: ``niah`` | ``vt`` | ``cwe`` | ``fwe`` | ``qa``.
        haystack: ``repeat`` | ``essay`` | ``needle`` (NIAH), ``noise`` (VT), ``words`` (CWE), ``coded`` (FWE),
            ``squad`` | ``hotpotqa`` (QA: paragraphs of that dataset).
        key_type: needle key type (``words`` | ``numbers`` | ``uuids``), ``None`` for non-NIAH tasks.
        value_type: needle value type, ``None`` for non-NIAH tasks.
        num_keys: NIAH keys k; VT chains. ``None`` where unused.
        num_values: NIAH values per key v; VT hops per chain. ``None`` where unused.
        num_queries: NIAH keys asked q. ``None`` where unused.
        max_gen_toks: generation budget in tokens.
        metric: ``string_match_all`` or ``string_match_part``.
        target_delimiter: text between ``input`` and ``gen_prefix``.
        description: one-line summary.
    """

    name: str
    original_name: str
    generator: str
    haystack: str
    key_type: str | None
    value_type: str | None
    num_keys: int | None
    num_values: int | None
    num_queries: int | None
    max_gen_toks: int
    metric: str
    target_delimiter: str
    description: str

    def __post_init__(self) -> None:
        if self.generator not in HAYSTACKS:
            raise ValueError(f"task {self.name}: generator must be one of {GENERATORS}, got {self.generator!r}")
        if self.haystack not in HAYSTACKS[self.generator]:
            raise ValueError(
                f"task {self.name}: haystack for generator {self.generator!r} must be one of "
                f"{HAYSTACKS[self.generator]}, got {self.haystack!r}"
            )
        if self.metric not in METRICS:
            raise ValueError(f"task {self.name}: metric must be one of {METRICS}, got {self.metric!r}")
        if self.max_gen_toks < 1:
            raise ValueError(f"task {self.name}: max_gen_toks must be >= 1, got {self.max_gen_toks}")
        if self.generator == "niah":
            for field in ("key_type", "value_type"):
                if getattr(self, field) not in NEEDLE_TYPES:
                    raise ValueError(f"task {self.name}: {field} must be one of {NEEDLE_TYPES}")
            for field in ("num_keys", "num_values", "num_queries"):
                if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                    raise ValueError(f"task {self.name}: {field} must be an int >= 1 for NIAH tasks")

    @property
    def num_needle_keys(self) -> int:
        """NIAH keys actually planted: ``max(k, q)`` (lm-eval ``prepare_niah.generate_samples``)."""
        assert self.num_keys is not None and self.num_queries is not None
        return max(self.num_keys, self.num_queries)

    def to_dict(self) -> dict:
        """Plain-dict form (for results files)."""
        return dataclasses.asdict(self)


def _load_tasks() -> Mapping[str, RulerTask]:
    text = importlib.resources.files("hylo_bench.tasks").joinpath("ruler_tasks.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    return MappingProxyType({name: RulerTask(name=name, **fields) for name, fields in raw.items()})


TASKS: Mapping[str, RulerTask] = _load_tasks()
"""Read-only map task name -> :class:`RulerTask`, in lm-eval ``ruler.yaml`` order."""


def list_tasks() -> list[str]:
    """Names of the implemented RULER tasks, in lm-eval ``ruler.yaml`` order."""
    return list(TASKS)


def check_flavor(flavor: str) -> str:
    """Return ``flavor`` if it is one of :data:`FLAVORS`.

    Raises:
        ValueError: unknown flavor (the message lists the valid ones).
    """
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}; got {flavor!r}")
    return flavor


def get_task(name: str) -> RulerTask:
    """Look up a task by its lm-eval name.

    Raises:
        ValueError: unknown name (the message lists the valid names).
    """
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown RULER task {name!r}; valid tasks: {', '.join(TASKS)}") from None


LM_EVAL_TASKS: dict[str, tuple[str, str]] = {
    **{name: (name, "niah_utils") for name in (
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
        "niah_multiquery", "niah_multivalue")},
    "ruler_vt": ("ruler_vt", "vt_utils"),
    "ruler_cwe": ("ruler_cwe", "cwe_utils"),
    "ruler_fwe": ("ruler_fwe", "fwe_utils"),
    "ruler_qa_squad": ("ruler_qa_squad", "qa_utils"),
    "ruler_qa_hotpot": ("ruler_qa_hotpot", "qa_utils"),
}  # fmt: skip
"""Our task name -> (lm-eval 0.4.13 ``ruler`` subtask name, the module of ``lm_eval/tasks/ruler/`` that builds its
data). The 13 names coincide; the table is the single place that says so."""


def check_lm_eval_tasks(tasks: list[str]) -> None:
    """Raise ``ValueError`` naming the backend and the accepted names if a task has no lm-eval counterpart."""
    unknown = [t for t in tasks if t not in LM_EVAL_TASKS]
    if unknown:
        raise ValueError(f"--backend lm-eval: no lm-eval 0.4.13 ruler task for {', '.join(map(repr, unknown))}; "
                         f"accepted: {', '.join(LM_EVAL_TASKS)}")
