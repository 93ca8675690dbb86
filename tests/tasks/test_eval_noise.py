"""``eval`` and ``ruler`` print no false warnings: lm-eval's "`pretrained` model kwarg is not of type `str`" (the
model now goes through HFLM's own loading hooks), ``fatal: not a git repository`` outside a checkout (lm-eval's
git probe, made quiet), and transformers' "indexing errors" warning for text the tokenizer's model_max_length does
not cover but that is never fed to the model untruncated (RULER sizing probes, lm-eval's truncated contexts)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from typer.testing import CliRunner

from hylo_bench.cli import app
from tests.tasks.lmeval_fixtures import write_fixtures

NOISE = ("not of type `str`", "Passed an already-initialized model", "fatal: not a git repository",
         "indexing errors")


def _short_tokenizer_copy(src: Path, dst: Path) -> Path:
    """The checkpoint with its tokenizer's model_max_length at 48 tokens (PIQA prompts and RULER probes exceed it)."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps(cfg | {"model_max_length": 48}))
    return dst


def test_eval_and_ruler_print_no_false_warnings(tiny_base_dir, tmp_path, monkeypatch, capfd, caplog):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    ckpt = _short_tokenizer_copy(tiny_base_dir, tmp_path / "ckpt")
    data = write_fixtures(tmp_path / "data", tasks=["piqa"])
    work = tmp_path / "not_a_checkout"  # lm-eval runs `git describe` in the working directory
    work.mkdir()
    monkeypatch.chdir(work)
    caplog.set_level(logging.INFO)
    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(ckpt), "--tasks", "piqa", "--data-dir", str(data), "--limit", "2",
                              "--max-length", "512", "--output-dir", str(tmp_path / "out"), "--device", "cpu",
                              "--json"])
    assert res.exit_code == 0, res.output
    scores = json.loads(res.stdout.strip().splitlines()[-1])["scores"]
    assert set(scores["piqa"]) == {"acc", "acc_norm"}
    lm_eval_file = next((tmp_path / "out" / "lm-eval").rglob("results_*.json"))
    assert json.loads(lm_eval_file.read_text())["git_hash"] is None  # no checkout here: lm-eval's own answer
    res = runner.invoke(app, ["ruler", "--model", str(ckpt), "--lengths", "512", "--tasks", "niah_single_1",
                              "--samples", "1", "--results-dir", str(tmp_path / "ruler"), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    captured = capfd.readouterr()
    text = captured.out + captured.err + res.output + caplog.text
    assert [n for n in NOISE if n in text] == [], [n for n in NOISE if n in text]
    assert os.getcwd() == str(work)


def test_eval_bad_tasks_offline_data_and_output_paths_fail_cleanly(tiny_base_dir, tmp_path, monkeypatch):
    """Each was a traceback: an unknown task (lm-eval's KeyError), a Hub dataset offline (ConnectionError), an
    output folder under a regular file (NotADirectoryError)."""
    from hylo_bench.models import loading
    from tests.snapshot import changes, tree_snapshot

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty_datasets_cache"))
    work = tmp_path / "w"
    work.mkdir()
    (work / "a_file").write_text("not a folder")
    monkeypatch.chdir(work)
    real_load = loading.load_model
    loads = []
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    runner = CliRunner()
    before = tree_snapshot(work)
    res = runner.invoke(app, ["eval", str(tiny_base_dir), "--tasks", "arc_easy,no_such_task", "--output-dir",
                              str(work / "out"), "--device", "cpu"])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert "--tasks: 'no_such_task' (closest: " in out, out
    assert "is not a task, group or tag that lm-eval 0.4.13 knows; `lm-eval ls tasks` lists them" in out, out
    assert loads == []  # refused before the model was loaded
    res = runner.invoke(app, ["eval", str(tiny_base_dir), "--tasks", "arc_easy", "--output-dir",
                              str(work / "a_file" / "out"), "--device", "cpu"])
    assert res.exit_code == 2 and f"--output-dir {work / 'a_file' / 'out'}: {work / 'a_file'} is a file" in \
        " ".join(res.output.split())
    assert changes(before, tree_snapshot(work)) == []
    res = runner.invoke(app, ["eval", str(tiny_base_dir), "--tasks", "arc_easy", "--limit", "2", "--output-dir",
                              str(tmp_path / "out"), "--device", "cpu"])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "lm-eval could not load a task's dataset from the Hugging Face Hub" in out, out
    assert "pass --data-dir DIR with DIR/<task>/<split>.jsonl" in out
