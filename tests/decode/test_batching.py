"""Continuous batching: every request's greedy tokens equal batch-1 decoding and a cache-free forward loop, for mixed
prompt lengths and budgets with slots refilled mid-run, EOS and stop predicates, MLA+GDN and MLA+Mamba-2."""

from __future__ import annotations

import statistics

import pytest
import torch

from hylo_bench.decode import batching
from hylo_bench.decode.batching import BatchStats, Request, continuous_generate
from hylo_bench.decode.engine import Engine, TransformerEngine
from hylo_bench.models.hybrid import HyLoForCausalLM
from tests.conftest import make_base, tiny_hybrid_config

LAYOUTS = {"gdn": {}, "mamba": {"linear_type": "mamba"}, "gdn-qknorm": {"use_qk_norm": True}}
LENGTHS = [5, 13, 9, 3, 11, 7, 16]
BUDGETS = [6, 3, 8, 5, 2, 7, 4]


def _model(kind: str) -> HyLoForCausalLM:
    torch.manual_seed(0)
    m = HyLoForCausalLM(tiny_hybrid_config(**LAYOUTS[kind])).eval()
    with torch.no_grad():  # sharper logits: greedy near-ties cannot hide a mismatch
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(3)
    return m


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in LENGTHS]


@torch.inference_mode()
def _naive_greedy(model, ids: list[int], n: int) -> list[int]:
    """Independent reference: the full forward over prompt + tokens so far at every step, no cache."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def _cut(tokens: list[int], stop: set[int]) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stop), tokens)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_continuous_batching_equals_batch_one_and_naive_loop(kind):
    model = _model(kind)
    prompts = _prompts()
    naive = [_naive_greedy(model, p, n) for p, n in zip(prompts, BUDGETS)]
    # an EOS id that occurs inside a continuation (not first): that request ends early, its slot refills sooner
    stop = next({seq[k]} for seq in naive for k in range(1, len(seq)) if seq[k] not in seq[:k])
    want = [_cut(seq, stop) for seq in naive]
    assert any(len(w) < n for w, n in zip(want, BUDGETS))
    single = Engine(model, max_batch=1, max_context=24, prefill_chunk=4)
    one = [single.generate_until(torch.tensor([p]), n, stop) for p, n in zip(prompts, BUDGETS)]
    assert one == want
    stats = BatchStats(batch_size=3)
    engine = Engine(model, max_batch=3, max_context=24, prefill_chunk=4)
    got = continuous_generate(engine, [Request(ids=p, max_new_tokens=n) for p, n in zip(prompts, BUDGETS)], stop,
                              stats)
    assert got == want
    assert stats.prefills == len(prompts) and stats.prefill_tokens == sum(LENGTHS)
    times = stats.prefill_times_s  # one wall time per prefill, summing to the total
    assert len(times) == len(prompts) and sum(times) == pytest.approx(stats.prefill_s, rel=1e-12)
    d = stats.to_dict()
    assert "prefill_times_s" not in d and d["prefill_first_s"] == times[0] and d["prefill_max_s"] == max(times)
    assert d["prefill_median_s"] == sorted(times)[len(times) // 2]  # 7 prefills: the 4th smallest
    steps = stats.decode_times_s  # one wall time per decode step
    assert len(steps) == stats.decode_steps and sum(steps) == pytest.approx(stats.decode_s, rel=1e-12)
    assert "decode_times_s" not in d and d["decode_step_first_s"] == steps[0] and d["decode_step_max_s"] == max(steps)
    assert d["decode_step_median_s"] == statistics.median(steps)
    assert stats.generated_tokens == sum(len(w) for w in want)
    # a used engine (every slot is reset by its next prefill), no EOS: the schedule is the budgets' alone. A request
    # of n tokens takes its first from the prefill and n - 1 decode steps. Slots 0/1/2 take requests 0 (6), 1 (3),
    # 2 (8); slot 1 frees after step 2 -> request 3 (5) to step 6; slot 0 after step 5 -> request 4 (2) to step 6;
    # at step 6 slot 0 -> request 5 (7) to step 12, slot 1 -> request 6 (4) to step 9; slot 2 ends at step 7.
    stats = BatchStats(batch_size=3)
    again = continuous_generate(engine, [Request(ids=p, max_new_tokens=n) for p, n in zip(prompts, BUDGETS)],
                                stats=stats)
    assert again == naive
    assert stats.decode_steps == 12 and stats.generated_tokens == sum(BUDGETS)


@pytest.mark.parametrize(("multiple", "rows"), [(1, 28), (2, 31), (8, 36)])
def test_decode_steps_run_the_occupied_slots_only(monkeypatch, multiple, rows):
    """The schedule of the test above (3 slots, no EOS): slot 2 is occupied to step 7, slot 1 to step 9, slot 0 to
    step 12, so a step runs 3 rows to step 7, then 2, then 1 (28 row-steps), rounded up to a multiple of 2 (31) or 8
    (capped at the 3 slots: 36). The tokens are the naive loop's whatever the rows."""
    monkeypatch.setattr(batching, "DECODE_ROW_MULTIPLE", multiple)
    model = _model("gdn")
    prompts = _prompts()
    naive = [_naive_greedy(model, p, n) for p, n in zip(prompts, BUDGETS)]
    stats = BatchStats(batch_size=3)
    engine = Engine(model, max_batch=3, max_context=24, prefill_chunk=4)
    got = continuous_generate(engine, [Request(ids=p, max_new_tokens=n) for p, n in zip(prompts, BUDGETS)],
                              stats=stats)
    assert got == naive
    assert stats.decode_steps == 12 and stats.decode_rows == rows


