"""The results store: one SQL database (SQLite by default, any SQLAlchemy URL) of runs, metrics, training logs and
benchmark points, with versioned schema migrations and transactional, idempotent writes.

Scores are 0-100, context lengths in tokens. Never imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from hylo_bench.io_utils import utc_now
from hylo_bench.reports.ingest import Metric, RunRecord, detect_kind, parse_file, parse_object

logger = logging.getLogger(__name__)

DB_ENV = "HYLO_BENCH_DB"
DB_FILENAME = "hylo_bench.sqlite"
SQLITE_BUSY_TIMEOUT_S = 30.0
"""How long one SQLite statement waits for another process's write lock (``ruler`` runs and ``import`` writing one
store at the same time) before :func:`write_transaction` retries the whole transaction."""
WRITE_RETRY_S = 300.0
"""Total time :func:`write_transaction` keeps retrying a write that found the database locked or busy."""
_T = TypeVar("_T")


def _define_tables(md: sa.MetaData, version: int) -> dict[str, sa.Table]:
    """The tables as they are at schema ``version`` (1, 2 or 3), defined on ``md``."""
    tables = {"schema_version": sa.Table(
        "schema_version", md, sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("applied_utc", sa.String(40), nullable=False))}
    tables["runs"] = sa.Table(
        "runs", md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("natural_key", sa.String(64), nullable=False, unique=True),  # content hash of the source object
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("model", sa.Text, nullable=False),  # as typed / as named in the source
        sa.Column("checkpoint", sa.Text),  # path or hub id
        sa.Column("model_hash", sa.String(128)),  # content hash of the checkpoint
        sa.Column("layout", sa.String(128)),
        sa.Column("git_sha", sa.String(64)),
        sa.Column("hylo_bench_version", sa.String(32)),
        sa.Column("device", sa.Text),
        sa.Column("config_json", sa.Text, nullable=False),
        sa.Column("created_utc", sa.String(40), nullable=False),
        sa.Column("imported_utc", sa.String(40), nullable=False),
        # "running" while the command was still writing (or was killed), "complete" after; NULL: stored before v3
        *([sa.Column("status", sa.String(16))] if version >= 3 else []),
    )
    extra = [sa.Column("extra_json", sa.Text)] if version >= 2 else []
    tables["metrics"] = sa.Table(
        "metrics", md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False, index=True),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("seq_len", sa.Integer),  # tokens; NULL when the metric has no context length
        sa.Column("metric", sa.Text, nullable=False),
        sa.Column("value", sa.Float, nullable=False),
        sa.Column("n", sa.Integer),
        sa.Column("stderr", sa.Float),
        sa.Column("flavor", sa.Text),
        *extra,
    )
    if version < 2:
        return tables
    tables["train_log"] = sa.Table(
        "train_log", md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False, index=True),
        sa.Column("stage_index", sa.Integer, nullable=False),
        sa.Column("stage", sa.Text, nullable=False),
        sa.Column("stage_kind", sa.Text, nullable=False),
        sa.Column("stage_seq_len", sa.Integer, nullable=False),
        sa.Column("tokens_seen", sa.BigInteger, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("loss", sa.Float, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
    )
    tables["points"] = sa.Table(
        "points", md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False, index=True),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("benchmark", sa.Text, nullable=False),
        sa.Column("record_json", sa.Text, nullable=False),  # one flat benchmark / sweep record
    )
    return tables


def _migrate_1(conn: Connection) -> None:
    """Version 1: ``schema_version``, ``runs`` and ``metrics``."""
    md = sa.MetaData()
    _define_tables(md, 1)
    md.create_all(conn)


def _migrate_2(conn: Connection) -> None:
    """Version 2: per-record extras on metrics (RULER nulls, prompt lengths), training logs, benchmark points."""
    conn.execute(sa.text("ALTER TABLE metrics ADD COLUMN extra_json TEXT"))
    md = sa.MetaData()
    tables = _define_tables(md, 2)
    md.create_all(conn, tables=[tables["train_log"], tables["points"]])


def _migrate_3(conn: Connection) -> None:
    """Version 3: ``runs.status`` (a killed ``ruler`` run stays ``running``; report and compare leave it out)."""
    conn.execute(sa.text("ALTER TABLE runs ADD COLUMN status VARCHAR(16)"))


MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _migrate_1, 2: _migrate_2, 3: _migrate_3}
SCHEMA_VERSION = max(MIGRATIONS)
# The current schema, for queries; tables are only ever created by the migrations.
metadata = sa.MetaData()
_CURRENT = _define_tables(metadata, SCHEMA_VERSION)
schema_version, runs, metrics = _CURRENT["schema_version"], _CURRENT["runs"], _CURRENT["metrics"]
train_log, points = _CURRENT["train_log"], _CURRENT["points"]
TABLES = ("runs", "metrics", "train_log", "points")


def resolve_url(db: str | Path | None = None, results_dir: str | Path = "hylo-results") -> str:
    """The SQLAlchemy URL of the store.

    Precedence: ``db`` (a URL such as ``postgresql://...`` or a file path), then the ``HYLO_BENCH_DB`` environment
    variable (URL or path), then ``<results_dir>/hylo_bench.sqlite``.
    """
    chosen = db if db is not None else os.environ.get(DB_ENV) or Path(results_dir) / DB_FILENAME
    text = str(chosen)
    if "://" in text:
        return text
    return f"sqlite:///{Path(text).expanduser().resolve()}"


def current_version(conn: Connection) -> int:
    """Schema version of the database (0 when empty)."""
    if not sa.inspect(conn).has_table("schema_version"):
        if sa.inspect(conn).has_table("runs"):
            raise ValueError("the database has a 'runs' table but no 'schema_version'; it was not made by hylo-bench")
        return 0
    return conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar() or 0


def _is_lock_error(exc: BaseException) -> bool:
    text = str(getattr(exc, "orig", None) or exc).lower()
    return isinstance(exc, sa.exc.OperationalError) and ("locked" in text or "busy" in text)


def write_transaction(engine: Engine, work: Callable[[Connection], _T]) -> _T:
    """Run ``work(conn)`` in one write transaction and commit; on SQLite retried (from the start, after a rollback)
    while the database is locked or busy, for up to :data:`WRITE_RETRY_S` seconds.

    On SQLite the transaction starts with ``BEGIN IMMEDIATE``: it takes the write lock before reading, so two
    writers queue on the busy timeout instead of one failing when it upgrades its read snapshot to a write.

    Raises:
        sqlalchemy.exc.OperationalError: still locked after :data:`WRITE_RETRY_S` seconds; what ``work`` raises.
    """
    return _retry_locked(engine, work, write=True)


def read_retrying(engine: Engine, work: Callable[[Connection], _T]) -> _T:
    """``work(conn)`` on a plain (read) connection, retried as :func:`write_transaction` retries while SQLite is
    locked: a process opening a new store can meet another one switching it to WAL or migrating it."""
    return _retry_locked(engine, work, write=False)


def _retry_locked(engine: Engine, work: Callable[[Connection], _T], *, write: bool) -> _T:
    deadline = time.monotonic() + WRITE_RETRY_S
    delay = 0.05
    while True:
        try:
            if write:
                with _write_connection(engine) as conn:
                    return work(conn)
            with engine.connect() as conn:
                return work(conn)
        except sa.exc.OperationalError as exc:
            if engine.dialect.name != "sqlite" or not _is_lock_error(exc) or time.monotonic() > deadline:
                raise
            logger.debug("results store busy (%s); retrying in %.2f s", exc, delay)
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 2.0)


@contextlib.contextmanager
def _write_connection(engine: Engine) -> Iterator[Connection]:
    if engine.dialect.name != "sqlite":
        with engine.begin() as conn:
            yield conn
        return
    with engine.connect().execution_options(sqlite_write=True) as conn, conn.begin():
        yield conn


def _sqlite_setup(engine: Engine) -> None:
    """SQLite for several writing processes: WAL (readers never block the writer), a busy timeout, and
    transactions that SQLAlchemy opens itself (``BEGIN IMMEDIATE`` for writes, see :func:`write_transaction`)
    instead of pysqlite's implicit ones (the pattern of SQLAlchemy's SQLite dialect docs, "Serializable isolation /
    Savepoints / Transactional DDL")."""

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # no implicit BEGIN / COMMIT by pysqlite
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
            cur.execute("PRAGMA journal_mode = WAL")
        finally:
            cur.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("sqlite_write") else "BEGIN")


