"""RULER decoding retries a batch that runs out of GPU memory at half the batch size, with the same predictions."""

from __future__ import annotations

import pytest

from hylo_bench.tasks.ruler import runner as R


class OutOfMemoryError(RuntimeError):  # the name torch.OutOfMemoryError has
    pass


def test_a_batch_out_of_memory_is_split_and_the_rest_stays_smaller(tiny_tokenizer, monkeypatch):
    seen: list[int] = []

    def decode(ids, max_new):
        seen.append(len(ids))
        if len(ids) > 2:
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 12.50 GiB")
        return [f"p{len(x)}" for x in ids]

    monkeypatch.setattr("torch.cuda.empty_cache", lambda: None)
    samples = [{"prompt": "x" * (i + 1), "index": i} for i in range(7)]
    cfg = R.RulerConfig(model="m", lengths=[1024], tasks=["niah_single_1"], samples=7, results_dir="r", batch_size=5)
    got: list[tuple[int, str]] = []
    R._predict(decode, tiny_tokenizer, samples, cfg, 8, lambda b, p: got.extend((s["index"], q) for s, q in zip(b, p)))
    assert seen == [5, 2, 2, 2, 1]  # 5 fails, then 2 at a time for the rest
    want = [(s["index"], f"p{len(R.encode_prompt(tiny_tokenizer, s['prompt'], False))}") for s in samples]
    assert got == want


def test_other_errors_and_single_prompt_oom_are_raised(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr("torch.cuda.empty_cache", lambda: None)
    cfg = R.RulerConfig(model="m", lengths=[1024], tasks=["niah_single_1"], samples=7, results_dir="r", batch_size=1)

    def oom(ids, max_new):
        raise OutOfMemoryError("CUDA out of memory")

    with pytest.raises(OutOfMemoryError):
        R._predict(oom, tiny_tokenizer, [{"prompt": "a", "index": 0}], cfg, 8, lambda b, p: None)

    def bad(ids, max_new):
        raise ValueError("not memory")

    cfg.batch_size = 4
    with pytest.raises(ValueError, match="not memory"):
        R._predict(bad, tiny_tokenizer, [{"prompt": "a", "index": i} for i in range(3)], cfg, 8, lambda b, p: None)


def test_cudnn_workspace_allocation_failure_counts_as_out_of_memory():
    """The H200 message of cuDNN attention on a full GPU (mini reproduction, attempt 2) is retried like an OOM."""
    msg = ("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good() to be true, but got "
           "false.  (Could this error message be improved?  If so, please report an enhancement request to PyTorch.)")
    assert R._is_oom(RuntimeError(msg))
    assert R._is_oom(OutOfMemoryError("anything"))
    assert not R._is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
