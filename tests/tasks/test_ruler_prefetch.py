"""RULER decoding tokenises the next batch on worker threads, each with its own tokenizer copy, while a batch
decodes."""

from __future__ import annotations

import threading

import pytest

from hylo_bench.tasks.ruler import generate_sample
from hylo_bench.tasks.ruler import runner as R
from tests.tasks.test_ruler_runner import INFO, DyingLM, _cfg, _half_oracle, _quiet, build_small_tokenizer


class _Tok:
    """A tokenizer stub: ids are the prompt's characters; records which copy encoded what, on which thread."""

    def __init__(self, log: list, encoded_event: dict[int, threading.Event], copy_no: int = 0):
        self.log, self.events, self.copy_no = log, encoded_event, copy_no

    def __deepcopy__(self, memo):
        return _Tok(self.log, self.events, self.copy_no + 1)

    def __call__(self, prompt, add_special_tokens=True, verbose=False):
        if isinstance(prompt, list):  # a batch: one entry per prompt, as a tokenizer's batch call returns
            class Batch:
                input_ids = [self(p).input_ids for p in prompt]
            return Batch()
        self.log.append((prompt, self.copy_no, threading.current_thread().name))
        if prompt in self.events:
            self.events[prompt].set()

        class Out:
            input_ids = [ord(c) for c in prompt]
        return Out()


def test_the_next_batch_is_tokenised_while_this_one_decodes():
    log: list = []
    next_batch_encoded = threading.Event()
    tok = _Tok(log, {"c": next_batch_encoded})
    samples = [{"prompt": p, "index": i} for i, p in enumerate("abcde")]
    cfg = R.RulerConfig(model="m", lengths=[1024], tasks=["niah_single_1"], samples=5, results_dir="r", batch_size=2)
    waited: list[bool] = []

    def decode(ids, max_new):
        if not waited:  # the first batch (a, b) decodes only once the second batch's first prompt is tokenised
            waited.append(next_batch_encoded.wait(timeout=5))
        return ["".join(map(chr, x)).upper() for x in ids]

    got: list[tuple[int, str]] = []
    R._predict(decode, tok, samples, cfg, 8, lambda b, p: got.extend((s["index"], q) for s, q in zip(b, p)))
    assert waited == [True]
    assert got == [(0, "A"), (1, "B"), (2, "C"), (3, "D"), (4, "E")]
    assert sorted(p for p, _, _ in log) == list("abcde")  # each prompt tokenised once
    assert {(c, t.startswith("ruler-encode")) for _, c, t in log} == {(1, True)}  # by the copy, off the main thread


def test_a_decode_error_is_raised_without_tokenising_every_remaining_prompt():
    log: list = []
    tok = _Tok(log, {})
    samples = [{"prompt": f"p{i}", "index": i} for i in range(40)]
    cfg = R.RulerConfig(model="m", lengths=[1024], tasks=["niah_single_1"], samples=40, results_dir="r", batch_size=2)

    def decode(ids, max_new):
        raise ValueError("engine refused")

    with pytest.raises(ValueError, match="engine refused"):
        R._predict(decode, tok, samples, cfg, 8, lambda b, p: None)
    assert len(log) <= 4  # this batch and the next one at most


class _CountingTok(_Tok):
    """Counts its copies; every encode waits at ``barrier`` when one is set (two encodes at once pass it)."""

    def __init__(self, log, copies: list, barrier: threading.Barrier | None = None):
        super().__init__(log, {})
        self.copies, self.barrier = copies, barrier

    def __deepcopy__(self, memo):
        twin = _CountingTok(self.log, self.copies, self.barrier)
        self.copies.append(twin)
        return twin

    def __call__(self, prompt, add_special_tokens=True, verbose=False):
        if isinstance(prompt, list):
            return super().__call__(prompt)  # each entry through this method
        if self.barrier is not None:
            self.barrier.wait(timeout=5)  # BrokenBarrierError unless another thread encodes at the same time
        self.log.append((prompt, id(self), threading.current_thread().name))

        class Out:
            input_ids = [ord(c) for c in prompt]
        return Out()


def test_workers_encode_at_once_on_their_own_copies_and_serve_several_calls():
    log: list = []
    copies: list = []
    tok = _CountingTok(log, copies, threading.Barrier(2))
    cfg = R.RulerConfig(model="m", lengths=[1024], tasks=["niah_single_1"], samples=4, results_dir="r", batch_size=2)
    got: list[tuple[int, str]] = []

    def decode(ids, max_new):
        return ["".join(map(chr, x)).upper() for x in ids]

    with R.PromptEncoder(tok, chat_template=False, workers=2) as enc:
        for task_prompts in ("abcd", "wxyz"):  # two tasks' calls through one encoder
            samples = [{"prompt": p, "index": i} for i, p in enumerate(task_prompts)]
            R._predict(decode, tok, samples, cfg, 8, lambda b, p: got.extend((s["index"], q) for s, q in zip(b, p)),
                       enc)
    assert got == [(0, "A"), (1, "B"), (2, "C"), (3, "D"), (0, "W"), (1, "X"), (2, "Y"), (3, "Z")]
    assert len(copies) == 2  # made once for both calls
    users = {(obj, thread) for _, obj, thread in log}
    assert {obj for obj, _ in users} == {id(c) for c in copies} and len(users) == 2  # one copy per thread
    assert sorted(p for p, *_ in log) == sorted("abcdwxyz")