def migrate(engine: Engine, target: int = SCHEMA_VERSION) -> int:
    """Apply the migrations after the database's version up to ``target``, each in its own write transaction that
    first re-reads the version (two processes opening a new store at once apply each migration once).

    Returns:
        The version after migrating.

    Raises:
        ValueError: the database is newer than this hylo-bench (upgrade hylo-bench), or not a hylo-bench store.
    """
    version = read_retrying(engine, current_version)
    if version > SCHEMA_VERSION:
        raise ValueError(f"the results store has schema version {version}, this hylo-bench knows up to "
                         f"{SCHEMA_VERSION}; upgrade hylo-bench")

    def step(conn: Connection, number: int) -> None:
        if current_version(conn) >= number:
            return
        MIGRATIONS[number](conn)
        conn.execute(schema_version.insert().values(version=number, applied_utc=utc_now()))

    for number in range(version + 1, target + 1):
        write_transaction(engine, lambda conn, number=number: step(conn, number))
    return max(version, target)


def open_store(db: str | Path | None = None, results_dir: str | Path = "hylo-results", *,
               create: bool = True) -> Engine:
    """Connect to the store (see :func:`resolve_url`) and migrate it to the current schema.

    Args:
        create: Create a missing SQLite file (and its folder); when False a missing file is an error.

    Raises:
        ValueError: the SQLite file is missing (``create=False``), the URL cannot be used (bad scheme or missing
            driver), or the schema is newer than this code.
    """
    url = resolve_url(db, results_dir)
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        path = Path(url[len("sqlite:///"):])
        if not create and not path.is_file():
            raise ValueError(f"no results store at {path}; pass --db, set {DB_ENV}, or `hylo-bench import` results")
        path.parent.mkdir(parents=True, exist_ok=True)
    try:
        engine = sa.create_engine(url)
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ImportError) as exc:
        raise ValueError(f"results store URL {url!r}: {exc}; use a file path or e.g. sqlite:///results.sqlite, "
                         f"postgresql://user@host/db") from None
    if engine.dialect.name == "sqlite":
        _sqlite_setup(engine)
    try:
        migrate(engine)
    except sa.exc.SQLAlchemyError as exc:
        shown = engine.url.render_as_string(hide_password=True)
        raise ValueError(f"results store {shown}: cannot open it ({type(exc.orig or exc).__name__}: "
                         f"{str(exc.orig or exc).strip().splitlines()[0]}); check --db / ${DB_ENV}") from None
    return engine


