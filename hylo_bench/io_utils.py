"""Small I/O helpers shared by every subpackage: atomic writes, hashing, git sha, package versions, UTC time stamps,
JSON results, output-path and text-file checks, the results callback type, and the fault-injection hook of the crash
tests."""

from __future__ import annotations

import codecs
import hashlib
import importlib.metadata
import json
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

OnResult = Callable[[dict, Path], Any]
"""``on_result(obj, path)``: how results leave a wing. A command calls it with each results object right after
writing it to ``path`` (a growing file is passed again after every rewrite); the CLI passes the results store's
``reports.store.recorder(...)``, a library caller whatever it wants (None: the files alone)."""

FAULT_ENV = "HYLO_BENCH_FAULT"
_fault_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Crash-test hook: SIGKILL this process on the N-th pass through the point ``name`` when
    ``$HYLO_BENCH_FAULT`` is ``<name>:<N>`` (N counted from 1 in this process; a name ending in ``*`` matches every
    point it prefixes, e.g. ``replace:niah_single_1-*:1``). A no-op otherwise.

    tests/test_faults.py kills ``upcycle`` and ``ruler`` at these points (atomic writes pass ``replace:<file
    name>`` between writing the temporary file and renaming it) and checks that a re-run loses and repeats nothing.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    want, _, nth = spec.rpartition(":")
    if not (name == want or want.endswith("*") and name.startswith(want[:-1])):
        return
    _fault_hits[want] = _fault_hits.get(want, 0) + 1
    if _fault_hits[want] == int(nth):
        os.kill(os.getpid(), signal.SIGKILL)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and ``os.replace`` (atomic on POSIX)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        fault_point(f"replace:{path.name}")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Atomic text write (UTF-8); see :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Atomic JSON write, indent 2, keys in insertion order."""
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
CACHE_ENV = "HYLO_BENCH_CACHE"
_HASH_CACHE_FILE = "weights-sha256.json"
_hash_memo: dict[tuple[str, int, int], str] = {}


def cache_dir() -> Path:
    """hylo-bench's own cache folder: ``$HYLO_BENCH_CACHE``, else ``~/.cache/hylo_bench``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hylo_bench").expanduser()


def cached_sha256(path: str | Path) -> str:
    """:func:`sha256_file` of ``path``, remembered by (resolved path, size, mtime in ns) in this process and in
    ``cache_dir()/weights-sha256.json`` (a write failure there only costs the next run a re-hash)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _hash_memo:
        return _hash_memo[key]
    file = cache_dir() / _HASH_CACHE_FILE
    try:
        table = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    hit = table.get(key[0])
    if isinstance(hit, dict) and hit.get("size") == key[1] and hit.get("mtime_ns") == key[2] \
            and isinstance(hit.get("sha256"), str):
        _hash_memo[key] = hit["sha256"]
        return hit["sha256"]
    digest = sha256_file(path)
    _hash_memo[key] = digest
    table[key[0]] = {"size": key[1], "mtime_ns": key[2], "sha256": digest}
    try:
        atomic_write_json(file, table)
    except OSError:
        pass
    return digest


def weights_sha256(d: str | Path) -> str:
    """Content hash of a checkpoint's weights: hex SHA-256 over (file name, size, SHA-256 of every byte) of each
    ``*.safetensors`` / ``pytorch_model*.bin`` file in ``d``, in name order. The files are read in 1 MiB blocks;
    each file's digest is cached by (path, size, mtime), so an unchanged checkpoint is read once.

    A folder without weight files hashes to the SHA-256 of nothing.
    """
    d = Path(d)
    files = sorted({f for pattern in WEIGHT_PATTERNS for f in d.glob(pattern) if f.is_file()})
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0{cached_sha256(f)}\n".encode())
    return h.hexdigest()


def read_text_utf8(path: str | Path, what: str = "") -> str:
    """The text of a UTF-8 file.

    Raises:
        ValueError: the file is not UTF-8 (the file, the byte offset and the byte named). FileNotFoundError /
            OSError: as ``open`` raises them.
    """
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(_not_utf8(path, what, e.start, data[e.start:e.start + 1])) from None


def check_utf8_file(path: str | Path, what: str = "", chunk_bytes: int = 1 << 20) -> None:
    """Check that a file is UTF-8 text without holding it in memory (incremental decoder).

    Raises:
        ValueError: as :func:`read_text_utf8`.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            pending = len(decoder.getstate()[0])  # bytes of a character split across blocks, decoded first
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise ValueError(_not_utf8(path, what, offset - pending + e.start,
                                           e.object[e.start:e.start + 1])) from None
            if not block:
                return
            offset += len(block)


def _not_utf8(path: str | Path, what: str, offset: int, byte: bytes) -> str:
    shown = f"byte 0x{byte.hex()}" if byte else "a cut-off character"
    return (f"{(what + ' ') if what else ''}{path}: not UTF-8 text ({shown} at offset {offset}); re-save the file "
            f"as UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def check_output_path(path: str | Path, flag: str, *, is_dir: bool) -> None:
    """Check that ``path`` can be created as a folder (``is_dir``) or written as a file, before any work.

    Raises:
        ValueError: ``path`` or one of its parents is an existing file where a folder is needed, or the output
            file is an existing folder (the flag and the offending path named).
    """
    p = Path(path).expanduser()
    if p.exists():
        if is_dir and not p.is_dir():
            raise ValueError(f"{flag} {path}: is a file, not a folder; give a folder to write into")
        if not is_dir and p.is_dir():
            raise ValueError(f"{flag} {path}: is a directory; give the file to write")
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {path}: {parent} is a file, so nothing can be written under it; choose "
                                 f"another path")
            break


def git_sha(cwd: str | Path | None = None) -> str:
    """The current git commit of the hylo-bench source tree (or ``cwd``), ``"unknown"`` outside git.

    ``HYLO_BENCH_GIT_SHA`` overrides it (for copies of the tree without ``.git``, e.g. on a GPU host).
    """
    if os.environ.get("HYLO_BENCH_GIT_SHA"):
        return os.environ["HYLO_BENCH_GIT_SHA"]
    cwd = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def utc_now(timespec: str = "seconds") -> str:
    """The current UTC time in ISO 8601 at ``timespec`` precision (``2026-12-01T20:10:53+00:00`` for seconds)."""
    return datetime.now(timezone.utc).isoformat(timespec=timespec)


def package_version(name: str) -> str | None:
    """The installed version of the distribution ``name`` (``importlib.metadata``); None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
