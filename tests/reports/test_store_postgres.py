"""The results store on PostgreSQL (what a team points ``HYLO_BENCH_DB`` at), against a real server: ``pgserver``
runs PostgreSQL 16 from its wheel in a temp dir, so CI needs no system service. Same checks as the SQLite tests:
import round trip, idempotent re-import, all-or-nothing rejection, a migration from schema 1, the report and
``compare`` through the URL.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from hylo_bench.reports import store
from tests.reports.test_compare import ruler_record
from tests.reports.test_report import SCORES, read_figures, ruler_run, write_json
from tests.reports.test_store import BENCH_PATH, LM_EVAL, MANIFEST, invoke, plain

pgserver = pytest.importorskip("pgserver", reason="pgserver (PostgreSQL in a wheel) is in the dev extra")
sa = pytest.importorskip("sqlalchemy")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = pgserver.get_server(tmp_path_factory.mktemp("pgdata"), cleanup_mode="stop")
    yield srv
    srv.cleanup()


@pytest.fixture
def url(server) -> str:
    """A fresh database per test, as a plain ``postgresql://`` URL (the store picks the installed driver)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    server.psql(f"CREATE DATABASE {name};")
    return server.get_uri(name)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    src = tmp_path / "src"
    return {
        "ruler": write_json(src / "ruler_hylo-a.json", ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00Z")),
        "lm-eval": write_json(src / "results_2026-05-01.json", LM_EVAL),
        "upcycle": write_json(src / "hylo-a" / "manifest.json", MANIFEST),
        "benchmark": BENCH_PATH,
    }  # fmt: skip


def test_url_is_postgres(url: str):
    engine = store.open_store(url)
    assert engine.dialect.name == "postgresql"
    with engine.connect() as conn:
        assert conn.execute(sa.text("SHOW server_version")).scalar().startswith("16")
        assert store.current_version(conn) == store.SCHEMA_VERSION


def test_import_round_trip_and_idempotent_reimport(url: str, files: dict[str, Path], tmp_path: Path):
    result = invoke("import", *map(str, files.values()), "--db", url)
    assert result.exit_code == 0, result.output
    engine = store.open_store(url)
    counts = store.table_counts(engine)
    lite = store.open_store(tmp_path / "same.sqlite")  # the same files in SQLite: the reference
    store.import_files(lite, files.values())
    assert counts == store.table_counts(lite) and counts["runs"] == 4 and counts["train_log"] == 2
    cols = ["kind", "model", "task", "seq_len", "metric", "value", "n", "stderr", "flavor"]
    key = ["kind", "task", "metric", "seq_len"]
    assert store.metrics_frame(engine)[cols].sort_values(key).reset_index(drop=True).equals(
        store.metrics_frame(lite)[cols].sort_values(key).reset_index(drop=True))
    df = store.metrics_frame(engine)
    ruler = df[df["kind"] == "ruler"]
    assert {(r.task, int(r.seq_len)): r.value for r in ruler.itertuples()} == SCORES["hylo-a"]
    pts = store.points_frame(engine)
    assert pts.drop(columns=["run_id", "benchmark"]).to_dict("records") == json.loads(BENCH_PATH.read_text())["records"]
    again = invoke("import", *map(str, files.values()), "--db", url)
    assert again.exit_code == 0 and plain(again.output).count("unchanged") == len(files)
    assert store.table_counts(store.open_store(url)) == counts


def test_rejected_import_leaves_the_store_untouched(url: str, files: dict[str, Path], tmp_path: Path):
    engine = store.open_store(url)
    store.import_files(engine, [files["lm-eval"]])
    before = store.table_counts(engine)
    doc = ruler_run("hylo-a", SCORES["hylo-a"], "2026-05-01T10:00:00Z")
    doc["records"][0]["score"] = 12.5  # same run as files["ruler"], another value: conflicts at write time
    other = write_json(tmp_path / "conflict.json", doc)
    with pytest.raises(ValueError, match="conflict.json: run .* already stores"):
        store.import_files(engine, [files["ruler"], other])
    assert store.table_counts(engine) == before


def test_migrates_a_version_1_database(url: str, files: dict[str, Path]):
    engine = sa.create_engine(store.resolve_url(url).replace("postgresql://", "postgresql+psycopg://", 1))
    assert store.migrate(engine, target=1) == 1
    with engine.begin() as conn:
        assert not sa.inspect(conn).has_table("points")
    engine = store.open_store(url)
    with engine.connect() as conn:
        assert store.current_version(conn) == store.SCHEMA_VERSION and sa.inspect(conn).has_table("points")
    store.import_files(engine, [files["benchmark"]])
    assert store.table_counts(engine)["points"] == len(json.loads(BENCH_PATH.read_text())["records"])


def test_report_and_compare_through_the_url(url: str, files: dict[str, Path], tmp_path: Path):
    engine = store.open_store(url)
    store.import_files(engine, [files["ruler"], files["upcycle"]])
    store.save_runs(engine, [ruler_record("regressed", {k: v - 20.0 for k, v in SCORES["hylo-a"].items()}, 100, "r")])
    result = invoke("report", "--db", url, "-o", str(tmp_path / "r.html"))
    assert result.exit_code == 0, result.output
    mean = {t["name"]: t for t in read_figures((tmp_path / "r.html").read_text())["fig-ruler-mean"]["data"]}
    assert sorted(mean) == ["hylo-a", "regressed"]
    want = {L: sum(v for (_, n), v in SCORES["hylo-a"].items() if n == L) / 3 for L in (1024, 4096)}
    assert mean["hylo-a"]["y"] == pytest.approx([want[1024], want[4096]])
    assert mean["regressed"]["y"] == pytest.approx([want[1024] - 20, want[4096] - 20])
    result = invoke("compare", "hylo-a", "regressed", "--db", url)
    assert result.exit_code == 1, result.output
    assert "regress" in plain(result.output).lower()
