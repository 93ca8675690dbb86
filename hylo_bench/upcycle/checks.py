"""Checks of every ``upcycle`` setting, path and output folder before torch is imported or a model is loaded.

Torch-free (config files and folders only), so a wrong flag is reported at once instead of after the model loads.
:func:`check_upcycle_config` is the first thing :func:`hylo_bench.upcycle.run.run` does.
"""

from __future__ import annotations

import json
import math
import re
from importlib import resources
from pathlib import Path
from typing import Any

from hylo_bench.config.hybrid import read_hf_config
from hylo_bench.io_utils import check_output_path, check_utf8_file, read_text_utf8

DEVICE_RE = re.compile(r"(cpu|cuda|mps|xpu|hpu|npu|meta)(:\d+)?")
AUTO_PREFIX = "auto:"  # as hylo_bench.upcycle.select.AUTO_PREFIX (that module imports torch)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# What an upcycle run writes into OUT before its manifest exists (layer selection, decontamination report); a
# SIGKILL during an atomic write leaves a ".<name>.<random>.tmp" file next to them.
BEFORE_MANIFEST = ("layer_selection.json", "decontamination.json", "manifest.json")
_TEMP_RE = re.compile(r"\.(?:{})\.[^/]+\.tmp".format("|".join(re.escape(n) for n in BEFORE_MANIFEST)))
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")


def _demo_dir() -> Path:
    return Path(str(resources.files("hylo_bench") / "data" / "demo_teacher"))


def check_model_spec(spec: str, flag: str) -> dict[str, Any] | None:
    """A ``--base`` / ``--teacher`` value: ``demo``, a local Llama / Qwen3 checkpoint, a ``.gguf`` file, a fetched
    known model (``hylo-bench fetch``), or a hub id ``org/name``.

    Returns:
        The local checkpoint's ``config.json`` (None for a hub id or a GGUF file not converted yet, which are
        resolved when they load).

    Raises:
        FileNotFoundError: a path that does not exist, no config.json or tokenizer files, a known model not fetched
            (the message names ``hylo-bench fetch``). ValueError: a file that is neither a folder nor a GGUF file, a
            HyLo hybrid, a bad config.json.
    """
    from hylo_bench.models import gguf

    if spec == "demo":
        return read_hf_config(_demo_dir(), flag)
    p = Path(spec).expanduser()
    if spec in gguf.KNOWN_MODELS and not p.exists():
        f = gguf.known_model_file(spec)
        if not f.is_file():
            raise FileNotFoundError(f"{flag} {spec}: not fetched yet; run `hylo-bench fetch {spec}`")
        p = f
    if gguf.is_gguf_path(p) and not p.is_dir():
        gguf._check_magic(p)  # exists and is a GGUF file (the rest is checked when it is converted)
        return None
    if p.is_dir():
        if (p / "hybrid_config.json").is_file():
            raise ValueError(f"{flag} {spec}: is already a HyLo hybrid; --base/--teacher must be a Llama or Qwen3 "
                             f"checkpoint")
        cfg = read_hf_config(p, flag)
        if not any((p / f).is_file() for f in TOKENIZER_FILES):
            raise FileNotFoundError(f"{p}: no tokenizer files (tokenizer.json / tokenizer_config.json); save the "
                                    f"tokenizer next to the weights (tokenizer.save_pretrained(dir))")
        if not any(p.glob("*.safetensors")) and not any(p.glob("pytorch_model*.bin")):
            raise FileNotFoundError(f"{flag} {p}: no weights (model.safetensors, model-*.safetensors or "
                                    f"pytorch_model.bin)")
        return cfg
    if p.exists():
        raise ValueError(f"{flag} {spec}: is a file; expected a checkpoint directory (config.json, weights, "
                         f"tokenizer)")
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise FileNotFoundError(f"{flag} {spec}: no such directory, and not a hub id of the form 'org/name'")
    return None


