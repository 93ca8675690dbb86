"""The weights hash (provenance, ``ruler --resume`` keys, the model identity in the store): every byte, streamed,
cached by (path, size, mtime)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from hylo_bench import io_utils
from hylo_bench.models.loading import weights_hash
from hylo_bench.tasks.ruler.predictions import predictions_path


def _checkpoint(d: Path, middle: float) -> Path:
    """A 3 MiB model.safetensors whose only difference between calls is one float in the middle."""
    d.mkdir(parents=True)
    w = torch.zeros(3 * 2 ** 18)  # 3 MiB of float32
    w[len(w) // 2] = middle
    save_file({"w": w}, str(d / "model.safetensors"))
    return d


def _by_hand(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        data = f.read_bytes()
        h.update(f"{f.name}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return h.hexdigest()


def test_checkpoints_differing_only_in_the_middle_have_different_hashes(tmp_path):
    a, b = _checkpoint(tmp_path / "a", 0.0), _checkpoint(tmp_path / "b", 1.0)
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size > 3 * 2 ** 20
    assert weights_hash(a) == _by_hand(a) and weights_hash(b) == _by_hand(b)
    assert weights_hash(a) != weights_hash(b)
    # so `ruler --resume` keys their predictions apart (the middle-only difference once reused another's)
    keys = {"task": "niah_single_1", "length_tokens": 1024, "dtype": "float32", "tok_hash": "t" * 64,
            "data_hash": "d" * 64, "seed": 42, "flavor": "nvidia", "chat_template": False, "max_gen_toks": 128}
    assert predictions_path(tmp_path, model_hash=weights_hash(a), **keys) != \
        predictions_path(tmp_path, model_hash=weights_hash(b), **keys)


def test_hash_is_cached_by_path_size_and_mtime(tmp_path, monkeypatch):
    d = _checkpoint(tmp_path / "ckpt", 0.5)
    reads = []
    real = io_utils.sha256_file
    monkeypatch.setattr(io_utils, "sha256_file", lambda p, *a, **k: reads.append(Path(p)) or real(p, *a, **k))
    first = weights_hash(d)
    assert reads == [d / "model.safetensors"]
    assert weights_hash(d) == first and len(reads) == 1  # same (path, size, mtime): not read again
    monkeypatch.setattr(io_utils, "_hash_memo", {})  # a new process: the on-disk cache answers
    assert weights_hash(d) == first and len(reads) == 1
    assert (Path(os.environ["HYLO_BENCH_CACHE"]) / "weights-sha256.json").is_file()
    # same size, new bytes, new mtime: hashed again, and the new hash is the new content's
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    assert weights_hash(d) == _by_hand(d) != first and len(reads) == 2
