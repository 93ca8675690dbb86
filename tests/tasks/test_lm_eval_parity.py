"""Issue 19 items 15-16: the ``hylo`` lm-eval model against lm-eval's own ``hf`` model (HFLM) and a direct forward:
the default context window is the model's own, and a context/continuation split inside a BPE token scores the
straddling token instead of failing."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import resolve_max_length

from hylo_bench.tasks import lm_eval_bridge as B
from tests.conftest import make_base, tiny_hybrid_config


def _instances(args, kind):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0, metadata=("t", i, 1)) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def short_llama(tiny_tokenizer):
    """The tiny Llama base with a 64-token context (its config's max_position_embeddings)."""
    model = make_base("llama", vocab_size=len(tiny_tokenizer)).double()
    model.config.max_position_embeddings = 64
    return model


def test_default_context_is_the_models_own_as_lm_eval_hf(short_llama, tiny_tokenizer):
    from hylo_bench.models.hybrid import HyLoForCausalLM

    lm = B.HyLoLM(pretrained=short_llama, tokenizer=tiny_tokenizer)
    hf = HFLM(pretrained=short_llama, tokenizer=tiny_tokenizer)
    assert lm.max_length == hf.max_length == resolve_max_length(short_llama.config, tiny_tokenizer) == 64
    hylo = HyLoForCausalLM(tiny_hybrid_config(vocab_size=len(tiny_tokenizer), max_position_embeddings=96))
    assert B.HyLoLM(pretrained=hylo, tokenizer=tiny_tokenizer).max_length == 96
    assert B.HyLoLM(pretrained=hylo, tokenizer=tiny_tokenizer, max_length=32).max_length == 32
    assert B.EvalConfig(model="demo", tasks=["piqa"], output_dir="x").max_length is None


def test_rolling_loglikelihood_of_a_long_text_equals_lm_eval_hf(short_llama, tiny_tokenizer):
    text = ("The quick brown fox jumps over the lazy dog while the cat sleeps. " * 6).strip()
    assert len(tiny_tokenizer(text).input_ids) > 3 * 64  # several rolling windows of the 64-token context
    reqs = _instances([(text,)], "loglikelihood_rolling")
    ours = B.HyLoLM(pretrained=short_llama, tokenizer=tiny_tokenizer).loglikelihood_rolling(reqs)
    theirs = HFLM(pretrained=short_llama, tokenizer=tiny_tokenizer).loglikelihood_rolling(reqs)
    assert ours == pytest.approx(theirs, rel=1e-12)


def _inside_token_split(tok, text: str) -> tuple[str, str, int]:
    """(context, continuation, index of the straddling token in tok(text).input_ids) for a split before the last
    character of ``text``'s last token (which must be 3+ characters long), as "hello wor" + "ld"."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    lead = len(tok(text).input_ids) - len(enc.input_ids)
    start, end = enc.offset_mapping[-1]
    assert end == len(text) and end - start >= 3, "the text must end in a multi-character token"
    return text[: end - 1], text[end - 1:], lead + len(enc.input_ids) - 1


@pytest.mark.parametrize("kind", ["llama", "hylo"])
def test_split_inside_a_bpe_token_scores_the_straddling_token(kind, short_llama, tiny_tokenizer):
    from hylo_bench.models.hybrid import HyLoForCausalLM

    torch.manual_seed(0)
    model = short_llama if kind == "llama" else \
        HyLoForCausalLM(tiny_hybrid_config(vocab_size=len(tiny_tokenizer))).eval().double()
    text = "Question: which animal sleeps? Answer: the"  # ends in the token " the"
    ctx, cont, j = _inside_token_split(tiny_tokenizer, text)
    ids = tiny_tokenizer(text).input_ids
    assert len(tiny_tokenizer(ctx).input_ids) > j  # the context alone ends in a token of its own: not a prefix
    with torch.no_grad():
        logp = model(torch.tensor([ids[:-1]])).logits[0].double().log_softmax(-1)
    want = float(sum(logp[t - 1, ids[t]] for t in range(j, len(ids))))  # tokens j ... end, from one forward
    greedy = all(int(logp[t - 1].argmax()) == ids[t] for t in range(j, len(ids)))
    lm = B.HyLoLM(pretrained=model, tokenizer=tiny_tokenizer)
    (lp, is_greedy), = lm.loglikelihood(_instances([(ctx, cont)], "loglikelihood"))
    assert lp == pytest.approx(want, rel=1e-9) and is_greedy == greedy
    with pytest.raises(AssertionError):  # lm-eval's own split leaves the continuation empty here
        HFLM(pretrained=model, tokenizer=tiny_tokenizer).loglikelihood(_instances([(ctx, cont)], "loglikelihood"))


def test_boundary_split_equals_lm_evals_where_it_is_defined(short_llama, tiny_tokenizer):
    reqs = [("Question: which animal sleeps? Answer:", " the cat"), ("The dog ", "runs."), ("A", "B c")]
    ours = B.HyLoLM(pretrained=short_llama, tokenizer=tiny_tokenizer)
    hf = HFLM(pretrained=short_llama, tokenizer=tiny_tokenizer)
    for ctx, cont in reqs:
        assert ours._encode_pair(ctx, cont) == hf._encode_pair(ctx, cont), (ctx, cont)
    got = ours.loglikelihood(_instances(reqs, "loglikelihood"))
    want = hf.loglikelihood(_instances(reqs, "loglikelihood"))
    assert got == want


def test_multiple_choice_with_choices_split_inside_a_token_is_not_a_tie(short_llama, tiny_tokenizer):
    """Choices that complete a word ("...Answer: th" + "e" / "is" / "ere"): each is scored from the context's whole
    tokens on, so they get different log-likelihoods (lm-eval's split cannot score "e": nothing is left of it)."""
    ctx, choices = "Question: which animal sleeps? Answer: th", ("e", "is", "ere")
    lm = B.HyLoLM(pretrained=short_llama, tokenizer=tiny_tokenizer)
    got = lm.loglikelihood(_instances([(ctx, c) for c in choices], "loglikelihood"))
    lps = [lp for lp, _ in got]
    assert len(set(lps)) == 3 and all(lp < 0 for lp in lps)
    for (lp, _), c in zip(got, choices):  # each equals log p(tokens after the context's whole tokens)
        text = ctx + c
        enc = tiny_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = tiny_tokenizer(text).input_ids
        lead = len(ids) - len(enc.input_ids)
        k = lead + next(i for i, (_, end) in enumerate(enc.offset_mapping) if end > len(ctx))
        with torch.no_grad():
            logp = short_llama(torch.tensor([ids[:-1]])).logits[0].double().log_softmax(-1)
        assert lp == pytest.approx(float(sum(logp[t - 1, ids[t]] for t in range(k, len(ids)))), rel=1e-9)
