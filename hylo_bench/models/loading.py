"""Load any model argument of the CLI: ``demo``, a local checkpoint dir, or a hub id; hybrid or plain HF.

A directory with ``hybrid_config.json`` is a HyLo hybrid (``HyLoForCausalLM``); anything else is loaded with
``transformers.AutoModelForCausalLM``. The tokenizer always comes from the same directory.

This module is the one place that loads a user's causal LM or tokenizer through transformers: ``eval``, ``ruler``,
``generate`` and ``make-data`` through :func:`load_model`, ``upcycle`` (base and teacher) and ``sweep`` (weights
only) through :func:`load_causal_lm` and :func:`load_tokenizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hylo_bench.config.device import check_device, default_device, default_dtype
from hylo_bench.config.hybrid import HYBRID_CONFIG_NAME, read_hf_config
from hylo_bench.models.checkpoint import resolve_checkpoint_dir, warn_bad_weights


def weights_hash(d: Path) -> str:
    """The checkpoint's identity: SHA-256 of every byte of its weight files (``io_utils.weights_sha256``; streamed,
    cached by path, size and mtime)."""
    from hylo_bench.io_utils import weights_sha256

    return weights_sha256(d)


def layout_name(model) -> str:
    """``"2MLA2GDN"``-style name for a hybrid, ``"transformer"`` for a plain model."""
    cfg = model.config
    if not hasattr(cfg, "mixer_types"):
        return "transformer"
    n_mla = len(cfg.mla_layers)
    suffix = "GDN" if cfg.linear_type == "gdn" else "M2"
    return f"{n_mla}MLA{cfg.n_layer - n_mla}{suffix}"


def _load_transformers(spec: str, d: Path, dtype: torch.dtype, device: str, attn_implementation: str | None,
                       flag: str | None):
    """A plain transformers checkpoint, its ``config.json`` checked first (``config.hybrid.read_hf_config``).

    Raises:
        FileNotFoundError: no config.json. ValueError: a bad config.json (file, key, value), or one transformers
            cannot build a model from (with ``flag``: the flag and the value as typed named first).
    """
    from transformers import AutoModelForCausalLM

    read_hf_config(d, flag or "model")
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        return AutoModelForCausalLM.from_pretrained(d, dtype=dtype, **kw).to(device)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        where = (f"{flag} {spec}: transformers cannot build a model from {d / 'config.json'}" if flag
                 else f"{d / 'config.json'}: transformers cannot build a model from it")
        raise ValueError(f"{where} ({type(e).__name__}: {first})") from None


def load_causal_lm(spec: str | Path, device: str | None = None, dtype: torch.dtype | None = None, *,
                   attn_implementation: str | None = None, flag: str | None = None,
                   check: Callable[[Path], object] | None = None) -> tuple[Any, dict[str, str]]:
    """Load a model's weights (no tokenizer, no hash): a HyLo hybrid or a plain transformers causal LM.

    Args:
        spec: ``demo``, a local directory, a ``.gguf`` file, a fetched known model or a hub id
            (:func:`hylo_bench.models.checkpoint.resolve_checkpoint_dir`).
        device: ``cpu`` / ``cuda`` / ``cuda:N`` (default: cuda when available).
        dtype: parameter dtype (default: bf16 on GPU, fp32 on CPU; a hybrid's GDN / Mamba-2 ``A_log`` and
            ``dt_bias`` stay fp32).
        attn_implementation: transformers' attention backend for a plain model (``"sdpa"``, ``"eager"``, ...;
            None: transformers' default). A hybrid's MLA layers have their own attention, so it is ignored there.
        flag: the command-line flag ``spec`` came from (``--base``, ``--teacher``): error messages then start with
            the flag and the value as typed. None: they name the file alone.
        check: called with the resolved directory before any weight is read, for a caller's own rules (``upcycle``
            accepts plain Llama / Qwen3 checkpoints only, hub downloads included); its exceptions propagate.

    Returns:
        (model in eval mode on ``device``, info ``{"name", "path", "layout", "kind"}``): ``name`` is the spec as
        typed (``demo-teacher`` for ``demo``), ``path`` the resolved directory, ``kind`` "hybrid" | "transformer".

    Raises:
        FileNotFoundError: unresolvable spec or missing files. ValueError: a bad ``device``, or bad checkpoint
        contents (file and key named). CheckpointMismatchError: a hybrid's tensors do not match its config.
    """
    from hylo_bench.models.hybrid import load_hylo  # transformers' modeling code loads only for a model

    device = check_device(device or default_device())
    dtype = dtype or default_dtype(device)
    d = resolve_checkpoint_dir(spec)
    if check is not None:
        check(d)
    if (d / HYBRID_CONFIG_NAME).is_file():
        model, kind = load_hylo(d, dtype=dtype, device=device), "hybrid"
    else:
        model, kind = _load_transformers(str(spec), d, dtype, device, attn_implementation, flag), "transformer"
        warn_bad_weights(d, model)
    model.eval()
    name = "demo-teacher" if str(spec) == "demo" else str(spec).rstrip("/")  # as typed: distinct paths, distinct names
    return model, {"name": name, "path": str(d), "layout": layout_name(model), "kind": kind}


def load_tokenizer(d: str | Path):
    """The tokenizer saved in checkpoint directory ``d`` (transformers' ``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)


def load_model(spec: str, device: str | None = None, dtype: torch.dtype | None = None):
    """Load a model and its tokenizer for evaluation.

    Args:
        spec: ``demo``, a local directory, or a hub id (HF cache first, then download).
        device: ``cpu`` / ``cuda`` (default: cuda when available).
        dtype: parameter dtype (default: bf16 on GPU, fp32 on CPU).

    Returns:
        (model in eval mode, tokenizer, info dict with ``name``, ``path``, ``hash``, ``layout``, ``kind``).

    Raises:
        FileNotFoundError: unresolvable spec or missing files. ValueError / CheckpointMismatchError: bad
        checkpoint contents (file and key named).
    """
    model, loaded = load_causal_lm(spec, device, dtype)
    d = Path(loaded["path"])
    tokenizer = load_tokenizer(d)
    info = {"name": loaded["name"], "path": str(d), "hash": weights_hash(d), "layout": loaded["layout"],
            "kind": loaded["kind"]}
    return model, tokenizer, info
