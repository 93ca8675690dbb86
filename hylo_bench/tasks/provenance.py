"""Provenance shared by ``ruler`` and ``eval`` results files: software versions, git sha, a model's parameter dtype,
tokenizer and text hashes."""

from __future__ import annotations

import hashlib
import platform
import tempfile
from pathlib import Path
from typing import Any

import hylo_bench
from hylo_bench.io_utils import git_sha, package_version


def software_versions() -> dict[str, str]:
    """torch, transformers, Python and hylo-bench versions and the git sha, as provenance records them."""
    return {"torch_version": package_version("torch") or "not installed",
            "transformers_version": package_version("transformers") or "not installed",
            "python_version": platform.python_version(), "hylo_bench_version": hylo_bench.__version__,
            "git_sha": git_sha()}


def param_dtype(model: Any) -> str:
    """The dtype of a model's first parameter without the ``torch.`` prefix (``"bfloat16"``); ``"unknown"``."""
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return "unknown" if param is None else str(param.dtype).removeprefix("torch.")


def tokenizer_hash(tokenizer: Any) -> str:
    """Hex sha256 identifying a tokenizer: its serialized ``tokenizer.json`` (``backend_tokenizer.to_str()``) plus
    its chat template; for slow tokenizers, the files written by ``save_pretrained``."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode("utf-8"))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            for path in sorted(Path(tmp).rglob("*")):
                if path.is_file():
                    h.update(path.name.encode("utf-8") + b"\0" + path.read_bytes())
    h.update(b"\0chat_template\0" + str(getattr(tokenizer, "chat_template", None) or "").encode("utf-8"))
    return h.hexdigest()


def text_hash(text: str) -> str:
    """Hex sha256 of a text (UTF-8)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