def check_out_dir(out: Path, overwrite: bool) -> None:
    """``--out`` must be a folder this run may write: new, empty, or an earlier upcycle run (resumed). A folder
    holding anything else (another model, say) is refused unless ``overwrite``.

    Raises:
        ValueError: ``--out`` is a file or lies under one; it holds files this run did not write (listed); its
            manifest.json is unreadable.
    """
    check_output_path(out, "--out", is_dir=True)
    if not out.is_dir():
        return
    manifest = out / "manifest.json"
    if manifest.is_file():
        try:
            kind = json.loads(read_text_utf8(manifest)).get("kind")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"--out {out}: {manifest} is not a readable upcycle manifest ({e}); use a new --out "
                             f"(or pass --overwrite to start a new run there)") from None
        if kind == "upcycle":
            return  # an earlier run of this command: resumed, after its settings are compared
        foreign = sorted(e.name for e in out.iterdir())
    else:
        foreign = sorted(e.name for e in out.iterdir() if e.name not in BEFORE_MANIFEST and not _TEMP_RE.fullmatch(
            e.name))
    if foreign and not overwrite:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise ValueError(f"--out {out}: holds files this run did not write ({shown}); upcycle would replace "
                         f"config.json, model.safetensors and the tokenizer files there. Use a new or empty folder, "
                         f"or pass --overwrite to write into it anyway")


