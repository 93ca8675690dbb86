"""Training stages of an upcycling run: ``--stages 2k:ild@20M,8k@100M,64k@200M``.

Each item is ``LEN[:KIND][@TOKENS]``: a context length in tokens (``k`` = 1024, ``m`` = 1024^2), an optional
kind (``ild`` = Enhanced-ILD, ``kd`` = end-to-end KL distillation, the default) and an optional token budget
(``k``/``M``/``B`` = 10^3/10^6/10^9 tokens; default ``--tokens-per-stage``).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from hylo_bench.config.units import format_length, parse_length, parse_token_count


@dataclass(kw_only=True, slots=True)
class Stage:
    """One stage: ``kind`` in {"ild", "kd"}, context ``seq_len_tokens``, ``token_budget`` tokens in total."""

    kind: str
    seq_len_tokens: int
    token_budget: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{format_length(self.seq_len_tokens)}"

    def to_dict(self) -> dict:
        return asdict(self) | {"name": self.name}


def parse_stages(spec: str, default_budget: int) -> list[Stage]:
    """Parse ``--stages``.

    Raises:
        ValueError: on an empty spec, an unknown kind, or an ILD stage after a KD stage.
    """
    stages = []
    for item in (s for s in spec.split(",") if s.strip()):
        item = item.strip()
        m = re.fullmatch(r"\s*([^:@]+)(?::(\w+))?(?:@([^@]+))?\s*", item)
        if not m:
            raise ValueError(f"--stages item {item!r}: expected LEN[:ild|kd][@TOKENS], e.g. 2k:ild@20M")
        try:
            length = parse_length(m.group(1))
            budget = parse_token_count(m.group(3)) if m.group(3) else default_budget
        except ValueError as e:
            raise ValueError(f"--stages item {item!r}: {e}") from None
        if budget < length:
            raise ValueError(f"--stages item {item!r}: the budget of {budget} tokens is less than one sequence")
        kind = (m.group(2) or "kd").lower()
        if kind not in ("ild", "kd"):
            raise ValueError(f"--stages item {item!r}: kind {kind!r} is not 'ild' or 'kd'")
        stages.append(Stage(kind=kind, seq_len_tokens=length, token_budget=budget))
    if not stages:
        raise ValueError("--stages is empty; e.g. --stages 2k:ild,8k,64k")
    kinds = [s.kind for s in stages]
    if "ild" in kinds and "kd" in kinds and kinds.index("kd") < len(kinds) - 1 - kinds[::-1].index("ild"):
        raise ValueError(f"--stages {spec!r}: ILD stages must come before KD stages (paper §3.2)")
    return stages