def test_decode_rows_rounds_up_to_the_multiple():
    assert [batching.decode_rows(n, 32) for n in (1, 8, 9, 17, 24, 25, 32)] == [8, 8, 16, 24, 24, 32, 32]
    assert [batching.decode_rows(n, 12) for n in (1, 9, 12)] == [8, 12, 12]
    with pytest.raises(ValueError, match="occupied_top must be in \\[1, 4\\], got 5"):
        batching.decode_rows(5, 4)


def test_stop_predicate_keeps_the_token_and_frees_the_slot():
    model = _model("gdn")
    prompts = _prompts(seed=2)[:4]
    naive = [_naive_greedy(model, p, 6) for p in prompts]
    reqs = [Request(ids=p, max_new_tokens=6, should_stop=(lambda out: len(out) == 2) if k % 2 else None)
            for k, p in enumerate(prompts)]
    got = continuous_generate(Engine(model, max_batch=2, max_context=24), reqs)
    assert got == [seq[:2] if k % 2 else seq for k, seq in enumerate(naive)]


def test_more_slots_than_requests_and_first_token_stop():
    model = _model("mamba")
    prompts = _prompts(seed=3)[:2]
    naive = [_naive_greedy(model, p, 4) for p in prompts]
    stop = {naive[0][0]}  # request 0 ends at its first token: the empty continuation, as generate_until gives
    got = continuous_generate(Engine(model, max_batch=4, max_context=24),
                              [Request(ids=p, max_new_tokens=4) for p in prompts], stop)
    assert got == [_cut(seq, stop) for seq in naive] and got[0] == []


def test_prefill_row_leaves_the_other_rows_alone():
    model = _model("gdn-qknorm")
    prompts = _prompts(seed=4)
    engine = Engine(model, max_batch=2, max_context=24, prefill_chunk=5)
    want = model(torch.tensor([prompts[1]])).logits[0, -1]
    engine.prefill_row(1, torch.tensor([prompts[1]]))
    before = [t.clone() for t in engine._linear_tensors()]
    engine.prefill_row(0, torch.tensor([prompts[2]]))
    after = engine._linear_tensors()
    assert all(torch.equal(a[1], b[1]) for a, b in zip(after, before))
    assert torch.allclose(engine.prefill_row(1, torch.tensor([prompts[1]]))[0], want, atol=1e-4, rtol=1e-4)


def test_continuous_generate_refuses_bad_requests():
    model = _model("gdn")
    engine = Engine(model, max_batch=2, max_context=10)
    with pytest.raises(ValueError, match="request 1: prompt 9 \\+ 3 new tokens needs 11 cache slots > max_context"):
        continuous_generate(engine, [Request(ids=[3], max_new_tokens=2), Request(ids=[3] * 9, max_new_tokens=3)])
    with pytest.raises(ValueError, match="request 0: needs >= 1 prompt token"):
        continuous_generate(engine, [Request(ids=[], max_new_tokens=2)])
    with pytest.raises(ValueError, match="row 2 outside the engine's batch of 2"):
        engine.prefill_row(2, torch.tensor([[3, 4]]))
    with pytest.raises(ValueError, match="needs the HyLo Engine"):
        continuous_generate(TransformerEngine(make_base(), 2, 16), [Request(ids=[3], max_new_tokens=2)])


@pytest.mark.gpu
@pytest.mark.parametrize("multiple", [1, 8])
@pytest.mark.parametrize("kind", ["gdn-qknorm", "mamba"])
def test_gpu_continuous_batching_with_graphs_equals_batch_one(monkeypatch, kind, multiple):
    """On CUDA (Triton MLA / GDN kernels, fused GEMVs, CUDA graphs), float32 so batch sizes round alike. With a row
    multiple of 1 the steps run 3, 2 and 1 rows: three graphs, each captured mid-run over live states."""
    monkeypatch.setattr(batching, "DECODE_ROW_MULTIPLE", multiple)
    model = _model(kind).cuda()
    prompts = _prompts()
    single = Engine(model, max_batch=1, max_context=24, cuda_graphs=True)
    want = [single.generate_until(torch.tensor([p]), n, set()) for p, n in zip(prompts, BUDGETS)]
    engine = Engine(model, max_batch=3, max_context=24, cuda_graphs=True)
    got = continuous_generate(engine, [Request(ids=p, max_new_tokens=n) for p, n in zip(prompts, BUDGETS)])
    assert engine.cuda_graphs and got == want
    assert sorted(engine._graphs) == ([1, 2, 3] if multiple == 1 else [3])
