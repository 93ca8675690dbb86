"""First-call tuning for our Triton kernels that write state in place or whose best tile depends on data the
first call may not be typical of (Triton's ``autotune`` times the call's own arguments, restoring in-place outputs
with copies it also times). The caller times each candidate on inputs it chooses (scratch copies, a full-length
cache) and caches the winner per shape.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TypeVar

C = TypeVar("C")


def fastest(configs: Sequence[C], run: Callable[[C], None]) -> C:
    """The config whose ``run(config)`` launch is fastest by ``triton.testing.do_bench`` (milliseconds, L2 flushed
    between runs); the first under Triton's interpreter (``TRITON_INTERPRET=1``, nothing to time) or when there is
    one. Never call it while a CUDA graph is being captured."""
    if os.environ.get("TRITON_INTERPRET") == "1" or len(configs) == 1:
        return configs[0]
    from triton.testing import do_bench

    times = {cfg: do_bench(lambda cfg=cfg: run(cfg)) for cfg in configs}
    return min(times, key=times.get)
