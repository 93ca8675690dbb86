"""``upcycle`` checks every argument and path before torch is imported or a model loads, refuses an output folder
that holds another model (unless --overwrite), and loading warns about weights that cannot be right."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hylo_bench.upcycle.checks import check_out_dir

REPO = Path(__file__).resolve().parents[2]
# Runs in a fresh interpreter where importing torch, transformers, safetensors, lm-eval or accelerate raises: a
# command that gets past its argument checks fails with ImportError, one that checks first exits 2 with its message.
_NO_TORCH = r"""
import json, sys
BLOCKED = ("torch", "transformers", "safetensors", "lm_eval", "accelerate", "tokenizers")
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
from typer.testing import CliRunner
from hylo_bench.cli import app
out = []
for argv in json.loads(sys.argv[1]):
    res = CliRunner().invoke(app, argv)
    out.append({"code": res.exit_code, "output": " ".join(res.output.split()), "exc": repr(res.exception)})
out.append(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
print(json.dumps(out))
"""


def test_upcycle_arguments_are_checked_before_torch_is_imported(tiny_base_dir, tmp_path):
    """The errors once came after 13-17 s of imports and model loading; here torch cannot even be imported."""
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    base = ["upcycle", "--base", str(tiny_base_dir), "--device", "cpu", "--allow-demo-data"]
    cases = [
        ([*base, "--out", str(tmp_path / "other")],
         f"--out {tmp_path / 'other'}: holds files this run did not write (model.safetensors)"),
        ([*base, "--out", str(tmp_path / "o"), "--data", str(tmp_path / "latin1.txt")],
         "not UTF-8 text (byte 0xe9 at offset 3)"),
        ([*base, "--out", str(tmp_path / "o"), "--layout", "3MLA3GDN"],
         "--layout '3MLA3GDN' has 3+3=6 layers; the base model has 4"),
        ([*base, "--out", str(tmp_path / "o"), "--mla-layers", "0,0"], "--mla-layers [0, 0]: expected distinct"),
        ([*base, "--out", str(tmp_path / "o"), "--batch-size", "0"], "--batch-size 0: expected an integer >= 1"),
        ([*base, "--out", str(tmp_path / "o"), "--stages", "2k:foo"], "kind 'foo' is not 'ild' or 'kd'"),
        (["upcycle", "--base", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--allow-demo-data"],
         "no such directory"),
        ([*base, "--out", str(tmp_path / "o"), "--device", "gpu"], "--device 'gpu': not a torch device"),
        ([*base, "--out", str(tmp_path / "o"), "--recipe", "HyLo-Nope"], "HyLo-Nope"),
    ]
    res = subprocess.run([sys.executable, "-c", _NO_TORCH, json.dumps([argv for argv, _ in cases])], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin"},
                         check=False)
    assert res.returncode == 0, res.stderr
    *results, imported = json.loads(res.stdout.splitlines()[-1])
    for (argv, message), got in zip(cases, results):
        assert got["code"] == 2 and message in got["output"], (argv, got)
    assert imported == []  # not even torch was imported on the way to any of these errors
    assert not (tmp_path / "o").exists()


def test_out_dir_rules(tmp_path):
    out = tmp_path / "out"
    check_out_dir(out, overwrite=False)  # new: fine
    out.mkdir()
    check_out_dir(out, overwrite=False)  # empty: fine
    # what a run killed before its first manifest leaves: the layer selection and a cut atomic write
    (out / "layer_selection.json").write_text("{}")
    (out / ".manifest.json.k2j3.tmp").write_text("{")
    check_out_dir(out, overwrite=False)
    (out / "config.json").write_text("{}")  # a model's file without an upcycle manifest: another model
    with pytest.raises(ValueError, match=r"holds files this run did not write \(config.json\)"):
        check_out_dir(out, overwrite=False)
    check_out_dir(out, overwrite=True)
    (out / "manifest.json").write_text(json.dumps({"kind": "upcycle"}))  # an earlier run of upcycle: resumed
    check_out_dir(out, overwrite=False)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json is not a readable upcycle manifest"):
        check_out_dir(out, overwrite=False)


def test_overwrite_writes_the_student_into_a_folder_holding_another_model(tiny_base_dir, tmp_path):
    from typer.testing import CliRunner

    from hylo_bench.cli import app
    from hylo_bench.models.checkpoint import demo_teacher_dir

    out = tmp_path / "teacher_copy"
    shutil.copytree(demo_teacher_dir(), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = ["upcycle", "--base", str(tiny_base_dir), "--out", str(out), "--stages", "64:ild@300", "--batch-size", "2",
            "--eval-windows", "0", "--device", "cpu", "--no-tensorboard", "--allow-demo-data"]
    res = CliRunner().invoke(app, args)  # once exited 0 and replaced the teacher's config.json and weights
    assert res.exit_code == 2 and "holds files this run did not write" in " ".join(res.output.split())
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    res = CliRunner().invoke(app, [*args, "--overwrite"])
    assert res.exit_code == 0, res.output
    assert (out / "hybrid_config.json").is_file() and (out / "model.safetensors").read_bytes() != \
        before["model.safetensors"]


def test_nan_and_integer_weights_warn_on_load(tiny_base_dir, tmp_path, caplog):
    from hylo_bench.models.loading import load_model

    for kind in ("nan", "int32"):
        d = tmp_path / kind
        shutil.copytree(tiny_base_dir, d)
        sd = load_file(str(d / "model.safetensors"))
        if kind == "nan":
            sd["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
        else:
            sd["model.norm.weight"] = torch.ones_like(sd["model.norm.weight"], dtype=torch.int32)
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    caplog.set_level(logging.WARNING)
    load_model(str(tmp_path / "nan"), device="cpu")
    assert (f"{tmp_path / 'nan'}: 1 tensor(s) hold NaN or inf values (model.layers.0.mlp.up_proj.weight); the "
            f"model's outputs will be NaN / inf") in caplog.text
    load_model(str(tmp_path / "int32"), device="cpu")
    assert (f"{tmp_path / 'int32'}: 1 weight tensor(s) are stored as integers or booleans, not floating point "
            f"(model.norm.weight (I32))") in caplog.text
    caplog.clear()
    load_model(str(tiny_base_dir), device="cpu")
    assert "NaN" not in caplog.text and "integers" not in caplog.text
