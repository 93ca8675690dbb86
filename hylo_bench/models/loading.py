"""Load any model argument of the CLI: ``demo``, a local checkpoint dir, or a hub id; hybrid or plain HF.

A directory with ``hybrid_config.json`` is a HyLo hybrid (``HyLoForCausalLM``); anything else is loaded with
``transformers.AutoModelForCausalLM``. The tokenizer always comes from the same directory.
"""

from __future__ import annotations

from pathlib import Path

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


def _load_transformers(auto_cls, d: Path, dtype: torch.dtype, device: str):
    """A plain transformers checkpoint, its ``config.json`` checked first (``config.hybrid.read_hf_config``).

    Raises:
        ValueError: a bad config.json (file, key, value), or one transformers cannot build a model from.
    """
    read_hf_config(d, "model")
    try:
        return auto_cls.from_pretrained(d, dtype=dtype).to(device)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise ValueError(f"{d / 'config.json'}: transformers cannot build a model from it "
                         f"({type(e).__name__}: {first})") from None


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hylo_bench.models.hybrid import load_hylo  # transformers' modeling code loads only for a model

    device = check_device(device or default_device())
    dtype = dtype or default_dtype(device)
    d = resolve_checkpoint_dir(spec)
    if (d / HYBRID_CONFIG_NAME).is_file():
        model, kind = load_hylo(d, dtype=dtype, device=device), "hybrid"
    else:
        model, kind = _load_transformers(AutoModelForCausalLM, d, dtype, device), "transformer"
        warn_bad_weights(d, model)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(d)
    name = "demo-teacher" if spec == "demo" else str(spec).rstrip("/")  # as typed: distinct paths, distinct names
    info = {"name": name, "path": str(d), "hash": weights_hash(d), "layout": layout_name(model), "kind": kind}
    return model, tokenizer, info
