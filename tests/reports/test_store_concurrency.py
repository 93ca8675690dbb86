"""Several processes writing one SQLite results store at the same time (``ruler`` runs record after every (task,
length), ``import`` adds files): every result arrives, none fails on "database is locked" (WAL, busy timeout,
``BEGIN IMMEDIATE`` writes, retries; ``store.write_transaction``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hylo_bench.reports import store
from tests.reports.test_report import ruler_run, write_json

_WRITER = r"""
import json, sys, time
from pathlib import Path
from hylo_bench.reports import store
db, go, writer, count = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
objs = [json.loads(line) for line in Path(sys.argv[5]).read_text().splitlines()]
while not go.exists():
    time.sleep(0.01)
failed = sum(store.record(obj, f"writer{writer}-{k}.json", db=db) is None for k, obj in enumerate(objs))
print(json.dumps({"failed": failed}))
"""


def _ruler_obj(model: str, k: int) -> dict:
    return ruler_run(model, {("niah_single_1", 4096): float(k % 101), ("vt", 4096): 50.0},
                     f"2026-05-01T10:{k // 60:02d}:{k % 60:02d}Z")


def _env(db: Path) -> dict[str, str]:
    return {**os.environ, "HYLO_BENCH_DB": str(db), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def test_writers_racing_on_a_new_store_lose_nothing(tmp_path: Path):
    """Four processes open a store that does not exist yet (all migrate it) and each records 15 runs, all at once."""
    db, go = tmp_path / "store.sqlite", tmp_path / "go"
    writers, per = 4, 15
    procs = []
    for w in range(writers):
        objs = tmp_path / f"objs{w}.jsonl"
        objs.write_text("".join(json.dumps(_ruler_obj(f"model-{w}", k)) + "\n" for k in range(per)))
        procs.append(subprocess.Popen([sys.executable, "-c", _WRITER, str(db), str(go), str(w), str(per), str(objs)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(db)))
    time.sleep(3.0)  # every writer has imported sqlalchemy and waits for the start signal
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert json.loads(out.splitlines()[-1]) == {"failed": 0}, err
        assert "locked" not in err and "not added to the results store" not in err, err
    engine = store.open_store(db, create=False)
    runs = store.runs_frame(engine)
    assert len(runs) == writers * per and runs["natural_key"].is_unique
    assert sorted(runs["model"].value_counts().to_dict().items()) == [(f"model-{w}", per) for w in range(writers)]
    assert store.table_counts(engine)["metrics"] == writers * per * 2
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT version FROM schema_version ORDER BY version").scalars().all() == \
            sorted(store.MIGRATIONS)
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_two_ruler_runs_and_an_import_share_one_store(mini_base_dir, tmp_path: Path):
    db = tmp_path / "store.sqlite"
    files = [write_json(tmp_path / "imp" / f"r{k}.json", _ruler_obj("imported", k)) for k in range(40)]
    cmd = [sys.executable, "-m", "hylo_bench"]
    ruler = [*cmd, "ruler", "--model", str(mini_base_dir), "--lengths", "1k,2k", "--tasks",
             "niah_single_1,niah_single_2,niah_multikey_1", "--samples", "1", "--device", "cpu"]
    procs = [subprocess.Popen([*ruler, "--results-dir", str(tmp_path / f"run{i}"), "--seed", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(db))
             for i in (1, 2)]
    procs.append(subprocess.Popen([*cmd, "import", *map(str, files), "--db", str(db)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=_env(db)))
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "locked" not in out + err and "not added to the results store" not in out + err, out + err
    engine = store.open_store(db, create=False)
    runs = store.runs_frame(engine)
    assert (runs["model"] == "imported").sum() == 40
    stored = store.metrics_frame(engine)
    for i in (1, 2):
        (result,) = (tmp_path / f"run{i}").glob("ruler-*.json")
        doc = json.loads(result.read_text())
        want = sorted((r["task"], r["seq_len"], r["score"]) for r in doc["records"])
        got = stored[stored["source"] == str(result)]
        assert len(want) == 6 and sorted(zip(got["task"], got["seq_len"], got["value"])) == want