def test_encoder_worker_counts(monkeypatch):
    with pytest.raises(ValueError, match="workers must be >= 1"):
        R.PromptEncoder(object(), chat_template=False, workers=0)
    for cores, want in ((None, 1), (1, 1), (2, 1), (3, 2), (16, R.ENCODE_WORKERS_MAX)):
        monkeypatch.setattr(R.os, "cpu_count", lambda c=cores: c)
        assert R.encode_workers() == want


class _GatedTok(_Tok):
    """Encoding "ab" waits for ``gate`` the first time, so the prompts queued behind it have not started."""

    def __init__(self, log, gate: threading.Event):
        super().__init__(log, {})
        self.gate = gate

    def __deepcopy__(self, memo):
        return self

    def __call__(self, prompt, add_special_tokens=True, verbose=False):
        if isinstance(prompt, list):
            return super().__call__(prompt)
        if prompt == "ab" and not self.gate.is_set():
            assert self.gate.wait(timeout=5)
        return super().__call__(prompt, add_special_tokens, verbose)


def test_prefetch_serves_later_submits_and_drops_what_the_previous_prefetch_left():
    log: list = []
    gate = threading.Event()
    with R.PromptEncoder(_GatedTok(log, gate), chat_template=False, workers=1) as enc:
        enc.prefetch(["ab", "cd", "ab"])  # one worker: "ab" runs (held at the gate), "cd" waits in the queue
        first = enc.submit("ab")
        enc.prefetch(["ef"])  # "cd" was never taken: cancelled before it started
        gate.set()
        assert first.result(timeout=5) == [ord("a"), ord("b")]
        assert enc.submit("ab") is not first  # taken once; a second submit encodes again
        assert enc.submit("ef").result(timeout=5) == [ord("e"), ord("f")]
        assert enc.submit("cd").result(timeout=5) == [ord("c"), ord("d")]
    assert [p for p, _, _ in log] == ["ab", "ef", "ab", "cd"]  # "cd" once, by the last submit


def test_the_next_tasks_first_prompts_are_tokenised_while_this_task_decodes(tmp_path, monkeypatch):
    """A 4-task RULER run at 64K once left the GPU idle for 3.7 s of 41 s while each task's prompts were tokenised
    (H100, ``ruler_throughput.py --samples 12``): the first batch of every task waited for its own prompts."""
    tok = build_small_tokenizer()
    cfg = _cfg(tmp_path / "res", samples=2, batch_size=2)  # niah_single_1, then ruler_vt; one batch each
    answers = _half_oracle(tok, cfg)
    vt_prompts = {generate_sample("ruler_vt", tok, 1024, i, cfg.seed)["prompt"] for i in range(2)}
    vt_encoded = threading.Event()
    encoded: list[str] = []
    real, real_many = R.encode_prompt, R.encode_prompts

    def spy(tokenizer, prompt, chat_template):
        ids = real(tokenizer, prompt, chat_template)
        encoded.append(prompt)
        if prompt in vt_prompts:
            vt_encoded.set()
        return ids

    def spy_many(tokenizer, prompts, chat_template):  # a task's first batch
        ids = real_many(tokenizer, prompts, chat_template)
        encoded.extend(prompts)
        if vt_prompts & set(prompts):
            vt_encoded.set()
        return ids

    monkeypatch.setattr(R, "encode_prompt", spy)
    monkeypatch.setattr(R, "encode_prompts", spy_many)

    class WaitingLM(DyingLM):
        waited: list[bool] = []

        def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
            if not self.waited:  # niah_single_1's batch: ruler_vt's prompts are being tokenised meanwhile
                self.waited.append(vt_encoded.wait(timeout=10))
            return super().generate(input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id)

    model = WaitingLM(tok, answers)
    out = R.evaluate_model(model, tok, INFO, cfg, console=_quiet())
    assert model.waited == [True]
    assert len(model.seen) == 4 and len(encoded) == 4 and len(set(encoded)) == 4  # each prompt encoded once
    assert 0.0 < out["scores"]["niah_single_1"]["1024"] < 100.0
    alone = {}
    for task in cfg.tasks:  # the same scores, task by task on fresh encoders
        alone[task] = R.evaluate_model(DyingLM(tok, answers), tok, INFO, _cfg(tmp_path / task, tasks=[task], samples=2,
                                                                              batch_size=2),
                                       console=_quiet())["scores"][task]
    assert out["scores"] == alone


