"""Checkpoint I/O in the released HyLo layout (checkpoint-format.md §2, §4): resolution of a model argument to a
folder, save, and the strict shape check behind loading (the load itself, which builds the model, is
:func:`hylo_bench.models.hybrid.load_hylo`; this module never imports the model).

Files: ``config.json`` (the base model's HF config), ``hybrid_config.json``, ``model.safetensors`` (one merged
state dict; sharded ``model-*.safetensors`` + index and ``pytorch_model.bin`` are read too). Loading is strict:
every mismatch is collected and reported at once, before any weight is materialised.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from hylo_bench.io_utils import atomic_write_bytes

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INFERENCE_ONLY_SUFFIXES = (".wk_b", ".wv_b")  # Zebra-Llama inference buffers, never saved (§2 rule 4)
GDN_SIGNATURE = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "g_proj.weight",
                 "o_norm.weight")
# Mamba-2 (Zebra-Llama) mixer keys that GDN lacks; A_log and dt_bias occur in both (§3.2).
MAMBA2_SIGNATURE = ("in_proj.weight", "conv1d.weight", "D")
_KIND_NAMES = {"gdn": "Gated DeltaNet", "mamba": "Mamba-2", "mla": "MLA"}


def demo_teacher_dir() -> Path:
    """Directory of the embedded demo teacher (shipped in ``hylo_bench/data/demo_teacher``).

    Raises:
        FileNotFoundError: if the package was installed without its data files.
    """
    d = Path(str(resources.files("hylo_bench") / "data" / "demo_teacher"))
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: the embedded demo teacher is missing; reinstall hylo-bench with its package "
                                f"data or rebuild it with scripts/make_demo_teacher.py")
    return d


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors disagree with the architecture its config describes (lists every key)."""


