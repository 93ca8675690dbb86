"""What a folder holds, to assert that a failed command wrote and changed nothing: every path with its bytes, and
for SQLite stores their logical contents (opening a store in WAL mode rewrites header bytes and adds -wal / -shm
files while a connection is open; neither is a change of what it stores)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

_SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def sqlite_dump(path: Path) -> list[str]:
    """The SQL statements that rebuild ``path`` (schema and every row), read through a read-only connection."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def tree_snapshot(root: Path) -> dict[str, object]:
    """``{relative path: bytes | sqlite dump | "<dir>"}`` of everything under ``root``."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_dir():
            out[rel] = "<dir>"
        elif p.name.endswith(_SQLITE_SIDE_FILES):
            continue
        elif p.suffix == ".sqlite":
            out[rel] = sqlite_dump(p)
        else:
            out[rel] = p.read_bytes()
    return out


def changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """Paths added, removed or changed between two snapshots (empty when nothing changed)."""
    return sorted({k for k in before.keys() | after.keys() if before.get(k) != after.get(k)})
