"""Command line: task listing, clear errors on bad input, the --json contract of ruler."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from hylo_bench.cli import app
from hylo_bench.tasks.ruler import list_tasks

runner = CliRunner()


def test_list_tasks_prints_one_name_per_line():
    res = runner.invoke(app, ["ruler", "--list-tasks"])
    assert res.exit_code == 0
    assert res.stdout.split() == list_tasks()
    assert {"niah_single_1", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe"} <= set(res.stdout.split())


def test_python_dash_m_works_like_the_console_script():
    res = subprocess.run([sys.executable, "-m", "hylo_bench", "ruler", "--list-tasks"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split() == list_tasks()


def test_bad_layout_and_stages_fail_with_named_flag(tiny_base_dir, tmp_path):
    res = runner.invoke(app, ["upcycle", "--base", str(tiny_base_dir), "--out", str(tmp_path / "o"),
                              "--layout", "3MLA3GDN", "--device", "cpu", "--allow-demo-data"])
    assert res.exit_code == 2 and "--layout '3MLA3GDN' has 3+3=6 layers; the base model has 4" in res.output
    res = runner.invoke(app, ["upcycle", "--base", str(tiny_base_dir), "--out", str(tmp_path / "o"),
                              "--stages", "2k:foo", "--device", "cpu", "--allow-demo-data"])
    assert res.exit_code == 2 and "kind 'foo'" in res.output
    res = runner.invoke(app, ["upcycle", "--base", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "nope" in res.output


def test_ruler_json_contract(tiny_base_dir, tmp_path):
    res = runner.invoke(app, ["ruler", "--model", str(tiny_base_dir), "--lengths", "1k", "--tasks",
                              "niah_single_1", "--samples", "2", "--results-dir", str(tmp_path), "--json",
                              "--device", "cpu"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["model"] == str(tiny_base_dir)
    assert set(obj["scores"]) == {"niah_single_1"} and set(obj["scores"]["niah_single_1"]) == {"1024"}
    assert 0 <= obj["mean"]["1024"] <= 100
    saved = [p for p in tmp_path.glob("ruler-*.json")]
    assert len(saved) == 1 and json.loads(saved[0].read_text())["records"][0]["n"] == 2


def test_ruler_resume_engine_and_devices_flags(tiny_base_dir, tmp_path):
    args = ["ruler", "--model", str(tiny_base_dir), "--lengths", "1k", "--tasks", "niah_single_1", "--samples", "2",
            "--results-dir", str(tmp_path), "--json", "--device", "cpu"]
    first = runner.invoke(app, [*args, "--engine", "generate"])
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, [*args, "--resume", "--engine", "native"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["scores"] == json.loads(first.stdout)["scores"]
    doc = json.loads(open(json.loads(again.stdout)["results_path"]).read())
    assert doc["config"]["resume"] is True and doc["provenance"]["engine"] == "native"
    res = runner.invoke(app, [*args, "--devices", "0"])
    assert res.exit_code == 2 and "devices must be >= 1" in res.output


def test_ruler_backend_lm_eval_end_to_end_and_bad_input(tiny_base_dir, tmp_path):
    """lm-eval's own niah_single_1 through the CLI on a checkpoint directory: its tokenizer is the model's own,
    lm-eval's default seed, the native --json shape; unsupported combinations fail with the flag named."""
    args = ["ruler", "--model", str(tiny_base_dir), "--backend", "lm-eval", "--lengths", "2k", "--samples", "1",
            "--results-dir", str(tmp_path), "--device", "cpu"]
    res = runner.invoke(app, [*args, "--tasks", "niah_single_1", "--json"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert obj["backend"] == "lm-eval" and obj["flavor"] == "lm-eval" and obj["model"] == str(tiny_base_dir)
    assert set(obj["scores"]) == {"niah_single_1"} and set(obj["scores"]["niah_single_1"]) == {"2048"}
    assert 0 <= obj["mean"]["2048"] <= 100
    doc = json.loads(open(obj["results_path"]).read())
    assert doc["provenance"]["backend"] == "lm-eval" and doc["seed"] == 0
    assert doc["provenance"]["tokenizer_source"] == "model directory" and doc["records"][0]["n"] == 1
    for extra, message in ((["--tasks", "niah_single_9"], "no lm-eval 0.4.13 ruler task for 'niah_single_9'"),
                           (["--tasks", "niah_single_1", "--flavor", "nvidia"], "flavor 'nvidia'"),
                           (["--tasks", "niah_single_1", "--devices", "2"], "--devices 2"),
                           (["--tasks", "niah_single_1", "--backend", "vllm"], "--backend: expected one of")):
        res = runner.invoke(app, [*args, *extra])
        assert res.exit_code == 2 and message in res.output, res.output


def test_upcycle_help_quotes_the_config_defaults():
    """The help of ``hylo-bench upcycle`` states UpcycleConfig's defaults (their one home), not copies of them."""
    from hylo_bench.cli import app
    from hylo_bench.config import upcycle as U

    res = runner.invoke(app, ["upcycle", "--help"], env={"COLUMNS": "240", "NO_COLOR": "1", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    text = " ".join(part.strip(" │") for part in res.output.splitlines())
    text = " ".join(text.split())
    d = U.upcycle_default
    for want in (f"(default {d('batch_size')})", f"(default {d('grad_accum')})", f"(default {d('eval_windows')})",
                 f"(default {d('save_every')})", f"(default {d('select_windows')})", f"Default {d('seed')}.",
                 f"(default {d('tokens_per_stage'):,})", "Default 0.0002, 0.004 for the demo",
                 "Default 6e-5 (paper), 0.0003 for the demo"):
        assert want in text, want
    assert (U.DEFAULT_ILD_LR, U.DEMO_ILD_LR, U.DEFAULT_KD_LR, U.DEMO_KD_LR) == (2e-4, 4e-3, 6e-5, 3e-4)
    with pytest.raises(KeyError, match="no such field"):
        d("out")