def resolve_checkpoint_dir(spec: str | Path, gguf_dtype=None) -> Path:
    """Local directory of a checkpoint given a local path, ``demo``, a ``.gguf`` file, a known model name
    (``hylo-bench fetch``), or a Hugging Face hub id.

    Hub ids are looked up in the local HF cache first (works offline), then downloaded. A ``.gguf`` file (or a
    fetched known model) resolves to its converted folder in the cache, converted on first use in ``gguf_dtype``
    (None: any conversion already cached, else float32; :mod:`hylo_bench.models.gguf`).

    Raises:
        FileNotFoundError: when the spec is neither an existing directory, a GGUF file, a fetched known model nor
            a resolvable hub id. ValueError: a bad GGUF file (named).
    """
    from hylo_bench.models import gguf

    if str(spec) == "demo":
        return demo_teacher_dir()
    if str(spec) in gguf.KNOWN_MODELS and not Path(spec).exists():
        return gguf.resolve_known_model(str(spec), gguf_dtype)
    p = Path(spec).expanduser()
    if gguf.is_gguf_path(p) and not p.is_dir():
        return gguf.convert_gguf(p, gguf_dtype)
    if p.is_dir():
        return p
    if p.exists():
        raise FileNotFoundError(f"{p}: is a file; expected a checkpoint directory (config.json, weights, tokenizer) "
                                f"or a .gguf model file")
    if str(spec).count("/") != 1 or str(spec).startswith((".", "/")):
        raise FileNotFoundError(f"{spec}: no such directory, and not a hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(spec), local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the cache: try the network next
        pass
    try:
        return Path(snapshot_download(str(spec)))
    except Exception as e:  # noqa: BLE001
        raise FileNotFoundError(f"{spec}: not a local directory, not in the Hugging Face cache, and the hub "
                                f"download failed ({type(e).__name__}: {e}). Download it on a machine with "
                                f"network access (huggingface-cli download {spec}) and pass the local path.") from e


def _weight_files(d: Path) -> list[Path]:
    if (d / WEIGHTS_NAME).is_file():
        return [d / WEIGHTS_NAME]
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: lists shard(s) {missing} that are not in {d}")
        return [d / f for f in files]
    if (d / "pytorch_model.bin").is_file():
        return [d / "pytorch_model.bin"]
    raise FileNotFoundError(f"{d}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def read_tensor_shapes(d: Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Names and shapes of every stored tensor without reading the data (safetensors headers).

    Raises:
        ValueError: naming the file when a safetensors file is truncated or corrupt.
    """
    out: dict[str, tuple[tuple[int, ...], Path]] = {}
    for f in _weight_files(d):
        if f.suffix == ".bin":
            sd = torch.load(f, map_location="meta", weights_only=True)
            out.update({k: (tuple(v.shape), f) for k, v in sd.items()})
            continue
        try:
            with safe_open(f, framework="pt") as fh:
                for k in fh.keys():
                    out[k] = (tuple(fh.get_slice(k).get_shape()), f)
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            raise ValueError(f"{f}: cannot read safetensors header ({type(e).__name__}: {e}); the file is "
                             f"truncated or corrupt - re-download or re-export it") from e
    return out


def _canonical_key(key: str, mixer_attr: dict[int, tuple[str, str]]) -> str:
    parts = key.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers":
        attr, kind = mixer_attr.get(int(parts[2]), (None, None))
        if attr and parts[3] == attr:
            parts[3] = kind
    return ".".join(parts)


def _detect_mixer_attrs(keys: list[str]) -> dict[int, tuple[str, str]]:
    """Layer index -> (attribute, "gdn" | "mamba") of its linear mixer, found by signature keys (§3.2, §4.4).

    GDN: fla's keys (``q_conv1d.weight``, ``g_proj.weight``, ...); Mamba-2: ``in_proj.weight``, ``conv1d.weight``,
    ``D``. Any attribute name is accepted; the canonical names are ``gdn`` and ``mamba``.
    """
    by_attr: dict[tuple[int, str], set[str]] = {}
    for k in keys:
        parts = k.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            by_attr.setdefault((int(parts[2]), parts[3]), set()).add(".".join(parts[4:]))
    out: dict[int, tuple[str, str]] = {}
    for (i, a), names in by_attr.items():
        if all(s in names for s in GDN_SIGNATURE):
            out[i] = (a, "gdn")
        elif all(s in names for s in MAMBA2_SIGNATURE):
            out[i] = (a, "mamba")
    return out


def _mixer_type_problems(model: torch.nn.Module, mixer_attr: dict[int, tuple[str, str]]) -> list[str]:
    """One line per layer whose stored linear mixer type disagrees with the config's layer plan."""
    types = getattr(getattr(model, "config", None), "mixer_types", None)
    if types is None:
        return []
    problems = []
    for i, (attr, kind) in sorted(mixer_attr.items()):
        want = types[i] if i < len(types) else None
        if want is not None and want != kind:
            problems.append(f"layer {i}: hybrid_config.json makes it {_KIND_NAMES[want]} ({want!r}) but the state "
                            f"dict holds a {_KIND_NAMES[kind]} mixer under model.layers.{i}.{attr} - the weights "
                            f"are authoritative: set linear_type to {kind!r} in config.json's 'hylo_bench' object (and "
                            f"check mla_layers)")
    return problems


def check_compatible(model: torch.nn.Module, stored: dict[str, tuple[tuple[int, ...], Path]], where: str) -> dict:
    """Compare stored names/shapes with ``model``'s; return stored-name -> model-name mapping.

    Raises:
        CheckpointMismatchError: listing every missing, unexpected and mis-shaped key with both shapes.
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mixer_attr = _detect_mixer_attrs(list(stored))
    type_problems = _mixer_type_problems(model, mixer_attr)
    if type_problems:
        raise CheckpointMismatchError(f"{where}: linear mixer type disagrees with hybrid_config.json:\n  "
                                      + "\n  ".join(type_problems))
    mapping, dropped = {}, []
    for k in stored:
        if k.endswith(INFERENCE_ONLY_SUFFIXES):
            dropped.append(k)
            continue
        mapping[k] = _canonical_key(k, mixer_attr)
    if dropped:
        logger.warning("%s: dropping %d inference-only buffers (%s ...)", where, len(dropped), dropped[0])
    present = set(mapping.values())
    if "lm_head.weight" in expected and "lm_head.weight" not in present and "model.embed_tokens.weight" in present:
        logger.warning("%s: no lm_head.weight; tied export - using model.embed_tokens.weight for the head", where)
        mapping["model.embed_tokens.weight#tied"] = "lm_head.weight"
        stored = dict(stored)
        stored["model.embed_tokens.weight#tied"] = stored["model.embed_tokens.weight"]
        present.add("lm_head.weight")
    problems = [f"missing key {k} (expected shape {list(s)})" for k, s in expected.items() if k not in present]
    for src, dst in mapping.items():
        if dst not in expected:
            problems.append(f"unexpected key {src} (shape {list(stored[src][0])})")
        elif tuple(stored[src][0]) != expected[dst]:
            problems.append(f"wrong shape for {src}: expected {list(expected[dst])}, found {list(stored[src][0])}")
    if problems:
        raise CheckpointMismatchError(f"{where}: checkpoint does not match hybrid_config.json "
                                      f"({len(problems)} problem(s)):\n  " + "\n  ".join(problems))
    return mapping


def stored_dtypes(d: Path) -> dict[str, str]:
    """Stored dtype of every tensor (safetensors header names such as ``F32``, ``BF16``, ``I32``; torch names for
    ``pytorch_model.bin``), without reading the data."""
    out: dict[str, str] = {}
    for f in _weight_files(d):
        if f.suffix == ".bin":
            sd = torch.load(f, map_location="meta", weights_only=True)
            out.update({k: str(v.dtype).removeprefix("torch.") for k, v in sd.items()})
            continue
        with safe_open(f, framework="pt") as fh:
            out.update({k: fh.get_slice(k).get_dtype() for k in fh.keys()})  # noqa: SIM118 (a safe_open handle)
    return out


def warn_bad_weights(d: Path, model: torch.nn.Module) -> list[str]:
    """Log a warning (and return its lines) when a checkpoint's weights cannot be what its model computes with:
    tensors stored as integers or booleans (converted silently on load), or parameters / buffers holding NaN or inf
    (every output would be NaN).

    Args:
        d: the checkpoint folder (its weight files' headers are read). model: the model loaded from it.
    """
    lines = []
    ints = {k: t for k, t in stored_dtypes(d).items()
            if not t.startswith(("F", "BF", "float", "bfloat"))}
    if ints:
        shown = ", ".join(f"{k} ({t})" for k, t in list(ints.items())[:3]) + (" ..." if len(ints) > 3 else "")
        lines.append(f"{d}: {len(ints)} weight tensor(s) are stored as integers or booleans, not floating point "
                     f"({shown}); they were converted on load: check how the checkpoint was exported")
    bad = [k for k, t in model.state_dict().items() if t.is_floating_point() and t.device.type != "meta"
           and not bool(torch.isfinite(t).all())]
    if bad:
        shown = ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else "")
        lines.append(f"{d}: {len(bad)} tensor(s) hold NaN or inf values ({shown}); the model's outputs will be "
                     f"NaN / inf: re-export or re-train the checkpoint")
    for line in lines:
        logger.warning("%s", line)
    return lines


def save_hylo(model, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write ``config.json``, ``hybrid_config.json`` and ``model.safetensors`` (atomically) in the released layout.

    Tensors are saved as they are (contiguous copies); inference-only buffers are never written; tensors that
    share storage (a head tied to the embedding by hand) are written as separate copies, as the released
    checkpoints store ``lm_head.weight`` apart. ``state_dict`` replaces ``model.state_dict()`` (e.g. the merged
    full state dict of an FSDP-sharded model).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model.config.save_files(d)
    sd, storages = {}, set()
    for k, v in (model.state_dict() if state_dict is None else state_dict).items():
        if k.endswith(INFERENCE_ONLY_SUFFIXES):
            continue
        t = v.detach().contiguous().cpu()
        if t.numel() and t.untyped_storage().data_ptr() in storages:
            t = t.clone()  # shares storage with a tensor already taken (a tied head): write a copy
        storages.add(t.untyped_storage().data_ptr())
        sd[k] = t
    atomic_write_bytes(d / WEIGHTS_NAME, safetensors_save(sd, metadata={"format": "pt"}))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(d)
