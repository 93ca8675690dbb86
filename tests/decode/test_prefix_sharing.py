"""Prefix sharing in continuous batching: the serving plan (exact orders and token counts), the engine's prefill from
a kept prefix (bitwise equal to a full prefill: logits, latent rows, linear states), and whole runs whose tokens
equal a cache-free greedy loop, for MLA+GDN, MLA+Mamba-2 and q/k-norm MLA."""

from __future__ import annotations

import pytest
import torch

from hylo_bench.decode.batching import (
    BatchStats,
    PrefixPlan,
    Request,
    continuous_generate,
    ids_tensor,
    shared_prefix_plan,
    token_array,
)
from hylo_bench.decode.engine import Engine
from tests.decode.test_batching import LAYOUTS, _model, _naive_greedy

A = [5, 6, 7, 8, 9, 10, 11, 12, 13, 40, 41]
B = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 50, 51, 52]
C = [20, 21, 22]
D = [5, 6, 7, 8, 9, 10, 30, 31]
E = [5, 6, 7, 8]


def test_plan_orders_lexicographically_and_shares_whole_blocks():
    plan = shared_prefix_plan([A, B, C, D, E], block=4)
    # E < B < A < D < C; common prefixes E|B 4, B|A 9, A|D 6, D|C 0 -> whole chunks of 4: 4, 8, 4, 0
    assert plan.order == [4, 1, 0, 3, 2]
    assert plan.shared == [0, 4, 8, 4, 0]
    # B's 4 and D's 4 come from E (the last prompt prefilled across position 4), A's 8 from B
    assert plan.keep == [[4], [8], [], [], []]
    # a prompt's last token is always prefilled: a repeated 12-token prompt shares 8 tokens, not 12
    assert shared_prefix_plan([B[:12], B[:12]], block=4).shared == [0, 8]
    assert shared_prefix_plan([B[:12], B], block=4).shared == [0, 12]
    assert shared_prefix_plan([A, B], block=16).shared == [0, 0]  # nothing whole: input order
    assert shared_prefix_plan([B, A], block=16).order == [0, 1]


def test_plan_takes_token_ids_of_any_sequence_type():
    """Lists, tuples, int64 / int32 tensors and numpy arrays give the plan of plain lists (token ids are held as
    ``array('q')``); large ids keep their order (4096 > 300, not compared as bytes)."""
    import numpy as np

    prompts = [A, B, C, D, E]
    mixed = [tuple(A), torch.tensor(B), torch.tensor(C, dtype=torch.int32), np.array(D), E]
    assert shared_prefix_plan(mixed, block=4) == shared_prefix_plan(prompts, block=4)
    assert token_array(torch.tensor([7, 1 << 40])).tolist() == [7, 1 << 40]
    assert ids_tensor(token_array([3, 4]))[None].tolist() == [[3, 4]]
    assert shared_prefix_plan([[5, 4096, 1], [5, 300, 2]], block=1).order == [1, 0]
    assert shared_prefix_plan([[], [5, 6]], block=1) == PrefixPlan.unshared(2)  # an empty prompt shares nothing