@dataclasses.dataclass(kw_only=True, slots=True)
class SaveOutcome:
    """What one :class:`RunRecord` did to the store. ``status`` is ``new``, ``extended`` or ``unchanged``."""

    source: str
    run_id: int
    status: str
    num_metrics: int
    num_train_rows: int
    num_points: int


def save_runs(engine: Engine, records: Iterable[RunRecord]) -> list[SaveOutcome]:
    """Write runs in ONE transaction: either every record is stored or (on any error) nothing is.

    A run whose ``natural_key`` is already stored is not duplicated; metrics, training-log rows and benchmark points
    it lacks are added (a RULER file, manifest or sweep that grew since the last import), rows already stored are
    skipped.

    Raises:
        ValueError: a record holds a different value for a metric or logged step already stored for the same run
            (the store is append-only); names the source, the row and both values.
    """
    records = list(records)
    return write_transaction(engine, lambda conn: [_save_one_checked(conn, rec) for rec in records])


def _save_one_checked(conn: Connection, rec: RunRecord) -> SaveOutcome:
    try:
        return _save_one(conn, rec)
    except sa.exc.IntegrityError as exc:  # a value the parsers let through and the schema refuses
        raise ValueError(f"{rec.source}: the results store refused a row ({str(exc.orig or exc).splitlines()[0]});"
                         f" nothing was stored") from None


