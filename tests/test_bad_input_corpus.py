"""The bad-input corpus (tests/bad_inputs/cases.yaml, files in tests/bad_inputs/files/): each case is a command
line that must fail with exit code 2 and the message it names, without a traceback, and must leave its working
folder (fixture files, results store, anything a command could create there) exactly as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from hylo_bench.cli import app
from hylo_bench.reports import store
from tests.reports.test_compare import ruler_record
from tests.snapshot import changes, tree_snapshot

CORPUS = Path(__file__).resolve().parent / "bad_inputs"
CASES = yaml.safe_load((CORPUS / "cases.yaml").read_text(encoding="utf-8"))


def test_the_corpus_is_large_and_well_formed():
    ids = [c["id"] for c in CASES]
    assert len(ids) >= 40 and len(set(ids)) == len(ids)
    assert all(set(c) == {"id", "argv", "message"} and c["message"] for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_bad_input(case, tiny_base_dir, tmp_path, monkeypatch):
    work = tmp_path / "w"
    shutil.copytree(CORPUS / "files", work / "f")
    db = work / "store.sqlite"  # a store that holds one run: it must stay exactly as it is
    engine = store.open_store(db)
    store.save_runs(engine, [ruler_record("kept", {("vt", 4096): 80.0}, 100, "kept")])
    engine.dispose()
    monkeypatch.setenv("HYLO_BENCH_DB", str(db))
    monkeypatch.chdir(work)  # a default output folder (hylo-results) would appear here

    def fill(text: str) -> str:
        return text.replace("{f}", str(work / "f")).replace("{w}", str(work)).replace("{tiny}", str(tiny_base_dir))

    before = tree_snapshot(work)
    result = CliRunner().invoke(app, [fill(a) for a in case["argv"]])
    out = " ".join(result.output.split())
    assert result.exit_code == 2, out
    assert isinstance(result.exception, SystemExit), f"traceback: {result.exception!r}"
    assert fill(case["message"]) in out, out
    assert changes(before, tree_snapshot(work)) == []
