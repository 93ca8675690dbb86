"""Batched inference on tiny MLA + GDN and MLA + Mamba-2 hybrids: left- and right-padded batches with mixed
prompt lengths give the one-by-one greedy tokens and per-token log-likelihoods (float64 models, atol 1e-9 nats
on log-likelihoods; exact token ids)."""

from __future__ import annotations

import pytest
import torch

from hylo_bench.models.batching import loglikelihoods, pad_batch, token_logprobs
from hylo_bench.models.hybrid import HyLoForCausalLM
from tests.conftest import tiny_hybrid_config

LENS = [9, 4, 70, 1, 33]  # 70 > 64: padding crosses a GDN chunk boundary
PAD = 2


@pytest.fixture(scope="module", params=["gdn", "mamba"])
def model(request):
    torch.manual_seed(0)
    m = HyLoForCausalLM(tiny_hybrid_config(linear_type=request.param)).eval().double()
    with torch.no_grad():  # stronger recurrent paths so a leak through the state would move the logits
        for layer in m.model.layers:
            if layer.mixer_type != "mla":
                for p in layer.mixer.parameters():
                    if p.dim() == 2:
                        p.mul_(4)
    return m


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in LENS]


def _reference_logprobs(model, s):
    with torch.no_grad():
        logits = model(torch.tensor([s])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s[1:])[:, None])[:, 0]


def test_pad_batch_layout():
    ids, mask = pad_batch([[5, 6, 7], [8]], pad_id=2, side="left")
    assert ids.tolist() == [[5, 6, 7], [2, 2, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ids, mask = pad_batch([[5, 6, 7], [8]], pad_id=2, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 2, 2]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    with pytest.raises(ValueError, match="padding side must be one of"):
        pad_batch([[1]], 0, side="middle")


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_logits_equal_unpadded_at_real_positions(model, seqs, side):
    ids, mask = pad_batch(seqs, PAD, side)
    T = ids.shape[1]
    junk = ids.clone()
    junk[mask == 0] = 96  # the padding token id must not matter either
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        logits_junk = model(junk, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            cols = slice(T - len(s), T) if side == "left" else slice(0, len(s))
            ref = model(torch.tensor([s])).logits[0]
            assert torch.allclose(logits[i, cols], ref, atol=1e-9, rtol=0), (side, i)
            assert torch.equal(logits[i, cols], logits_junk[i, cols]), (side, i)


@pytest.mark.parametrize("side, batch_size", [("left", 2), ("right", 3)])
def test_token_logprobs_batched_equal_one_by_one(model, seqs, side, batch_size):
    got = token_logprobs(model, seqs, batch_size=batch_size, pad_id=PAD, padding_side=side)
    assert [len(g) for g in got] == [n - 1 for n in LENS]
    for g, s in zip(got, seqs):
        assert torch.allclose(g, _reference_logprobs(model, s), atol=1e-9, rtol=0)


def test_left_padded_generate_equals_one_by_one(model, seqs):
    ids, mask = pad_batch(seqs, PAD, "left")
    T = ids.shape[1]
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD)[:, T:]
        ref = [model.generate(torch.tensor([s]), max_new_tokens=8, do_sample=False, pad_token_id=PAD)[0, len(s):]
               for s in seqs]
    assert gen.tolist() == [r.tolist() for r in ref]
    assert len({tuple(r.tolist()) for r in ref}) > 1  # the prompts lead to different continuations


class _CharTokenizer:
    """Printable ASCII character c -> id ord(c) - 32 (0-94); BOS id 95 added with special tokens; pad id 2."""

    pad_token_id = 2

    def __call__(self, text, add_special_tokens=True):
        class Enc:
            input_ids = ([95] if add_special_tokens else []) + [ord(c) - 32 for c in text]
        return Enc()


def test_loglikelihoods_sum_continuation_tokens_and_flag_greedy(model):
    tok = _CharTokenizer()
    with torch.no_grad():  # the model's own greedy next token after "ab" (must be a printable id for this test)
        nxt = int(model(torch.tensor([[95, 65, 66]])).logits[0, -1].argmax())
    assert nxt < 95
    ctxs, conts = ["1234", "hello wor", "5", "ab"], ["56", "ld", "000", chr(nxt + 32)]
    got_right = loglikelihoods(model, tok, ctxs, conts, batch_size=4, padding_side="right")
    got_left = loglikelihoods(model, tok, ctxs, conts, batch_size=3, padding_side="left")
    for ctx, cont, (lp_r, greedy_r), (lp_l, greedy_l) in zip(ctxs, conts, got_right, got_left):
        s = tok(ctx + cont).input_ids
        ref = _reference_logprobs(model, s)[-len(cont):]
        assert lp_r == pytest.approx(float(ref.sum()), abs=1e-9) and lp_l == pytest.approx(lp_r, abs=1e-9)
        with torch.no_grad():
            argmax = model(torch.tensor([s])).logits[0, :-1].argmax(-1)[-len(cont):]
        assert greedy_r == greedy_l == bool((argmax == torch.tensor(s[-len(cont):])).all())
    assert [g for _, g in got_right] == [False, False, False, True]
    with pytest.raises(ValueError, match="as many contexts as continuations"):
        loglikelihoods(model, tok, ["1"], [])