def _save_one(conn: Connection, rec: RunRecord) -> SaveOutcome:
    row = conn.execute(sa.select(runs.c.id, runs.c.status, runs.c.model_hash).where(
        runs.c.natural_key == rec.natural_key)).first()
    is_new = row is None
    if is_new:
        run_id = conn.execute(runs.insert().values(
            natural_key=rec.natural_key, kind=rec.kind, source=rec.source, model=rec.model, checkpoint=rec.checkpoint,
            model_hash=rec.model_hash, layout=rec.layout, git_sha=rec.git_sha,
            hylo_bench_version=rec.hylo_bench_version, device=rec.device,
            config_json=json.dumps(rec.config, sort_keys=True), created_utc=rec.created_utc, imported_utc=utc_now(),
            status=rec.status,
        )).inserted_primary_key[0]  # fmt: skip
    else:
        run_id = row.id
        # a grown file: a run that finished since, or an upcycle manifest that now names its final weights
        update = {k: v for k, v in (("status", rec.status), ("model_hash", rec.model_hash))
                  if v is not None and v != getattr(row, k)}
        if update:
            conn.execute(runs.update().where(runs.c.id == run_id).values(**update))
    stored = {(r.task, r.seq_len, r.metric): r.value for r in conn.execute(
        sa.select(metrics.c.task, metrics.c.seq_len, metrics.c.metric, metrics.c.value).where(
            metrics.c.run_id == run_id))}
    new_metrics = []
    for m in rec.metrics:
        key = (m.task, m.seq_len, m.metric)
        if key in stored:
            if stored[key] != m.value:
                raise ValueError(f"{rec.source}: run {run_id} already stores {key} = {stored[key]!r}, the file says "
                                 f"{m.value!r}; results are append-only, so write the new result as a new run")
            continue
        stored[key] = m.value
        new_metrics.append(_metric_row(run_id, m))
    if new_metrics:
        conn.execute(metrics.insert(), new_metrics)
    logged = {(r.stage_index, r.step): r.loss for r in conn.execute(
        sa.select(train_log.c.stage_index, train_log.c.step, train_log.c.loss).where(train_log.c.run_id == run_id))}
    new_train = [row | {"run_id": run_id} for row in rec.train_log if (row["stage_index"], row["step"]) not in logged]
    if new_train:
        conn.execute(train_log.insert(), new_train)
    have = {r.idx: r.record_json for r in conn.execute(
        sa.select(points.c.idx, points.c.record_json).where(points.c.run_id == run_id))}
    new_points = []
    for p in rec.points:  # a sweep file grows point by point: add the points not stored yet
        text = json.dumps(p["record"])
        if p["idx"] in have:
            if have[p["idx"]] != text:
                raise ValueError(f"{rec.source}: run {run_id} already stores point {p['idx']} = {have[p['idx']]}, "
                                 f"the file says {text}; results are append-only, so write a new run")
            continue
        new_points.append({"run_id": run_id, "idx": p["idx"], "benchmark": p["benchmark"], "record_json": text})
    if new_points:
        conn.execute(points.insert(), new_points)
    changed = new_metrics or new_train or new_points
    status = "new" if is_new else ("extended" if changed else "unchanged")
    return SaveOutcome(source=rec.source, run_id=run_id, status=status, num_metrics=len(new_metrics),
                       num_train_rows=len(new_train), num_points=len(new_points))


def import_files(engine: Engine, paths: Iterable[str | Path]) -> list[SaveOutcome]:
    """Parse every file first, then store them all in one transaction (all-or-nothing for the whole call).

    Raises:
        ValueError: ``"<file>: <reason>"`` for the first file that cannot be read, is not valid JSON, has an
            unknown format or invalid content, or conflicts with the store; nothing is written then.
    """
    records = [parse_file(p) for p in paths]
    if not records:
        raise ValueError("no files given; pass one or more results JSON files")
    return save_runs(engine, records)


def import_paths(db: str | Path | None, results_dir: str | Path, paths: Iterable[str | Path]) -> list[SaveOutcome]:
    """``hylo-bench import``: parse every file, then open the store and save them all in one transaction; a bad
    file leaves the store (even a store not created yet) as it was.

    Raises:
        ValueError: as :func:`import_files`, or the store cannot be opened.
    """
    records = [parse_file(p) for p in paths]
    if not records:
        raise ValueError("no files given; pass one or more results JSON files")
    engine = open_store(db, results_dir)
    try:
        return save_runs(engine, records)
    finally:
        engine.dispose()


def recorder(db: str | Path | None = None,
             results_dir: str | Path = "hylo-results") -> Callable[..., SaveOutcome | None]:
    """The ``on_result`` callback the CLI hands to a command's ``run``: ``on_result(obj, path)`` stores the result
    object just written to ``path`` (:func:`record` into ``db``, else ``$HYLO_BENCH_DB``, else
    ``results_dir/hylo_bench.sqlite``). A ``functools.partial``, so it pickles into spawned worker processes."""
    return functools.partial(record, db=db, results_dir=results_dir)


