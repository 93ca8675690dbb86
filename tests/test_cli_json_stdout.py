"""Issue 19 items 13-14: ``--json`` prints the JSON alone on stdout, whatever the libraries print on the way, and
``ruler --samples`` defaults to the references' 500."""

from __future__ import annotations

import json
import types

import typer.main
from typer.testing import CliRunner

from hylo_bench.cli import app

runner = CliRunner()


def test_ruler_samples_default_is_the_references_500():
    # NVIDIA/RULER scripts/run.sh NUM_SAMPLES=500; lm-eval 0.4.13 ruler get_dataset(num_samples=500)
    ruler = typer.main.get_command(app).commands["ruler"]
    assert {p.name: p.default for p in ruler.params}["samples"] == 500


def test_ruler_json_stdout_is_the_json_alone(tiny_base_dir, tmp_path, monkeypatch):
    from hylo_bench.tasks import ruler as R

    real = R.run

    def noisy(cfg, console=None, on_result=None):
        print("Downloaded punkt_tab on rank 0")  # what lm-eval's prepare_niah prints at import
        return real(cfg, console=console, on_result=on_result)

    monkeypatch.setattr(R, "run", noisy)
    res = runner.invoke(app, ["ruler", "--model", str(tiny_base_dir), "--lengths", "1k", "--tasks", "niah_single_1",
                              "--samples", "1", "--results-dir", str(tmp_path), "--json", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.stdout)
    assert set(obj["scores"]) == {"niah_single_1"}
    assert "Downloaded punkt_tab" in res.stderr


def test_eval_json_stdout_is_the_json_alone(monkeypatch, tmp_path):
    from hylo_bench.tasks import lm_eval_bridge as E

    summary = {"model": "demo-teacher", "scores": {"piqa": {"acc": 50.0}}, "n_samples": {"piqa": 2},
               "num_fewshot": {"piqa": 0}, "results_path": str(tmp_path / "a.json"),
               "lm_eval_results_path": str(tmp_path / "b.json")}

    def noisy(cfg, on_result=None):
        print("lm-eval chatter on stdout")
        return summary

    monkeypatch.setattr(E, "run", noisy)
    res = runner.invoke(app, ["eval", "demo", "--tasks", "piqa", "--json", "--output-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == summary and "chatter" in res.stderr


def test_lm_eval_backend_import_prints_nothing_on_stdout(monkeypatch, capsys):
    """The no-download import of lm-eval's prepare_niah swallows its false "Downloaded punkt_tab" line."""
    from hylo_bench.tasks.ruler import lm_eval_backend as LB

    class Fake:
        pass

    def fake_import(name):
        print("Downloaded punkt_tab on rank 0")
        return Fake

    monkeypatch.setattr(LB, "_punkt_available", lambda: False)
    monkeypatch.setattr(LB, "importlib", types.SimpleNamespace(import_module=fake_import))
    module, splitter = LB._import_prepare_niah()
    assert module is Fake and "regex splitter" in splitter
    assert capsys.readouterr().out == ""