def test_plan_shares_the_common_prefix_of_a_naive_loop():
    """Random prompts from a 3-token vocabulary (long common prefixes; some repeated), chunks of 1-7 tokens: each
    shared count is the common prefix with the predecessor in sorted order, found by a Python loop, capped one token
    below the prompt's length and rounded down to whole chunks."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = 2 + trial % 5
        prompts = [torch.randint(0, 3, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(n)]
        prompts += prompts[:trial % 2]  # a repeated prompt: its last token is still prefilled
        n = len(prompts)
        for chunk in (1, 2, 3, 7):
            plan = shared_prefix_plan(prompts, chunk)
            order = sorted(range(n), key=lambda r: prompts[r])
            expect = [0]
            for a, b in zip([prompts[r] for r in order], [prompts[r] for r in order][1:]):
                common = 0
                while common < min(len(a), len(b) - 1) and a[common] == b[common]:
                    common += 1
                expect.append(common // chunk * chunk)
            assert plan.shared == expect, (prompts, chunk)
            assert plan.order == (order if any(expect) else list(range(n)))


def _row_state(engine: Engine, row: int, T: int) -> list[torch.Tensor]:
    out = []
    for slot in engine.slots:
        for name, t in engine._slot_tensors(slot):
            out.append(t[row, :T] if name != "linear_state" else t[row])
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@torch.inference_mode()
def test_prefill_from_a_kept_prefix_is_bitwise_a_full_prefill(kind, device):
    """On CUDA with the engine's kernels (cuDNN / SDPA prefix attention, fla's chunked GDN and convolutions)."""
    model = _model(kind).to(device)
    g = torch.Generator().manual_seed(7)
    p = torch.randint(3, 97, (1, 13), generator=g)
    q = torch.cat([p[:, :9], torch.randint(3, 97, (1, 4), generator=g)], 1)  # shares 9 tokens: 2 chunks of 4
    engine = Engine(model, max_batch=3, max_context=16, prefill_chunk=4)
    logits_p, kept = engine.prefill_row_shared(0, p, keep=[4, 8])
    assert sorted(kept) == [4, 8] and kept[8].row == 0 and torch.equal(kept[8].ids, p[0, :8])
    logits_q, again = engine.prefill_row_shared(2, q, reuse=kept[8], keep=[8])
    assert again[8].row == 2 and again[8].linear is kept[8].linear  # the reused prefix, now held by row 2 as well
    fresh = Engine(model, max_batch=1, max_context=16, prefill_chunk=4)
    assert torch.equal(logits_p, fresh.prefill_row(0, p))
    assert torch.equal(logits_q, fresh.prefill_row(0, q))
    assert all(torch.equal(x, y) for x, y in zip(_row_state(engine, 2, 13), _row_state(fresh, 0, 13)))
    # from the 4-token prefix into row 1 (latent rows copied from row 0)
    logits_q4, _ = engine.prefill_row_shared(1, q, reuse=kept[4])
    assert torch.equal(logits_q4, logits_q)
    assert all(torch.equal(x, y) for x, y in zip(_row_state(engine, 1, 13), _row_state(fresh, 0, 13)))


def stem_prompts(g: torch.Generator) -> list[list[int]]:
    """Seven prompts cut from one 14-token stem at different lengths, each with its own tail: neighbours in
    lexicographic order share 0 to 14 tokens, so a 4-token chunk plan shares and keeps prefixes."""
    stem = torch.randint(3, 97, (14,), generator=g).tolist()
    cuts, tails = [9, 14, 6, 12, 2, 14, 10], [3, 2, 5, 1, 6, 4, 2]
    return [stem[:c] + torch.randint(3, 97, (t,), generator=g).tolist() for c, t in zip(cuts, tails)]


@pytest.mark.parametrize("block", [4, 2])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_continuous_generate_with_shared_prefixes_equals_the_naive_loop(kind, block):
    """Prefix blocks of a whole chunk (4), and of 2 in chunks of 4: prompts are then cut inside chunks where a later
    one takes their prefix, and every request's tokens still equal the cache-free greedy loop's."""
    model = _model(kind)
    prompts = stem_prompts(torch.Generator().manual_seed(11))
    budgets = [4, 2, 6, 3, 5, 2, 4]
    naive = [_naive_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    reqs = [Request(ids=p, max_new_tokens=n) for p, n in zip(prompts, budgets)]
    plan = shared_prefix_plan(prompts, block)
    assert sum(plan.shared) > 0 and any(len(k) for k in plan.keep)
    if block == 2:
        assert sum(plan.shared) > sum(shared_prefix_plan(prompts, 4).shared)
        assert any(n % 4 for n in plan.shared)  # some prefixes end inside a chunk
    for slots in (2, 3):  # 2: rows are refilled while kept prefixes wait for their request
        stats = BatchStats(batch_size=slots)
        engine = Engine(model, max_batch=slots, max_context=24, prefill_chunk=4, prefix_block=block)
        got = continuous_generate(engine, reqs, stats=stats)
        assert got == naive
        assert stats.prefix_reused_tokens == sum(plan.shared) and stats.prefill_tokens == sum(map(len, prompts))
    stats = BatchStats(batch_size=2)
    off = continuous_generate(Engine(model, max_batch=2, max_context=24, prefill_chunk=4), reqs, stats=stats,
                              share_prefixes=False)
    assert off == naive and stats.prefix_reused_tokens == 0


@torch.inference_mode()
def test_prefill_row_shared_refuses_bad_prefixes():
    engine = Engine(_model("gdn"), max_batch=2, max_context=16, prefill_chunk=4)
    p = torch.tensor([A])
    _, kept = engine.prefill_row_shared(0, p, keep=[8])
    with pytest.raises(ValueError, match="equal its first 8 tokens"):
        engine.prefill_row_shared(1, torch.tensor([D]), reuse=kept[8])
    with pytest.raises(ValueError, match="below the prompt's 8 tokens"):
        engine.prefill_row_shared(1, torch.tensor([A[:8]]), reuse=kept[8])
    with pytest.raises(ValueError, match=r"keep=\[6\]: positions must be multiples of prefix_block=4 from 1 up to"):
        engine.prefill_row_shared(1, p, keep=[6])
    with pytest.raises(ValueError, match=r"from 8 up to the prompt's 11 tokens; \[4\] are not"):
        engine.prefill_row_shared(1, p, reuse=kept[8], keep=[4])
    _, whole = engine.prefill_row_shared(1, torch.tensor([E]), keep=[4])  # a prompt of whole chunks keeps itself
    assert sorted(whole) == [4] and torch.equal(whole[4].ids, torch.tensor(E))


def test_prefill_pieces_cut_at_chunk_boundaries_and_kept_lengths():
    engine = Engine(_model("gdn"), max_batch=1, max_context=32, prefill_chunk=8, prefix_block=4)
    assert engine.prefill_pieces(0, 21) == [(0, 8), (8, 16), (16, 21)]
    assert engine.prefill_pieces(0, 21, keep=[4, 12, 16, 21]) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 21)]
    assert engine.prefill_pieces(4, 21, keep=[4, 12]) == [(4, 8), (8, 12), (12, 16), (16, 21)]
    assert engine.prefill_pieces(12, 13) == [(12, 13)]
    assert Engine(_model("gdn"), 1, 32, 8).prefix_block == 8  # default: min(PREFIX_BLOCK, prefill_chunk)
    with pytest.raises(ValueError, match="prefix_block must be >= 1"):
        Engine(_model("gdn"), 1, 32, 8, prefix_block=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@torch.inference_mode()
def test_prefill_from_a_prefix_inside_a_chunk_is_bitwise_a_prefill_cut_there(kind, device):
    """Blocks of 4 in chunks of 8: a prefix of 4 cuts the first chunk. From it, the logits and the row's caches equal
    bit for bit a fresh prefill cut at 4 (``keep=[4]``), and a plain chunked prefill up to rounding."""
    model = _model(kind).to(device)
    g = torch.Generator().manual_seed(5)
    p = torch.randint(3, 97, (1, 13), generator=g)
    q = torch.cat([p[:, :6], torch.randint(3, 97, (1, 7), generator=g)], 1)  # shares 6 tokens: one block of 4
    engine = Engine(model, max_batch=2, max_context=16, prefill_chunk=8, prefix_block=4)
    plan = shared_prefix_plan([p[0].tolist(), q[0].tolist()], engine.prefix_block)
    assert sorted(plan.shared) == [0, 4]
    logits_p, kept = engine.prefill_row_shared(0, p, keep=[4])
    logits_q, _ = engine.prefill_row_shared(1, q, reuse=kept[4])
    fresh = Engine(model, max_batch=1, max_context=16, prefill_chunk=8, prefix_block=4)
    cut_p, _ = fresh.prefill_row_shared(0, p, keep=[4])
    assert torch.equal(logits_p, cut_p)
    cut_q, _ = fresh.prefill_row_shared(0, q, keep=[4])
    assert torch.equal(logits_q, cut_q)
    assert all(torch.equal(x, y) for x, y in zip(_row_state(engine, 1, 13), _row_state(fresh, 0, 13)))
    plain = fresh.prefill_row(0, q)
    tol = dict(rtol=1e-4, atol=1e-4) if device == "cpu" else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(logits_q, plain, **tol)
    assert torch.equal(logits_q.argmax(-1), plain.argmax(-1))