def record(obj_or_path: dict[str, Any] | str | Path, source: str | Path | None = None, *,
           db: str | Path | None = None, results_dir: str | Path = "hylo-results") -> SaveOutcome | None:
    """Add one result (a parsed object with its ``source`` file name, or a file path) to the store as a command
    produces it (``ruler``, ``eval``, ``upcycle`` after every stage). Growing runs extend their stored run.

    A store failure is logged, not raised: the JSON file on disk already holds the results, and
    ``hylo-bench import FILE`` adds it later. Returns the outcome, or None when it was not stored.
    """
    path = obj_or_path if isinstance(obj_or_path, (str, Path)) else source
    try:
        rec = (parse_file(obj_or_path) if isinstance(obj_or_path, (str, Path))
               else parse_object(obj_or_path, str(source)))
        engine = open_store(db, results_dir)
        try:
            return save_runs(engine, [rec])[0]
        finally:
            engine.dispose()
    except (ValueError, sa.exc.SQLAlchemyError) as exc:
        logger.warning("results not added to the results store (%s); `hylo-bench import %s` adds them later", exc,
                       path)
        return None


def sync_dir(engine: Engine, root: str | Path) -> tuple[list[SaveOutcome], list[tuple[str, str]]]:
    """Import every results file under ``root`` (recursively: RULER files, upcycle manifests, benchmark / sweep
    JSON, lm-eval ``results_*.json``) that the store does not hold yet; what ``report`` does before reading.

    Each file is its own transaction and re-imports are no-ops. JSON files of no known kind (configs, tokenizer
    files) are ignored; a results file that cannot be imported is returned in ``skipped`` with the reason.

    Returns:
        ``(outcomes, skipped)``; ``skipped`` holds ``(path, reason)`` pairs.

    Raises:
        ValueError: ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"--results-dir {str(root)!r}: not a directory")
    outcomes, skipped = [], []
    for path in sorted(root.rglob("*.json")):
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            # An unreadable .json does not say its kind (a results file cut off mid-write, say): list it, do not
            # hide it.
            logger.warning("report: %s is not readable JSON (%s); skipped", path, exc)
            skipped.append((str(path), f"not readable JSON: {exc}"))
            continue
        try:
            kind = detect_kind(obj)
        except ValueError:
            continue  # valid JSON of no results kind (configs, tokenizer files): not ours to judge
        if kind == "eval-summary" and Path(str(obj.get("lm_eval_results", ""))).is_file():
            continue  # the same scores, with stderr, are in lm-eval's own results file (imported on its own)
        try:
            outcomes.extend(save_runs(engine, [parse_object(obj, str(path))]))
        except (ValueError, sa.exc.SQLAlchemyError) as exc:
            logger.warning("report: %s not imported: %s", path, exc)
            skipped.append((str(path), str(exc)))
    return outcomes, skipped


def _metric_row(run_id: int, m: Metric) -> dict[str, Any]:
    return {"run_id": run_id, "task": m.task, "seq_len": m.seq_len, "metric": m.metric, "value": m.value, "n": m.n,
            "stderr": m.stderr, "flavor": m.flavor, "extra_json": None if m.extra is None else json.dumps(m.extra)}


def table_counts(engine: Engine) -> dict[str, int]:
    """Row count of each data table (``runs``, ``metrics``, ``train_log``, ``points``)."""
    with engine.connect() as conn:
        return {t.name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar()
                for t in (runs, metrics, train_log, points)}


def runs_frame(engine: Engine) -> pd.DataFrame:
    """All runs, one row each (columns of the ``runs`` table, ``config_json`` as text), ordered by id."""
    with engine.connect() as conn:
        return pd.read_sql(sa.select(runs).order_by(runs.c.id), conn)


def metrics_frame(engine: Engine, run_ids: list[int] | None = None) -> pd.DataFrame:
    """Metrics joined with their run's ``model``, ``kind``, ``created_utc`` and ``source``.

    Args:
        run_ids: Only these runs (all runs when ``None``).
    """
    query = sa.select(metrics, runs.c.model, runs.c.kind, runs.c.created_utc, runs.c.source,
                      runs.c.status.label("run_status"), runs.c.model_hash).join(runs)
    if run_ids is not None:
        query = query.where(metrics.c.run_id.in_(run_ids))
    with engine.connect() as conn:
        df = pd.read_sql(query.order_by(metrics.c.id), conn)
    df["seq_len"] = df["seq_len"].astype("Int64")
    df["n"] = df["n"].astype("Int64")
    return df


def train_log_frame(engine: Engine) -> pd.DataFrame:
    """Training-loss rows with the columns of ``results.LOSS_COLUMNS`` (``run`` = the run's model label)."""
    query = sa.select(train_log, runs.c.model.label("run"), runs.c.source.label("manifest_file")).join(runs)
    with engine.connect() as conn:
        df = pd.read_sql(query.order_by(train_log.c.run_id, train_log.c.stage_index, train_log.c.step), conn)
    return df.drop(columns=["id", "run_id"])


def points_frame(engine: Engine) -> pd.DataFrame:
    """Benchmark / sweep points: one row per record, its fields as columns plus ``run_id`` and ``benchmark``."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(points).order_by(points.c.run_id, points.c.idx)).all()
    return pd.DataFrame([{"run_id": r.run_id, "benchmark": r.benchmark} | json.loads(r.record_json) for r in rows])


def unfinished_runs(engine: Engine, *, with_ids: bool = True) -> list[tuple[int, str, str]]:
    """``(run id, source, reason)`` of every results run (not an upcycle manifest: its training log is shown as it
    grows) stored as ``running`` (a command still writing it, or killed): the reason says how many of its planned
    (task, length) pairs it holds, and (``with_ids``) the run's id in the store."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(runs.c.id, runs.c.source, runs.c.config_json).where(
            runs.c.status == "running", runs.c.kind != "upcycle").order_by(runs.c.id)).all()
        counts = dict(conn.execute(sa.select(metrics.c.run_id, sa.func.count()).group_by(metrics.c.run_id)).all())
    out = []
    for r in rows:
        planned = json.loads(r.config_json).get("planned")
        of = f" of {len(planned)} planned" if isinstance(planned, list) else ""
        run_id = f" {r.id}" if with_ids else ""
        reason = (f"unfinished run{run_id} (it holds {counts.get(r.id, 0)}{of} results; the command was interrupted "
                  f"or is still running): left out")
        out.append((int(r.id), r.source, reason))
    return out