def check_data(data: str) -> None:
    """``--data``: ``demo``, a .txt / .jsonl file, a folder of them, or a mixture .yaml; every text file UTF-8.

    Raises:
        FileNotFoundError: the path does not exist. ValueError: unsupported suffix, a folder without .txt /
            .jsonl files, a file that is not UTF-8, a mixture that is not a YAML mapping.
    """
    if data == "demo":
        return
    if isinstance(data, dict):  # a recipe's inline mixture
        from hylo_bench.config.mixture import parse_mixture

        parse_mixture(data.get("mixture"), f"{data.get('source')}: data")
        return
    p = Path(data).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"--data {p}: no such file or directory")
    if p.is_file() and p.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            raw = yaml.safe_load(read_text_utf8(p, "--data"))
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
            raise ValueError(f"--data {p}: not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("sources"), list) or not raw["sources"]:
            raise ValueError(f"--data {p}: expected a mapping with a non-empty 'sources' list (see "
                             f"hylo_bench/config/mixture.py for the format)")
        return
    files = sorted(f for f in p.rglob("*") if f.suffix in DATA_SUFFIXES) if p.is_dir() else [p]
    if p.is_dir() and not files:
        raise ValueError(f"--data {p}: no .txt, .jsonl or .parquet files in this folder")
    for f in files:
        if f.suffix not in DATA_SUFFIXES:
            raise ValueError(f"--data {f}: unsupported file type {f.suffix!r}; use .txt, .jsonl, .parquet or a "
                             f"mixture .yaml")
        if f.suffix != ".parquet":
            check_utf8_file(f, "--data")


def _check_number(problems: list[str], flag: str, value: Any, *, minimum: float, integer: bool,
                  strict: bool = False) -> None:
    kind = "an integer" if integer else "a number"
    bad_type = isinstance(value, bool) or not isinstance(value, int if integer else (int, float))
    if bad_type or not math.isfinite(value) or value < minimum or (strict and value <= minimum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        problems.append(f"{flag} {value!r}: expected {kind} {bound}")


def check_layout(cfg: Any, n_layer: int | None) -> None:
    """``--layout`` / ``--mla-layers`` against the base model's layer count (when known).

    Raises:
        ValueError: both given, a malformed layout, indices out of range or repeated.
    """
    from hylo_bench.config.hybrid import parse_layout

    layout = cfg.layout.strip() if isinstance(cfg.layout, str) else cfg.layout
    auto = layout[len(AUTO_PREFIX):].strip() if layout and layout.lower().startswith(AUTO_PREFIX) else None
    if cfg.mla_layers is not None and layout is not None:
        if auto is not None:
            raise ValueError(f"--layout {layout}: chooses the MLA layers itself; drop --mla-layers")
        raise ValueError("give either --layout or --mla-layers, not both")
    if layout is not None:
        name = auto if auto is not None else layout
        m = re.fullmatch(r"(\d+)MLA(\d+)(GDN|M2)", name, flags=re.IGNORECASE)
        if not m:
            raise ValueError(f"--layout {name!r}: expected '<n>MLA<m>GDN' or '<n>MLA<m>M2', e.g. '7MLA21GDN'"
                             + (" (after 'auto:')" if auto is not None else ""))
        if n_layer is not None:
            parse_layout(name, n_layer)
        return
    if cfg.mla_layers is not None:
        bad = [i for i in cfg.mla_layers if not isinstance(i, int) or i < 0 or (n_layer is not None and i >= n_layer)]
        if bad or len(set(cfg.mla_layers)) != len(cfg.mla_layers):
            where = f"[0, {n_layer}) for this {n_layer}-layer base model" if n_layer is not None else ">= 0"
            raise ValueError(f"--mla-layers {cfg.mla_layers}: expected distinct indices in {where}")
        if cfg.linear_type not in ("gdn", "mamba"):
            raise ValueError(f"linear_type {cfg.linear_type!r}: expected 'gdn' or 'mamba'")


def check_upcycle_config(cfg: Any) -> None:
    """Every setting of an :class:`~hylo_bench.config.upcycle.UpcycleConfig`, torch-free (see the module docstring).

    Raises:
        ValueError / FileNotFoundError: the first bad path, or every bad number at once, with the flag named.
    """
    from hylo_bench.upcycle.stages import parse_stages

    problems: list[str] = []
    for flag, value in (("--batch-size", cfg.batch_size), ("--grad-accum", cfg.grad_accum)):
        _check_number(problems, flag, value, minimum=1, integer=True)
    for flag, value in (("--tokens-per-stage", cfg.tokens_per_stage), ("save_every", cfg.save_every),
                        ("kl_chunk_size", cfg.kl_chunk_size), ("--select-windows", cfg.select_windows)):
        _check_number(problems, flag, value, minimum=1, integer=True)
    _check_number(problems, "--eval-windows", cfg.eval_windows, minimum=0, integer=True)
    for flag, value in (("--ild-lr", cfg.ild_lr), ("--kd-lr", cfg.kd_lr), ("temperature", cfg.temperature)):
        _check_number(problems, flag, value, minimum=0, integer=False, strict=True)
    if cfg.peak_tflops is not None:
        _check_number(problems, "--peak-tflops", cfg.peak_tflops, minimum=0, integer=False, strict=True)
    _check_number(problems, "--seed", cfg.seed, minimum=0, integer=True)
    for key in ("kv_lora_rank", "q_lora_rank"):
        if cfg.mixer_overrides.get(key) is not None:
            _check_number(problems, f"--{key.replace('_', '-')}", cfg.mixer_overrides[key], minimum=1, integer=True)
    if cfg.device is not None and not DEVICE_RE.fullmatch(str(cfg.device)):
        problems.append(f"--device {cfg.device!r}: not a torch device; use cpu, cuda or cuda:N")
    modes = ("kd", "all", "off")
    if cfg.doc_boundaries is not None and cfg.doc_boundaries not in modes:
        problems.append(f"--doc-boundaries {cfg.doc_boundaries!r}: expected one of {', '.join(modes)}")
    if problems:
        raise ValueError("; ".join(problems))
    parse_stages(cfg.stages, cfg.tokens_per_stage)
    check_out_dir(Path(cfg.out).expanduser(), getattr(cfg, "overwrite", False))
    base = check_model_spec(cfg.base, "--base")
    teacher = base if cfg.teacher in (None, cfg.base) else check_model_spec(cfg.teacher, "--teacher")
    if base is not None and teacher is not None and base.get("vocab_size") != teacher.get("vocab_size"):
        raise ValueError(f"--teacher vocab size {teacher.get('vocab_size')} != base vocab size "
                         f"{base.get('vocab_size')}; distillation needs the same tokenizer")
    check_layout(cfg, base.get("num_hidden_layers") if base is not None else None)
    if getattr(cfg, "init_from", None) is not None:
        d = Path(cfg.init_from).expanduser()
        if not (d / "hybrid_config.json").is_file():
            raise FileNotFoundError(f"--init-from {d}: not a HyLo checkpoint folder (no hybrid_config.json); give an "
                                    f"upcycle --out folder or a hybrid checkpoint")
    check_data(cfg.data)
    for path in cfg.decontam or []:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"--decontam {p}: no such file or directory; expected DIR/<task>/<split>.jsonl "
                                    f"(as for `hylo-bench eval --data-dir`) and/or .txt files")
        if p.is_file() and p.suffix not in DATA_SUFFIXES:
            raise ValueError(f"--decontam {p}: unsupported file type {p.suffix!r}; use .jsonl or .txt")
        for f in ([p] if p.is_file() else sorted(p.rglob("*.txt")) + sorted(p.glob("*/*.jsonl"))):
            check_utf8_file(f, "--decontam")
