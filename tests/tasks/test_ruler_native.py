"""RULER through the native serving engine: a tiny HyLo model's predictions equal transformers generate()'s, the
engine stops at a stop token exactly as generate() does, and engine selection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hylo_bench.decode import greedy as decoding
from hylo_bench.decode.engine import Engine
from hylo_bench.decode.greedy import NativeDecoder, make_decoder, resolve_engine
from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.tasks.ruler import evaluate_model
from tests.conftest import tiny_hybrid_config
from tests.tasks.test_ruler_runner import INFO, DyingLM, _cfg, _quiet, build_small_tokenizer, tiny_llama_config


@pytest.fixture(scope="module")
def tok():
    return build_small_tokenizer()


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _hylo(tok, **kw) -> HyLoForCausalLM:
    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config(vocab_size=len(tok), max_position_embeddings=2048, **kw)).eval()
    with torch.no_grad():  # sharper logits: greedy ties cannot hide a mismatch
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3)
    return model


def _predictions(results_dir: Path) -> list[list[str]]:
    return [[json.loads(line)["prediction"] for line in f.read_text().splitlines()]
            for f in sorted((results_dir / "predictions").glob("*.jsonl"))]


@pytest.mark.parametrize("kind", [{}, {"linear_type": "mamba"}], ids=["mla-gdn", "mla-mamba2"])
def test_native_engine_predictions_equal_generate(tok, tmp_path, monkeypatch, kind):
    monkeypatch.setattr(decoding, "PREFILL_CHUNK_TOKENS", 300)  # several prefill chunks per prompt
    model = _hylo(tok, **kind)
    tasks = ["niah_single_1", "ruler_vt"]
    via_generate = evaluate_model(model, tok, INFO, _cfg(tmp_path / "g", tasks=tasks, engine="generate"),
                                  console=_quiet())
    via_engine = evaluate_model(model, tok, INFO, _cfg(tmp_path / "n", tasks=tasks, engine="native"),
                                console=_quiet())
    want, got = _predictions(tmp_path / "g"), _predictions(tmp_path / "n")
    assert got == want and [len(p) for p in got] == [2] * len(tasks) and all(t for p in got for t in p)
    assert via_engine["scores"] == via_generate["scores"]
    doc = json.loads(Path(via_engine["results_path"]).read_text())
    assert doc["provenance"]["engine"] == "native"


@pytest.mark.parametrize("kind", [{}, {"linear_type": "mamba"}], ids=["mla-gdn", "mla-mamba2"])
def test_native_continuous_batching_predictions_equal_batch_one(tok, tmp_path, monkeypatch, kind):
    monkeypatch.setattr(decoding, "PREFILL_CHUNK_TOKENS", 300)
    model = _hylo(tok, **kind)
    tasks = ["niah_single_1", "ruler_vt"]
    one = evaluate_model(model, tok, INFO, _cfg(tmp_path / "1", tasks=tasks, engine="native", samples=5),
                         console=_quiet())
    calls = []
    real = decoding.NativeDecoder.tokens_many
    monkeypatch.setattr(decoding.NativeDecoder, "tokens_many",
                        lambda self, prompts, *a, **k: calls.append((self.batch_size, len(prompts)))
                        or real(self, prompts, *a, **k))
    two = evaluate_model(model, tok, INFO, _cfg(tmp_path / "2", tasks=tasks, engine="native", samples=5,
                                                batch_size=2), console=_quiet())
    assert calls == [(2, 5), (2, 5)]  # each task's 5 prompts in one call over 2 slots: three refills
    want, got = _predictions(tmp_path / "1"), _predictions(tmp_path / "2")
    assert got == want and [len(p) for p in got] == [5] * len(tasks) and all(t for p in got for t in p)
    assert two["scores"] == one["scores"]
    assert one["engine_stats"] is None  # batch 1 decodes without continuous batching
    st = two["engine_stats"]
    assert (st["batch_size"], st["requests"], st["prefills"]) == (2, 10, 10)
    assert st["prefill_s"] > 0 and st["decode_s"] > 0 and st["decode_steps"] >= 1
    assert 0 < st["prefill_median_s"] <= st["prefill_max_s"] <= st["prefill_s"] and st["prefill_first_s"] > 0


def test_prefix_sharing_keeps_the_predictions_and_skips_the_shared_haystack(tok, tmp_path, monkeypatch):
    """NIAH samples share their haystack up to the first needle: with 16-token chunks, continuous batching takes
    those chunks from the previous prompt (``ruler --prefix-sharing``, the default), with the predictions of
    ``--no-prefix-sharing`` and of batch 1. The reused count equals a naive longest-common-prefix count."""
    from hylo_bench.decode import batching

    model = _hylo(tok)
    prompts = []
    real = batching.continuous_generate
    monkeypatch.setattr(batching, "continuous_generate",
                        lambda engine, reqs, *a, **k: prompts.append([list(r.ids) for r in reqs])
                        or real(engine, reqs, *a, **k))
    kw = dict(tasks=["niah_single_1"], engine="native", samples=6, prefill_chunk=16)
    one = evaluate_model(model, tok, INFO, _cfg(tmp_path / "1", **kw), console=_quiet())
    on = evaluate_model(model, tok, INFO, _cfg(tmp_path / "on", batch_size=2, **kw), console=_quiet())
    off = evaluate_model(model, tok, INFO, _cfg(tmp_path / "off", batch_size=2, prefix_sharing=False, **kw),
                         console=_quiet())
    want = _predictions(tmp_path / "1")
    assert _predictions(tmp_path / "on") == want == _predictions(tmp_path / "off") and all(want[0])
    assert on["scores"] == off["scores"] == one["scores"]
    srt = sorted(prompts[0])
    naive = 0
    for a, b in zip(srt, srt[1:]):
        common = 0
        while common < min(len(a), len(b) - 1) and a[common] == b[common]:
            common += 1
        naive += common // 16 * 16
    assert naive > 0 and on["engine_stats"]["prefix_reused_tokens"] == naive
    assert off["engine_stats"]["prefix_reused_tokens"] == 0
    assert on["engine_stats"]["prefill_tokens"] == off["engine_stats"]["prefill_tokens"] == sum(map(len, srt))


def test_prefill_chunk_reaches_the_engine_and_keeps_the_predictions(tok, tmp_path, monkeypatch):
    """``RulerConfig.prefill_chunk`` (``ruler --prefill-chunk``) sizes the native engine's prefill chunks; the
    predictions equal those of the default chunk (a prompt of a few hundred tokens in 41-token chunks vs one)."""
    model = _hylo(tok)
    chunks = []
    real = Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, m, b, c, chunk=8192, **k: chunks.append(chunk)
                        or real(self, m, b, c, chunk, **k))
    tasks = ["niah_single_1"]
    evaluate_model(model, tok, INFO, _cfg(tmp_path / "d", tasks=tasks, engine="native"), console=_quiet())
    evaluate_model(model, tok, INFO, _cfg(tmp_path / "c", tasks=tasks, engine="native", prefill_chunk=41),
                   console=_quiet())
    assert chunks[0] == decoding.PREFILL_CHUNK_TOKENS and chunks[-1] == 41
    assert _predictions(tmp_path / "c") == _predictions(tmp_path / "d")
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1 token, got 0"):
        _cfg(tmp_path / "z", tasks=tasks, prefill_chunk=0)


def test_generate_until_stops_like_generate(tok):
    model = _hylo(tok)
    torch.manual_seed(1)
    ids = torch.randint(3, len(tok), (1, 37))
    full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, eos_token_id=None, pad_token_id=0)[0, 37:].tolist()
    engine = Engine(model, max_batch=1, max_context=64, prefill_chunk=16)
    assert engine.generate_until(ids, 12, set()) == full
    assert engine.generate_until(ids, 5, set()) == full[:5]
    stop = full[6]
    assert engine.generate_until(ids, 12, {stop}) == full[: full.index(stop)]
    with torch.no_grad():
        stopped = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 eos_token_id=stop, pad_token_id=0)[0, 37:].tolist()
    assert stopped[: full.index(stop)] == full[: full.index(stop)] and stopped[full.index(stop)] == stop
    with pytest.raises(ValueError, match="one prompt"):
        Engine(model, max_batch=2, max_context=64).generate_until(ids.repeat(2, 1), 4, set())


def test_static_cache_predictions_equal_generate(tok, tmp_path, monkeypatch):
    """engine='static' (generate() over a preallocated StaticCache, left-padded batches of 3 and 2 prompts) gives
    the dynamic-cache predictions; one cache per (batch, capacity) is built and reset between batches."""
    from transformers import LlamaForCausalLM, StaticCache

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tok)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3)
    built = []
    monkeypatch.setattr("transformers.StaticCache", lambda **kw: built.append(kw) or StaticCache(**kw))
    tasks = ["niah_single_1", "ruler_vt"]
    runs = {}
    for engine in ("generate", "static"):
        runs[engine] = evaluate_model(model, tok, INFO, _cfg(tmp_path / engine, tasks=tasks, engine=engine, samples=5,
                                                             batch_size=3), console=_quiet())
    want, got = _predictions(tmp_path / "generate"), _predictions(tmp_path / "static")
    assert got == want and [len(p) for p in got] == [5] * len(tasks) and all(t for p in got for t in p)
    assert runs["static"]["scores"] == runs["generate"]["scores"]
    assert [kw["max_cache_len"] for kw in built] == [decoding.CAPACITY_STEP_TOKENS] * 4  # (3, 2) rows per task
    doc = json.loads(Path(runs["static"]["results_path"]).read_text())
    assert doc["provenance"]["engine"] == "static"
    with pytest.raises(ValueError, match="engine 'native'"):
        make_decoder(_hylo(tok), tok, "static")


def test_native_decoder_grows_its_cache_and_engine_selection(tok, monkeypatch):
    monkeypatch.setattr(decoding, "CAPACITY_STEP_TOKENS", 64)
    model = _hylo(tok)
    dec = NativeDecoder(model, tok)
    assert dec.capacity == 64
    prompt = list(range(3, 90))
    texts = dec([prompt, prompt[:10]], 8)
    assert dec.capacity == 128 and len(texts) == 2
    assert texts == decoding.generate_batch(model, tok, [prompt], 8) + decoding.generate_batch(model, tok,
                                                                                                 [prompt[:10]], 8)
    assert resolve_engine(model, "auto") == "generate"  # HyLo on CPU: generate(); native only on CUDA
    assert resolve_engine(model, "native") == "native"
    with pytest.raises(ValueError, match="Use engine='generate'"):
        make_decoder(DyingLM(tok, {}), tok, "native")
    with pytest.raises(ValueError, match="engine must be one of"):
        _cfg(Path("."), engine="vllm")
