"""Multi-process RULER: sharded predictions equal one process's (threads with a shared barrier for the scripted
model; two spawned CPU workers loading a tiny checkpoint), and actionable device errors."""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from hylo_bench.tasks.ruler import RulerConfig, evaluate_model, generate_sample, run
from hylo_bench.tasks.ruler.parallel import run_parallel, worker_device
from hylo_bench.tasks.ruler.runner import Shard
from tests.tasks.test_ruler_runner import (
    INFO,
    DyingLM,
    _cfg,
    _half_oracle,
    _quiet,
    build_small_tokenizer,
    tiny_llama_config,
)


@pytest.fixture(scope="module")
def tok():
    return build_small_tokenizer()


def _prediction_files(results_dir) -> dict[str, list[dict]]:
    return {f.name: [json.loads(line) for line in f.read_text().splitlines()]
            for f in sorted((results_dir / "predictions").glob("*.jsonl"))}


def test_two_shards_split_the_samples_and_match_one_process(tok, tmp_path):
    cfg = _cfg(tmp_path / "one", samples=5)
    answers = _half_oracle(tok, cfg)
    single = evaluate_model(DyingLM(tok, answers), tok, INFO, cfg, console=_quiet())
    assert 0.0 < single["scores"]["niah_single_1"]["1024"] < 100.0

    cfg2 = _cfg(tmp_path / "two", samples=5)
    barrier = threading.Barrier(2, timeout=120)
    # one tokenizer per thread, as separate processes have: a Rust tokenizer shared by two threads that set its
    # padding / truncation concurrently is not thread-safe (this test was flaky with a shared one)
    toks = [copy.deepcopy(tok), copy.deepcopy(tok)]
    models, out, errors = [DyingLM(toks[0], answers), DyingLM(toks[1], answers)], {}, []

    calls = {0: 0, 1: 0}

    def wait(rank: int) -> None:
        barrier.wait()
        calls[rank] += 1
        if rank == 1 and calls[1] == 2:  # the first task's decode barrier: let rank 0 append a row first (this
            # race made rank 1 count that row as done and decode the wrong samples; CI caught it now and then)
            pred_dir, t0 = tmp_path / "two" / "predictions", time.monotonic()
            while not list(pred_dir.glob("*.rank0of2.jsonl")) and time.monotonic() - t0 < 30:
                time.sleep(0.01)

    def worker(rank: int) -> None:
        try:
            shard = Shard(rank=rank, world_size=2, barrier=lambda: wait(rank))
            out[rank] = evaluate_model(models[rank], toks[rank], INFO, cfg2, console=_quiet(), shard=shard)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert out[1] is None and out[0]["scores"] == single["scores"] and out[0]["mean"] == single["mean"]
    for task in cfg.tasks:  # rank r decoded samples r, r + 2, ...
        prompts = [tuple(tok(generate_sample(task, tok, 1024, i, 42)["prompt"]).input_ids) for i in range(5)]
        assert [p for p in models[0].seen if p in prompts] == prompts[0::2]
        assert [p for p in models[1].seen if p in prompts] == prompts[1::2]
    assert _prediction_files(tmp_path / "two") == _prediction_files(tmp_path / "one")
    doc = json.loads(Path(out[0]["results_path"]).read_text())
    assert doc["provenance"]["num_processes"] == 2 and doc["config"]["devices"] == 1


def test_spawned_cpu_workers_equal_one_process(tok, tmp_path):
    torch.manual_seed(0)
    config = tiny_llama_config(tok)
    ckpt = tmp_path / "ckpt"
    LlamaForCausalLM(config).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    base = {"model": str(ckpt), "lengths": [1024], "tasks": ["ruler_vt"], "samples": 3, "device": "cpu"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = run(RulerConfig(**base, results_dir=tmp_path / "one"), console=_quiet())
    finally:
        torch.set_num_threads(threads)
    two = run(RulerConfig(**base, results_dir=tmp_path / "two", devices=2), console=_quiet())
    assert two["scores"] == one["scores"] and two["mean"] == one["mean"]
    preds_one, preds_two = _prediction_files(tmp_path / "one"), _prediction_files(tmp_path / "two")
    assert preds_two == preds_one and [r["index"] for r in next(iter(preds_one.values()))] == [0, 1, 2]
    assert all(r["prediction"] for rows in preds_one.values() for r in rows)  # a random model still says something
    doc = json.loads(Path(two["results_path"]).read_text())
    assert doc["provenance"]["num_processes"] == 2 and doc["provenance"]["device"] == "cpu"


def test_device_errors_are_actionable(tmp_path, monkeypatch):
    assert worker_device("cpu", 3) == "cpu"
    with pytest.raises(ValueError, match="pass --device cuda"):
        worker_device("cuda:1", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="worker 1 needs cuda:1 but 1 GPU"):
        worker_device(None, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4"):
        run_parallel(_cfg(tmp_path, devices=2))
    with pytest.raises(ValueError, match="devices must be >= 1"):
        _cfg(tmp_path, devices=0)


def test_consolidate_merges_shards_of_any_world_size(tmp_path):
    from hylo_bench.tasks.ruler import predictions as P

    samples = [{"index": i, "prompt": f"prompt {i}"} for i in range(5)]
    path = P.predictions_path(tmp_path, task="ruler_vt", length_tokens=1024, model_hash="m" * 64, dtype="float32",
                              tok_hash="t" * 64, data_hash="d" * 64, seed=42, flavor="nvidia", chat_template=False,
                              max_gen_toks=30)
    assert path.name == (f"ruler_vt-1024-nvidia-modelmmmmmmmmmmmm-float32-toktttttttttttt-seed42-haydddddddd-gen30-"
                         f"v{P.GENERATOR_VERSION}.jsonl")
    rows = [P.prediction_row(samples[0], "a"), P.prediction_row(samples[2], "c")]
    P.append_predictions(P.shard_path(path, 0, 2), rows)
    P.append_predictions(P.shard_path(path, 1, 2), [P.prediction_row(samples[1], "b")])
    P.append_predictions(P.shard_path(path, 2, 3), [P.prediction_row(samples[4], "e")])
    assert P.consolidate(path, samples) == {0: "a", 1: "b", 2: "c", 4: "e"}
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert [json.loads(line)["index"] for line in path.read_text().splitlines()] == [0, 1, 2, 4]
    P.discard(path)
    assert not path.exists()
