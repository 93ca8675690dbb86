"""Continuous batching over the native engine (greedy): a fixed batch of B slots, each holding one request's MLA
latent rows and GDN / Mamba-2 state at its own position; when a request ends (EOS, stop predicate, budget) its
slot is refilled with the next request's prefill while the other slots keep their caches, then the occupied slots
take the next decode step together.

The decode step runs the first ``n`` slots (per-row positions as a tensor), ``n`` the highest occupied slot rounded
up to a multiple of :data:`DECODE_ROW_MULTIPLE` (at most ``Engine.max_batch``): vLLM pads a decode batch to its
nearest CUDA-graph capture size the same way, so a few shapes, each one CUDA graph, serve the whole run, and a step
with its top slots free reads neither their MLA latent rows nor their linear states. Requests fill the lowest free
slots, so a task with fewer requests than slots never touches the top ones. An idle slot below ``n`` decodes a dummy
token at position 0, which touches only its own row (rewritten by the next prefill into it). Prefills run between
decode steps (``Engine.prefill_row_shared``, chunked), as vLLM schedules prefills before decodes without
chunked-prefill mixing; when several slots are free, up to ``prefill_streams`` of them are prefilled at once
(``Engine.prefill_rows_shared``, a CUDA stream each).

Each request's tokens equal those of ``Engine.generate_until`` on that prompt alone: rows never interact (MLA
attends over its own row's ``positions[b] + 1`` cache rows, linear states are per row).

Prefix sharing (``share_prefixes``, on by default; vLLM's automatic prefix caching, restricted as for its hybrid
models to whole blocks, here ``Engine.prefix_block`` tokens): requests are served in lexicographic order of their
token ids, so prompts with a common start are neighbours (the longest common prefix of a prompt with any earlier one
is the one with its predecessor), and a prompt that shares at least one whole block with its predecessor starts
from the predecessor's latent rows and linear states after those blocks (``Engine.prefill_row_shared``) instead of
prefilling them again. A prompt whose prefix a later one takes is cut there (its prefill chunk split in two), which
changes its results from an unshared prefill by floating-point rounding only; with blocks of a whole prefill chunk
the tokens are bit for bit those of an unshared prefill. RULER's haystacks make this worthwhile: the samples of a
NIAH task share the haystack up to their first needle.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch

# A decode step's rows are rounded up to a multiple of this (module docstring). 8: the fused Triton GEMVs pad 2-16 rows
# to 16 (one tuning serves 8 and 16 rows) and more rows take cuBLAS (hylo_bench.kernels.gemv, MAX_TRITON_ROWS), so
# each new size costs about one CUDA-graph capture and one MLA split-kernel tuning.
DECODE_ROW_MULTIPLE = 8


@dataclasses.dataclass(kw_only=True, slots=True)
class Request:
    """One greedy generation request.

    Attributes:
        ids: the prompt's token ids (no padding, at least one).
        max_new_tokens: most tokens to generate (>= 1).
        should_stop: called with the tokens so far after each appended token; True ends the request with that token
            kept (stop strings, as transformers' ``StoppingCriteria``).
    """

    ids: Sequence[int]
    max_new_tokens: int
    should_stop: Callable[[list[int]], bool] | None = None


@dataclasses.dataclass(kw_only=True, slots=True)
class BatchStats:
    """What one :func:`continuous_generate` call did. Times in seconds (wall clock; every step ends with the
    tokens read back to the host, which synchronises the device). ``prefill_tokens`` counts every prompt token,
    ``prefix_reused_tokens`` those taken from a shared prefix instead of prefilled, ``decode_rows`` the rows of every
    decode step summed (:func:`decode_rows`; at most ``decode_steps * batch_size``). Prompts prefilled together
    (``prefill_streams`` > 1) each count their group's wall time divided by its size in ``prefill_times_s``."""

    batch_size: int
    requests: int = 0
    prefills: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    prefix_reused_tokens: int = 0
    decode_rows: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_times_s: list[float] = dataclasses.field(default_factory=list, repr=False)
    decode_times_s: list[float] = dataclasses.field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second of prefill plus decode time."""
        total = self.prefill_s + self.decode_s
        return self.generated_tokens / total if total > 0 else None

    @property
    def requests_per_s(self) -> float | None:
        total = self.prefill_s + self.decode_s
        return self.requests / total if total > 0 else None

    def to_dict(self) -> dict:
        """The counters and totals, plus the per-prefill and per-decode-step seconds summarised (first, median,
        max: a run's first prefill at a new length pays one-time costs, cuDNN graphs and kernel tuning, and its
        first decode step the CUDA-graph capture and the GEMVs' tuning); the lists themselves stay out."""
        lists = ("prefill_times_s", "decode_times_s")
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in lists}
        out.update(tokens_per_s=self.tokens_per_s, requests_per_s=self.requests_per_s)
        for kind, times in (("prefill", self.prefill_times_s), ("decode_step", self.decode_times_s)):
            out.update({f"{kind}_first_s": times[0] if times else None,
                        f"{kind}_median_s": statistics.median(times) if times else None,
                        f"{kind}_max_s": max(times) if times else None})
        return out


def _accept(req: Request, out: list[int], token: int, stop_ids: frozenset[int]) -> bool:
    """Append ``token`` to ``out`` unless it stops the request; True when the request is finished."""
    if token in stop_ids:
        return True
    out.append(token)
    return len(out) >= req.max_new_tokens or (req.should_stop is not None and req.should_stop(out))


@dataclasses.dataclass(kw_only=True, slots=True)
class PrefixPlan:
    """The serving order and shared prefixes of :func:`continuous_generate` with ``share_prefixes``
    (:func:`shared_prefix_plan`). Positions index ``order`` (k-th request served), values are tokens.

    Attributes:
        order: request indices in serving order.
        shared: per position k, the tokens request ``order[k]`` takes from earlier requests instead of prefilling
            them (a multiple of the prefix block; 0: none).
        keep: per position k, the prefix lengths request ``order[k]``'s prefill keeps for later requests.
    """

    order: list[int]
    shared: list[int]
    keep: list[list[int]]

    @classmethod
    def unshared(cls, n: int) -> PrefixPlan:
        """n requests in input order, each prefilled whole."""
        return cls(order=list(range(n)), shared=[0] * n, keep=[[] for _ in range(n)])


def token_array(ids: Sequence[int]) -> array.array:
    """A prompt's token ids as a host ``array('q')`` (int64): built about 4x faster than a tensor from a list of a
    64K-token prompt, compared lexicographically in C, and viewed as a tensor without a copy (:func:`ids_tensor`)."""
    if isinstance(ids, array.array) and ids.typecode == "q":
        return ids
    try:
        return array.array("q", ids)
    except TypeError:  # elements that are not ints (0-d tensors, numpy scalars)
        return array.array("q", [int(t) for t in ids])


def ids_tensor(ids: array.array) -> torch.Tensor:
    """[T] int64 CPU tensor sharing ``ids``' memory (a new empty tensor for T = 0: ``torch.frombuffer`` refuses an
    empty buffer)."""
    return torch.frombuffer(ids, dtype=torch.long) if len(ids) else torch.empty(0, dtype=torch.long)


def _shared_blocks(a: memoryview, b: memoryview, m: int, block: int) -> int:
    """The longest common prefix of ``a[:m]`` and ``b[:m]``, rounded down to a multiple of ``block`` (tokens).

    Compares whole blocks in order with memoryview comparisons (C loops that keep the GIL), not torch ops: on an
    H100 host the torch version took 17 ms a 64K prompt while the prompt encoder's threads were tokenising, against
    0.2 ms on an idle CPU (``benchmarks/results/ruler_batch_h100.json``, ``host_hotspots``)."""
    k = 0
    while (k + 1) * block <= m and a[k * block : (k + 1) * block] == b[k * block : (k + 1) * block]:
        k += 1
    return k * block


def shared_prefix_plan(prompts: Sequence[Sequence[int]], block: int) -> PrefixPlan:
    """Which whole prefix blocks each prompt can take from the prompts served before it.

    Prompts are served in lexicographic order of their token ids, so the longest common prefix of a prompt with
    any earlier one is the one with its predecessor. Prompt k takes ``shared[k]``: that common prefix, capped one
    token below its own length (its last position is prefilled for the logits) and rounded down to a multiple of
    ``block``. The prefix's linear states after ``shared[k]`` tokens come from the last earlier prompt m that
    prefilled across that position (``shared[m] < shared[k]``; every prompt between m and k shares the prefix), so
    m keeps it; the latent rows come from prompt k - 1, the last one prefilled before k, whose row still holds them.

    Args:
        prompts: token ids per request. block: the engine's prefix block (``Engine.prefix_block``; tokens, >= 1).

    Returns:
        A :class:`PrefixPlan`; in input order and sharing nothing when no two prompts share a whole block.
    """
    n = len(prompts)
    arrays = [token_array(p) for p in prompts]
    order = sorted(range(n), key=arrays.__getitem__)
    views = [memoryview(arrays[r]) for r in order]
    shared = [0] + [_shared_blocks(a, b, min(len(a), len(b) - 1), block) for a, b in zip(views, views[1:])]
    if not any(shared):
        return PrefixPlan.unshared(n)
    keep: list[list[int]] = [[] for _ in range(n)]
    for k in range(1, n):
        if shared[k]:
            m = max(i for i in range(k) if shared[i] < shared[k])
            if shared[k] not in keep[m]:
                keep[m].append(shared[k])
    return PrefixPlan(order=order, shared=shared, keep=keep)


def decode_rows(occupied_top: int, max_batch: int) -> int:
    """Rows a decode step runs when slot ``occupied_top - 1`` is the highest occupied one: ``occupied_top`` rounded up
    to a multiple of :data:`DECODE_ROW_MULTIPLE`, at most ``max_batch`` (e.g. 17 of 32 slots -> 24)."""
    if not 1 <= occupied_top <= max_batch:
        raise ValueError(f"occupied_top must be in [1, {max_batch}], got {occupied_top}")
    return min(max_batch, -(-occupied_top // DECODE_ROW_MULTIPLE) * DECODE_ROW_MULTIPLE)


def continuous_generate(engine, requests: Sequence[Request], stop_ids: set[int] | frozenset[int] = frozenset(),
                        stats: BatchStats | None = None, share_prefixes: bool = True,
                        prefill_streams: int = 1) -> list[list[int]]:
    """Greedy generation of every request through ``engine``'s ``max_batch`` slots with continuous batching.

    Args:
        engine: a :class:`hylo_bench.decode.engine.Engine` (HyLo; its ``max_batch`` is the number of slots, its
            ``max_context`` must hold every prompt plus its ``max_new_tokens - 1``).
        requests: served in order (the first B fill the slots, each next one takes the first slot that frees), or,
            with ``share_prefixes``, in the order of :func:`shared_prefix_plan`.
        stop_ids: token ids that end a request (not returned), e.g. the EOS ids.
        stats: filled in place when given.
        share_prefixes: prefill whole blocks that a prompt shares with the one served before it only once (module
            docstring); the tokens are those of an unshared prefill (bit for bit when the engine's prefix block
            is its prefill chunk; else up to the rounding of the cut chunks, which can flip a near-tie).
        prefill_streams: when several slots are free, prefill up to this many of their requests at once
            (``Engine.prefill_rows_shared``: one CUDA stream each, chunks interleaved); a prompt that shares a
            prefix starts a new group (it needs its predecessor's prefill). The tokens are the same for any value.

    Returns:
        Per request (in input order) its generated token ids before the first stop token, as
        ``Engine.generate_until`` returns them.

    Raises:
        ValueError: an engine without per-row prefill (``TransformerEngine``), an empty prompt, ``max_new_tokens`` < 1,
            a request beyond the engine's ``max_context`` (checked for all requests before any work), or
            ``prefill_streams`` < 1.
    """
    if prefill_streams < 1:
        raise ValueError(f"prefill_streams must be >= 1, got {prefill_streams}")
    if not hasattr(engine, "prefill_rows_shared"):
        raise ValueError(f"continuous batching needs the HyLo Engine (per-row prefill); got {type(engine).__name__}")
    for k, req in enumerate(requests):
        if len(req.ids) < 1 or req.max_new_tokens < 1:
            raise ValueError(f"request {k}: needs >= 1 prompt token and max_new_tokens >= 1; got {len(req.ids)} "
                             f"tokens, max_new_tokens={req.max_new_tokens}")
        if len(req.ids) + req.max_new_tokens - 1 > engine.max_context:
            raise ValueError(f"request {k}: prompt {len(req.ids)} + {req.max_new_tokens} new tokens needs "
                             f"{len(req.ids) + req.max_new_tokens - 1} cache slots > max_context {engine.max_context}; "
                             f"build the Engine with a larger max_context")
    stop_ids = frozenset(stop_ids)
    B = engine.max_batch
    stats = stats if stats is not None else BatchStats(batch_size=B)
    stats.batch_size, stats.requests = B, stats.requests + len(requests)
    results: list[list[int] | None] = [None] * len(requests)
    arrays = [token_array(req.ids) for req in requests]  # host token ids, converted once
    plan = (shared_prefix_plan(arrays, engine.prefix_block) if share_prefixes
            else PrefixPlan.unshared(len(requests)))
    queue = collections.deque(enumerate(plan.order))
    kept: dict[int, object] = {}  # prefix length -> the latest RowPrefix of that length, while a queued one needs it
    uses = collections.Counter(plan.shared)  # prefix length -> requests yet to take it
    last_row = 0  # the row of the latest prefill: it holds the latent rows of any prefix the next one shares
    slot_req: list[int | None] = [None] * B
    slot_out: list[list[int]] = [[] for _ in range(B)]
    tok_host, pos_host = [0] * B, [0] * B

    def admit(free: list[int]) -> None:
        """Fill the free slots (ascending) with the next requests that do not finish at their first token, up to
        ``prefill_streams`` prefills at a time; slots left over stay idle."""
        nonlocal last_row
        free = list(free)
        while free and queue:
            group: list[tuple[int, int]] = []  # (position in the plan, request)
            while queue and len(group) < min(prefill_streams, len(free)):
                k, r = queue[0]
                if group and plan.shared[k]:  # its shared latent rows come from the previous prompt's prefill
                    break
                group.append(queue.popleft())
            t0 = time.perf_counter()
            # the previous prefill's row holds the shared latent rows: rows before a prompt's end never change while
            # it decodes, and no other prefill came since (only a group's first prompt may share)
            jobs = []
            for b, (k, r) in zip(free, group):
                n = plan.shared[k]
                jobs.append((b, ids_tensor(arrays[r])[None],
                             dataclasses.replace(kept[n], row=last_row) if n else None, plan.keep[k]))
            done = engine.prefill_rows_shared(jobs)
            tokens = [int(t) for t in torch.cat([logits.argmax(-1) for logits, _ in done]).tolist()]
            dt = (time.perf_counter() - t0) / len(jobs)  # a group's prompts share its wall time evenly
            for (b, ids, _, _), (k, r), (_, new), token in zip(jobs, group, done, tokens):
                n = plan.shared[k]
                uses[n] -= 1
                for length in [length for length in kept if length > n]:  # no later prompt shares that much
                    del kept[length]
                kept.update(new)
                for length in [length for length in kept if uses[length] <= 0]:
                    del kept[length]
                stats.prefix_reused_tokens += n
                last_row = b
                stats.prefill_times_s.append(dt)
                stats.prefill_s += dt
                stats.prefills += 1
                stats.prefill_tokens += ids.shape[1]
                req, out = requests[r], []
                if _accept(req, out, token, stop_ids):
                    results[r] = out
                    stats.generated_tokens += len(out)
                    continue
                slot_req[b], slot_out[b], tok_host[b], pos_host[b] = r, out, token, ids.shape[1]
                free.remove(b)
        for b in free:
            slot_req[b], tok_host[b], pos_host[b] = None, 0, 0

    admit(list(range(B)))
    device = engine.device
    while occupied := [b for b in range(B) if slot_req[b] is not None]:
        t0 = time.perf_counter()
        n = decode_rows(occupied[-1] + 1, B)
        tok = torch.tensor(tok_host[:n], dtype=torch.long).to(device, non_blocking=True)
        pos = torch.tensor(pos_host[:n], dtype=torch.long).to(device, non_blocking=True)
        nxt = engine.decode_step(tok, pos).tolist()
        stats.decode_times_s.append(time.perf_counter() - t0)
        stats.decode_s += stats.decode_times_s[-1]
        stats.decode_steps += 1
        stats.decode_rows += n
        finished = []
        for b in range(n):
            r = slot_req[b]
            if r is None:
                continue
            if _accept(requests[r], slot_out[b], nxt[b], stop_ids):
                results[r] = slot_out[b]
                stats.generated_tokens += len(slot_out[b])
                slot_req[b], tok_host[b], pos_host[b] = None, 0, 0
                finished.append(b)
            else:
                tok_host[b], pos_host[b] = nxt[b], pos_host[b] + 1
        if finished and queue:
            admit(finished)
    return [r if r is not None else [] for r in results]
