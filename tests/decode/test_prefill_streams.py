"""Several prompts prefilled at once (``Engine.prefill_rows_shared``, ``continuous_generate(prefill_streams=N)``):
each prompt's logits, latent rows and states equal its own prefill bit for bit, with and without a reused prefix,
and whole runs give the tokens of the cache-free greedy loop with the same prefill and decode counts as one prompt at
a time. On CUDA the prompts run on separate streams (GPU-marked test)."""

from __future__ import annotations

import pytest
import torch

from hylo_bench.decode.batching import BatchStats, Request, continuous_generate, shared_prefix_plan
from hylo_bench.decode.engine import Engine
from tests.decode.test_batching import LAYOUTS, _model, _naive_greedy
from tests.decode.test_prefix_sharing import _row_state, stem_prompts


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@torch.inference_mode()
def test_rows_prefilled_together_equal_each_alone(kind, device):
    model = _model(kind).to(device)
    g = torch.Generator().manual_seed(3)
    p = torch.randint(3, 97, (1, 13), generator=g)
    q = torch.cat([p[:, :8], torch.randint(3, 97, (1, 6), generator=g)], 1)  # 14 tokens, shares 2 chunks of 4 with p
    r = torch.randint(3, 97, (1, 6), generator=g)  # shorter: its chunks end before the others'
    engine = Engine(model, max_batch=4, max_context=16, prefill_chunk=4)
    (_, kept), = engine.prefill_rows_shared([(0, p, None, [8])])
    # row 0 is both q's prefix source and r's target (r listed first): the prefix is copied before anything is
    # prefilled, whatever the jobs' order
    done = engine.prefill_rows_shared([(0, r, None, []), (2, q, kept[8], [12]), (3, p, None, [4])])
    fresh = Engine(model, max_batch=1, max_context=16, prefill_chunk=4)
    for (logits, new), (row, ids, T) in zip(done, [(0, r, 6), (2, q, 14), (3, p, 13)]):
        assert torch.equal(logits, fresh.prefill_row(0, ids))
        assert all(torch.equal(x, y) for x, y in zip(_row_state(engine, row, T), _row_state(fresh, 0, T)))
    assert done[0][1] == {} and sorted(done[1][1]) == [12] and sorted(done[2][1]) == [4]
    assert done[1][1][12].row == 2 and torch.equal(done[1][1][12].ids, q[0, :12].cpu())
    # the kept states are those a lone prefill keeps at the same position
    _, alone = fresh.prefill_row_shared(0, q, keep=[12])
    for a, b in zip(done[1][1][12].linear, alone[12].linear):
        if a is not None:
            pairs = list(zip(Engine._slot_tensors(a), Engine._slot_tensors(b)))
            assert pairs and all(torch.equal(x, y) for (_, x), (_, y) in pairs)


@torch.inference_mode()
def test_prefill_rows_shared_refuses_a_repeated_row_before_any_work():
    engine = Engine(_model("gdn"), max_batch=2, max_context=16, prefill_chunk=4)
    before = [t.clone() for t in _row_state(engine, 0, 16)]
    with pytest.raises(ValueError, match=r"rows \[0, 0\] repeat"):
        engine.prefill_rows_shared([(0, torch.tensor([[5, 6, 7]]), None, []), (0, torch.tensor([[8, 9]]), None, [])])
    with pytest.raises(ValueError, match="row 2 outside the engine's batch of 2"):
        engine.prefill_rows_shared([(0, torch.tensor([[5, 6, 7]]), None, []), (2, torch.tensor([[8, 9]]), None, [])])
    p = torch.tensor([[5, 6, 7, 8, 9, 10]])
    (_, kept), = engine.prefill_rows_shared([(0, p, None, [4])])
    (_, kept1), = engine.prefill_rows_shared([(1, p, kept[4], [4])])
    before = [t.clone() for t in _row_state(engine, 0, 16)]
    with pytest.raises(ValueError, match=r"rows \[0, 1\] hold a reused prefix and also take one"):
        engine.prefill_rows_shared([(1, p, kept[4], []), (0, p, kept1[4], [])])
    assert all(torch.equal(x, y) for x, y in zip(_row_state(engine, 0, 16), before))


