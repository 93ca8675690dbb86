"""One home for defaults: the library (a run config built in Python) and the CLI resolve the same run for the same
inputs. Each command's ``run`` is replaced by a recorder of the config it receives, so nothing is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hylo_bench.cli import app
from hylo_bench.config.upcycle import DEMO_ILD_LR, DEMO_KD_LR, DEMO_STAGES, UpcycleConfig


@pytest.fixture
def captured(monkeypatch, tmp_path):
    """Run the CLI in ``tmp_path`` with every command's ``run`` recording its config instead of running."""
    monkeypatch.chdir(tmp_path)
    got: dict = {}

    def upcycle_run(cfg, on_result=None):
        got["cfg"] = cfg
        return {"kl_init": None, "stages": [{}]}

    def ruler_run(cfg, *, console=None, on_result=None):
        got["cfg"] = cfg
        return None

    def eval_run(cfg, on_result=None):
        got["cfg"] = cfg
        return None

    def sweep_run(cfg, console, runner, on_result=None):
        got["cfg"] = cfg
        return {}

    monkeypatch.setattr("hylo_bench.upcycle.run.run", upcycle_run)
    monkeypatch.setattr("hylo_bench.tasks.ruler.run", ruler_run)
    monkeypatch.setattr("hylo_bench.tasks.lm_eval_bridge.run", eval_run)
    monkeypatch.setattr("hylo_bench.serving.sweep.run_with_progress", sweep_run)

    def invoke(*args: str):
        res = CliRunner().invoke(app, list(args))
        assert res.exit_code == 0, res.output
        return got.pop("cfg")

    return invoke


def test_upcycle_demo_defaults_agree(captured, tmp_path):
    lib = UpcycleConfig(out="o")
    assert captured("upcycle", "--out", "o") == lib
    # the tuned demo schedule, whichever way the run is started (it used to be 2e-4 / 6e-5 from Python)
    assert (lib.stages, lib.ild_lr, lib.kd_lr) == (DEMO_STAGES, DEMO_ILD_LR, DEMO_KD_LR) == ("1k:ild@750k,1k@250k",
                                                                                           4e-3, 3e-4)


def test_upcycle_real_base_defaults_agree(captured):
    lib = UpcycleConfig(out="o", base="my/model", data="corpus.jsonl")
    assert captured("upcycle", "--out", "o", "--base", "my/model", "--data", "corpus.jsonl") == lib
    assert (lib.stages, lib.ild_lr, lib.kd_lr) == ("2k:ild,8k", 2e-4, 6e-5)  # the paper's learning rates


def test_upcycle_explicit_values_win(captured):
    lib = UpcycleConfig(out="o", stages="64:ild@1k", ild_lr=1e-3, kd_lr=2e-5, seed=7, batch_size=2)
    cli = captured("upcycle", "--out", "o", "--stages", "64:ild@1k", "--ild-lr", "1e-3", "--kd-lr", "2e-5",
                   "--seed", "7", "--batch-size", "2")
    assert cli == lib and (cli.ild_lr, cli.kd_lr, cli.seed) == (1e-3, 2e-5, 7)


def test_ruler_defaults_agree(captured):
    from hylo_bench.tasks.ruler import RulerConfig

    cli = captured("ruler", "--model", "demo", "--tasks", "niah_single_1", "--lengths", "1k", "--samples", "3",
                   "--results-dir", "res")
    assert cli == RulerConfig(model="demo", lengths=[1024], tasks=["niah_single_1"], samples=3, results_dir="res")
    assert (cli.seed, cli.flavor) == (42, "nvidia")


def test_ruler_lm_eval_backend_defaults_agree(captured):
    from hylo_bench.tasks.ruler import RulerConfig

    cli = captured("ruler", "--model", "demo", "--tasks", "niah_single_1", "--lengths", "1k", "--samples", "3",
                   "--results-dir", "res", "--backend", "lm-eval")
    lib = RulerConfig(model="demo", lengths=[1024], tasks=["niah_single_1"], samples=3, results_dir="res",
                      backend="lm-eval")
    assert cli == lib
    assert (lib.seed, lib.flavor) == (0, "lm-eval")  # lm-eval's own seed and prompts


def test_eval_defaults_agree(captured):
    from hylo_bench.tasks.lm_eval_bridge import EvalConfig

    cli = captured("eval", "demo", "--tasks", "arc_easy", "--output-dir", "res")
    assert cli == EvalConfig(model="demo", tasks=["arc_easy"], output_dir=Path("res"))


def test_sweep_defaults_agree(captured):
    from hylo_bench.serving.sweep import SweepConfig

    cli = captured("sweep", "demo", "--contexts", "16,32", "--out", "s.json", "--no-store")
    assert cli == SweepConfig(model="demo", contexts_tokens=[16, 32], batch_sizes=[1], out=Path("s.json"))
