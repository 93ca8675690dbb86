"""The per-device tuned decode-GEMV tables (hylo_bench.kernels.gemv.tuned): the shipped H200 table, file names,
and the errors a malformed table raises."""

from __future__ import annotations

import json

import pytest

from hylo_bench.kernels.gemv import tuned

ENTRY = {"N": 2048, "K": 6144, "M_PAD": 1, "PROLOGUE": 2, "GROUP": 1, "HAS_RES": True, "BLOCK_N": 4,
         "BLOCK_K": 1024, "PREFETCH": 0, "num_warps": 8}


def test_shipped_h200_table_holds_the_recipe_shapes():
    """The seven batch-1 GEMV shapes of HyLo-Qwen-7MLA21GDN-8K-SFT (gate_up, GDN in / o, down, MLA in / out, MLA
    q_b), with the configs benchmarks/results/gemv_step_tune.json chose."""
    table = tuned.load_table(tuned.table_path("NVIDIA H200"))
    assert sorted(k[:2] for k in table) == [(1664, 2048), (2048, 1344), (2048, 2048), (2048, 3072), (2048, 6144),
                                            (9228, 2048), (12288, 2048)]
    assert tuned.tuned_config("NVIDIA H200", (2048, 6144, 1, 2, 1, True)) == {
        "BLOCK_N": 4, "BLOCK_K": 1024, "PREFETCH": 0, "num_warps": 8}
    assert tuned.tuned_config("NVIDIA H200", (2048, 6144, 1, 2, 1, False)) is None  # no residual: not listed
    assert tuned.tuned_config("NVIDIA H100 80GB HBM3", (2048, 6144, 1, 2, 1, True)) is None  # no table


def test_results_file_agrees_with_the_shipped_table():
    """The shipped table is the step-tuned column of the results file it cites."""
    from pathlib import Path

    res = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/gemv_step_tune.json").read_text())
    table = tuned.load_table(tuned.table_path("NVIDIA H200"))
    shapes = {tuple(r[f] for f in tuned.KEY_FIELDS): {f: r[f"step_tuned_{f}"] for f in tuned.CONFIG_FIELDS}
              for r in res["records"] if r["kind"] == "gemv_shape"}
    assert shapes == table


def test_table_path_names():
    assert tuned.table_path("NVIDIA H200").name == "NVIDIA_H200.json"
    assert tuned.table_path("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"
    assert tuned.table_path("AMD Instinct MI300X").name == "AMD_Instinct_MI300X.json"


@pytest.mark.parametrize("change,match", [
    ({"BLOCK_K": None}, r"rowblock\[0\] lacks \['BLOCK_K'\]"),
    ({"BLOCK_N": 3}, r"rowblock\[0\]: BLOCK_N=3; expected powers of two"),
    ({"PREFETCH": 3}, r"PREFETCH=3; expected 0, 1 or 2"),
    ({"N": "2048"}, r"N='2048'; expected a non-negative integer"),
    ({"HAS_RES": 1}, r"HAS_RES=1; expected true or false"),
])
def test_malformed_entry_names_the_file_entry_and_field(tmp_path, change, match):
    e = {k: v for k, v in (ENTRY | change).items() if v is not None}
    path = tmp_path / "X.json"
    path.write_text(json.dumps({"rowblock": [e]}))
    with pytest.raises(ValueError, match=match) as info:
        tuned.load_table(path)
    assert str(path) in str(info.value)


def test_repeated_key_and_bad_files_are_refused(tmp_path):
    path = tmp_path / "X.json"
    path.write_text(json.dumps({"rowblock": [ENTRY, ENTRY | {"BLOCK_N": 8}]}))
    with pytest.raises(ValueError, match=r"rowblock\[1\]: key .* listed twice"):
        tuned.load_table(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        tuned.load_table(path)
    path.write_text(json.dumps([ENTRY]))
    with pytest.raises(ValueError, match="expected an object with a 'rowblock' list"):
        tuned.load_table(path)