def ruler_rows(engine: Engine, *, include_unfinished: bool = False) -> list[dict[str, Any]]:
    """RULER rows of every stored RULER run, in the shape of ``results.parse_ruler_run`` output.

    The run's stored header (``config_json``, our results-file header) gives the model block and provenance;
    runs saved without one (e.g. through :func:`save_runs` by other tools) fall back to the ``runs`` columns.
    Runs stored as ``running`` (:func:`unfinished_runs`) are left out unless ``include_unfinished``.
    """
    query = sa.select(metrics, runs.c.config_json, runs.c.source, runs.c.model.label("run_model"),
                      runs.c.layout.label("run_layout"), runs.c.model_hash.label("run_model_hash"),
                      runs.c.checkpoint.label("run_checkpoint"), runs.c.git_sha.label("run_git_sha"),
                      runs.c.hylo_bench_version.label("run_version"), runs.c.created_utc.label("run_created"),
                      ).join(runs).where(runs.c.kind == "ruler")  # fmt: skip
    if not include_unfinished:
        query = query.where(sa.or_(runs.c.status.is_(None), runs.c.status != "running"))
    with engine.connect() as conn:
        stored = conn.execute(query.order_by(metrics.c.id)).all()
    out, headers = [], {}
    for r in stored:
        header = headers.setdefault(r.run_id, json.loads(r.config_json))
        model = header.get("model") or {}
        out.append({
            "model": model.get("name", r.run_model), "model_layout": model.get("layout", r.run_layout),
            "model_kind": model.get("kind"), "model_hash": model.get("hash", r.run_model_hash),
            "model_path": model.get("path", r.run_checkpoint), "task": r.task, "seq_len": r.seq_len,
            "score": r.value, "n": r.n, **json.loads(r.extra_json or "{}"),
            "samples_per_task": header.get("samples_per_task", r.n), "chat_template": header.get("chat_template"),
            "flavor": r.flavor, "tokenizer_hash": header.get("tokenizer_hash"),
            "git_sha": header.get("git_sha", r.run_git_sha),
            "hylo_bench_version": header.get("hylo_bench_version", r.run_version),
            "created_utc": header.get("created_utc", r.run_created), "run_file": r.source,
        })  # fmt: skip
    return out