def test_batch_encoding_gives_each_prompts_own_ids():
    """One tokenizer call over prompts of different lengths (no padding, no truncation) equals one call each, with and
    without the special tokens; the tokenizer has a pad token, so padding would show."""
    tok = build_small_tokenizer()
    prompts = [generate_sample(task, tok, 1024, i, 7)["prompt"] for task in ("niah_single_1", "ruler_vt")
               for i in range(2)] + ["x"]
    for chat_template in (False, True):
        want = [R.encode_prompt(tok, p, chat_template) for p in prompts]
        assert R.encode_prompts(tok, prompts, chat_template) == want
        assert len({len(x) for x in want}) > 1 and all(type(t) is int for x in want for t in x)
    assert R.encode_prompts(tok, [], False) == []


class _BatchLog(_Tok):
    """Records each batch call (the prompts in it); raises for a batch holding "boom"."""

    def __init__(self, batches: list):
        super().__init__([], {})
        self.batches = batches

    def __deepcopy__(self, memo):
        return self

    def __call__(self, prompt, add_special_tokens=True, verbose=False):
        if isinstance(prompt, list):
            self.batches.append(list(prompt))
            if "boom" in prompt:
                raise ValueError("cannot encode boom")
        return super().__call__(prompt)


def test_submit_many_splits_the_unprefetched_prompts_into_one_batch_per_worker():
    batches: list = []
    with R.PromptEncoder(_BatchLog(batches), chat_template=False, workers=3) as enc:
        enc.prefetch(["cc"])
        ahead = enc._ahead["cc"]
        futures = enc.submit_many(["a", "bb", "cc", "d", "ee", "f", "gg"])
        assert futures[2] is ahead  # the prefetched one is reused, not encoded again
        assert [f.result(timeout=5) for f in futures] == [[ord(c) for c in p]
                                                         for p in ["a", "bb", "cc", "d", "ee", "f", "gg"]]
        assert sorted(batches) == [["a", "bb"], ["d", "ee"], ["f", "gg"]]  # 6 prompts over 3 workers, in order
        batches.clear()
        two = enc.submit_many(["x", "y"])  # fewer prompts than workers: one batch each
        assert [f.result(timeout=5) for f in two] == [[ord("x")], [ord("y")]] and sorted(batches) == [["x"], ["y"]]
        assert enc.submit_many([]) == []


def test_submit_many_hands_an_error_to_its_batchs_futures_and_skips_cancelled_prompts():
    batches: list = []
    gate = threading.Event()
    with R.PromptEncoder(_BatchLog(batches), chat_template=False, workers=1) as enc:
        blocker = enc._pool.submit(gate.wait, 5)  # the one worker is busy: the batches below wait in the queue
        failing = enc.submit_many(["ok", "boom"])
        later = enc.submit_many(["p", "q"])
        assert later[0].cancel()
        gate.set()
        blocker.result(timeout=5)
        for fut in failing:
            with pytest.raises(ValueError, match="cannot encode boom"):
                fut.result(timeout=5)
        assert later[1].result(timeout=5) == [ord("q")]
        assert later[0].cancelled()
    assert batches == [["ok", "boom"], ["q"]]  # the cancelled prompt was never encoded


def test_a_continuous_batching_decoder_takes_its_requests_per_call_and_each_call_is_saved():
    """``requests_per_call`` already counts every slot (``NativeDecoder``: 4 per slot); a 500-sample task on 32 slots
    once went to the decoder as one call of all 500 (32 x 128 per call), so nothing was saved until the task ended."""
    from hylo_bench.decode.greedy import NativeDecoder

    class Slots:
        requests_per_call = NativeDecoder.requests_per_call  # the real property, on a stub's batch_size
        batch_size = 2

        def __init__(self):
            self.calls: list[int] = []

        def __call__(self, ids, max_new):
            self.calls.append(len(ids))
            return ["".join(map(chr, x)) for x in ids]

    samples = [{"prompt": f"p{i}", "index": i} for i in range(19)]
    cfg = R.RulerConfig(model="m", lengths=[1024], tasks=["niah_single_1"], samples=19, results_dir="r", batch_size=2)
    decode, saved = Slots(), []
    assert R.prompts_per_call(decode, cfg) == 8
    R._predict(decode, _Tok([], {}), samples, cfg, 8, lambda b, p: saved.append([s["index"] for s in b]))
    assert decode.calls == [8, 8, 3]
    assert saved == [list(range(8)), list(range(8, 16)), [16, 17, 18]]

    def plain(ids, max_new):  # a decoder without requests_per_call: cfg.batch_size prompts a call
        plain.calls.append(len(ids))
        return ["" for _ in ids]

    plain.calls = []
    R._predict(plain, _Tok([], {}), samples[:5], cfg, 8, lambda b, p: None)
    assert plain.calls == [2, 2, 1] and R.prompts_per_call(plain, cfg) == 2
