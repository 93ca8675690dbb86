"""Per-step telemetry: OUT/train_log.jsonl contents, resume without duplicate lines, FLOPs/MFU, TensorBoard."""

from __future__ import annotations

import builtins
import json
import logging

import pytest

from hylo_bench.config.upcycle import UpcycleConfig
from hylo_bench.upcycle.run import run
from hylo_bench.upcycle.train import trainer as trainer_mod
from hylo_bench.upcycle.train.metrics import TrainLog, train_flops_per_token
from hylo_bench.upcycle.train.trainer import cosine_lr

KEYS = {"stage", "stage_index", "kind", "step", "tokens_seen", "loss", "kl", "lr", "grad_norm", "tokens_per_s", "mfu",
        "peak_memory_bytes", "memory_kind", "step_time_s", "wall_time_s", "time_utc"}


def _cfg(base_dir, out, **kw):
    return UpcycleConfig(out=str(out), base=str(base_dir), data="demo", allow_demo_data=True,
                         stages="64:ild@900,128@800", batch_size=2,
                         ild_lr=2e-4, kd_lr=1e-3, eval_windows=0, device="cpu", save_every=2, tensorboard=False, **kw)


def _lines(out):
    return [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]


def test_train_log_has_one_line_per_step(tiny_base_dir, tmp_path):
    out = tmp_path / "out"
    manifest = run(_cfg(tiny_base_dir, out, peak_tflops=1.0))
    lines = _lines(out)
    ild = [r for r in lines if r["stage_index"] == 0]
    kd = [r for r in lines if r["stage_index"] == 1]
    assert [r["step"] for r in ild] == list(range(1, 8)) and [r["step"] for r in kd] == [1, 2, 3]
    assert lines == ild + kd  # appended in order
    for r in lines:
        assert KEYS <= set(r), KEYS - set(r)
    assert {r["stage"] for r in ild} == {"ild-64"} and {r["kind"] for r in kd} == {"kd"}
    assert [r["tokens_seen"] for r in kd] == [256, 512, 768]
    assert [r["lr"] for r in kd] == pytest.approx([1e-3 * cosine_lr(s, 3, 0.01) for s in range(3)])
    assert all(r["kl"] is None and "ild_hidden" in r and "ild_mixer" in r for r in ild)
    assert all(r["kl"] == r["loss"] for r in kd)
    # the manifest keeps its own per-step losses; the log agrees with it
    assert [x["loss"] for x in manifest["stages"][1]["losses"]] == [r["loss"] for r in kd]
    assert all(r["peak_memory_bytes"] > 0 and r["memory_kind"] == "process_max_rss" for r in lines)
    walls = [r["wall_time_s"] for r in kd]
    assert walls == sorted(walls)
    # MFU = tokens/s * FLOPs/token / peak, FLOPs/token = 6 N_student + 2 N_teacher (embeddings excluded;
    # lm_heads excluded for ILD). Parameter counts from the configs, not from the code under test.
    from hylo_bench.models.hybrid import load_hylo

    student = load_hylo(out, dtype=None)
    n_embed = student.config.vocab_size * student.config.hidden_size
    n_s = sum(p.numel() for p in student.parameters())
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    n_t = sum(p.numel() for p in teacher.parameters())
    flops_kd = 6 * (n_s - n_embed) + 2 * (n_t - n_embed)
    flops_ild = 6 * (n_s - 2 * n_embed) + 2 * (n_t - 2 * n_embed)
    assert train_flops_per_token(student, teacher, "kd") == flops_kd
    assert train_flops_per_token(student, teacher, "ild") == flops_ild
    for r, f in [(kd[0], flops_kd), (ild[-1], flops_ild)]:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * f / 1e12, rel=1e-12)


def test_resume_does_not_duplicate_lines(tiny_base_dir, tmp_path, monkeypatch):
    out = tmp_path / "cut"
    calls = {"n": 0}
    real = trainer_mod.ild_loss

    def die_in_step_4(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:  # resume.pt holds step 2, the log already has steps 1-3
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(trainer_mod, "ild_loss", die_in_step_4)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(tiny_base_dir, out))
    monkeypatch.setattr(trainer_mod, "ild_loss", real)
    before = _lines(out)
    assert [r["step"] for r in before] == [1, 2, 3]
    run(_cfg(tiny_base_dir, out))
    after = _lines(out)
    assert [(r["stage_index"], r["step"]) for r in after] == [(0, s) for s in range(1, 8)] + [(1, 1), (1, 2), (1, 3)]
    assert after[:2] == before[:2]  # lines up to the resumed step are kept as written
    assert after[2]["loss"] == before[2]["loss"]  # step 3 is recomputed from the same state and batch
    assert after[2]["tokens_seen"] == before[2]["tokens_seen"] == 3 * 2 * 64


def test_train_log_truncation_and_bad_lines(tmp_path, caplog):
    log = TrainLog(tmp_path, tensorboard=False)
    log.start_stage(0, "ild-64", 0)
    for s in range(1, 5):
        log.log({"stage": "ild-64", "stage_index": 0, "step": s})
    log.start_stage(1, "kd-128", 0)
    log.log({"stage": "kd-128", "stage_index": 1, "step": 1})
    log.close()
    with (tmp_path / "train_log.jsonl").open("a") as f:
        f.write('{"stage": "kd-128", "stage_ind')  # cut by a crash
    log.start_stage(0, "ild-64", 2)  # stage 0 resumed at step 2: its steps 3-4, stage 1 and the bad line go
    log.log({"stage": "ild-64", "stage_index": 0, "step": 3, "loss": 0.5})
    log.close()
    assert [(r["stage_index"], r["step"]) for r in _lines(tmp_path)] == [(0, 1), (0, 2), (0, 3)]
    assert _lines(tmp_path)[-1]["loss"] == 0.5


def test_missing_tensorboard_is_reported(tmp_path, caplog, monkeypatch):
    real_import = builtins.__import__

    def no_tb(name, *a, **k):
        if name.startswith(("torch.utils.tensorboard", "tensorboard")):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tb)
    log = TrainLog(tmp_path, tensorboard=True)
    with caplog.at_level(logging.INFO, logger="hylo_bench.upcycle.train.metrics"):
        log.start_stage(0, "kd-8k", 0)
    log.log({"stage": "kd-8k", "stage_index": 0, "step": 1, "loss": 1.0})
    log.close()
    assert "tensorboard is not installed" in caplog.text and "hylo-bench[tensorboard]" in caplog.text
    assert not (tmp_path / "tb").exists() and len(_lines(tmp_path)) == 1


def test_tensorboard_events_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = TrainLog(tmp_path, tensorboard=True)
    log.start_stage(0, "kd-8k", 0)
    for s in range(1, 4):
        log.log({"stage": "kd-8k", "stage_index": 0, "step": s, "loss": 1.0 / s, "kl": None, "time_utc": "x"})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb" / "0-kd-8k"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([1.0, 0.5, 1 / 3])
    # resumed after step 1: the reader drops the orphaned steps 2-3 of the first session
    log.start_stage(0, "kd-8k", 1)
    for s in (2, 3):
        log.log({"stage": "kd-8k", "stage_index": 0, "step": s, "loss": 10.0 * s})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tb" / "0-kd-8k"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 1.0), (2, 20.0), (3, 30.0)]