class _Recorder:
    """An Engine wrapper that records the rows of each prefill group (and forwards everything else)."""

    def __init__(self, engine: Engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill_rows_shared(self, jobs):
        self.calls.append([(row, reuse is not None) for row, _, reuse, _ in jobs])
        return self.engine.prefill_rows_shared(jobs)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_continuous_generate_with_prefill_streams_equals_the_naive_loop(kind):
    model = _model(kind)
    g = torch.Generator().manual_seed(11)
    prompts = stem_prompts(g)
    prompts += [torch.randint(3, 97, (n,), generator=g).tolist() for n in (7, 11, 4)]  # nothing shared
    budgets = [4, 2, 6, 3, 5, 2, 4, 3, 5, 2]
    naive = [_naive_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    reqs = [Request(ids=p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    plan = shared_prefix_plan(prompts, 4)
    counts = {}
    for streams in (1, 2, 3):
        stats = BatchStats(batch_size=3)
        engine = _Recorder(Engine(model, max_batch=3, max_context=24, prefill_chunk=4))
        got = continuous_generate(engine, reqs, stats=stats, prefill_streams=streams)
        assert got == naive
        assert stats.prefix_reused_tokens == sum(plan.shared) and stats.prefill_tokens == sum(map(len, prompts))
        assert len(stats.prefill_times_s) == stats.prefills == len(prompts)
        assert sum(stats.prefill_times_s) == pytest.approx(stats.prefill_s, rel=1e-12)
        counts[streams] = (stats.decode_steps, stats.generated_tokens)
        groups = engine.calls
        assert sum(map(len, groups)) == len(prompts) and max(map(len, groups)) <= streams
        assert len(groups) < len(prompts) if streams > 1 else len(groups) == len(prompts)
        # a prompt that reuses a prefix only ever leads its group: its predecessor must have been prefilled
        assert all(not reused for group in groups for _, reused in group[1:])
        assert all(len({row for row, _ in group}) == len(group) for group in groups)
    assert counts[2] == counts[3] == counts[1]
    with pytest.raises(ValueError, match="prefill_streams must be >= 1, got 0"):
        continuous_generate(Engine(model, max_batch=1, max_context=24, prefill_chunk=4), reqs, prefill_streams=0)


def test_groups_with_a_reusing_leader_and_first_token_finishers():
    """A group led by a prompt that reuses a prefix, with a follower written into another row, and requests that end
    at their first token inside a group (their slots go to the next requests of the same admission)."""
    model = _model("gdn")
    stem = list(range(10, 22))
    prompts = [stem[:8] + [30, 31], stem[:8] + [40, 41, 42], [60, 91, 92, 93, 94], [65, 96], [70, 3, 4],
               [75, 5, 6, 7, 8], [80, 9]]
    budgets = [3, 4, 1, 1, 5, 2, 3]  # prompts 2 and 3 end at their first token
    plan = shared_prefix_plan(prompts, 4)
    assert plan.order == list(range(7)) and plan.shared == [0, 8, 0, 0, 0, 0, 0]
    naive = [_naive_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    reqs = [Request(ids=p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    seen = {}
    for streams in (1, 2, 3):
        stats = BatchStats(batch_size=3)
        engine = _Recorder(Engine(model, max_batch=3, max_context=24, prefill_chunk=4))
        assert continuous_generate(engine, reqs, stats=stats, prefill_streams=streams) == naive
        seen[streams] = (engine.calls, stats.decode_steps, stats.prefills, stats.prefix_reused_tokens,
                         stats.generated_tokens)
    # one at a time: slots 0, 1, 2 take prompts 0, 1, 2; 2 ends at once, so slot 2 takes 3, which ends too, then 4.
    # Prompt 0 ends after decode step 2 (slot 0 -> prompt 5, one step); after step 3 slots 0 and 1 free -> 6 in 0
    assert seen[1][0] == [[(0, False)], [(1, True)], [(2, False)], [(2, False)], [(2, False)], [(0, False)],
                          [(0, False)]]
    # three at once: prompt 1 reuses prompt 0's prefix, so it leads a group of its own with prompt 2 beside it;
    # 2 ends at its first token and its slot goes to 3 (ends too) and then 4 in the same admission
    assert seen[3][0] == [[(0, False)], [(1, True), (2, False)], [(2, False)], [(2, False)], [(0, False)],
                          [(0, False)]]
    assert seen[2][0] == seen[3][0]
    assert seen[1][1:] == seen[2][1:] == seen[3][1:] == (seen[1][1], 7, 8, sum(len(t) for t in naive))
