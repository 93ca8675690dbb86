"""Memory-bandwidth bound of a decode step, for serving records (``bound_tpot_s``, ``fraction_of_bound``).

A decode step at batch B is bound by the bytes it must move (the roofline of a memory-bound kernel chain):

    bytes = W + B * (T * c + 2 * s)
    bound_tpot_s = bytes / bandwidth,   fraction_of_bound = bound_tpot_s / tpot_s

- W: every weight read once per step (the whole batch shares the read): all parameters except the input embedding
  table, of which only the B looked-up rows are read (a head tied to the embedding reads the whole matrix).
- c: cache bytes per token read by attention: HyLo, per MLA layer ``kv_lora_rank + qk_rope_head_dim`` elements
  (checkpoint-format.md §6), plus the engine's G key scales for q/k-norm models (:mod:`hylo_bench.decode.mla_layer`);
  a transformer, ``2 * n_kv * d_h`` elements per layer (K and V). T: tokens in each sequence's cache.
- s: the fixed-size state per sequence of the GDN / Mamba-2 layers (``state_bytes_per_sequence``: recurrent state and
  conv inputs), read and written each step, hence 2 s.

``bandwidth``: the device's copy bandwidth ((read + write) bytes per second of a large ``dst.copy_(src)``),
4.30e12 B/s on an H200 (measured, ``benchmarks/results/serving_sweep.json``); other devices are measured when the
record is made (:func:`measure_copy_bandwidth`). The formula is the one of the bounds in issue 22
(``benchmarks/serving_sweep.py`` reports its bytes as ``decode_bytes_per_token``); compute and launch overheads are
ignored, so the bound is a lower limit on the step time.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

COPY_BANDWIDTH_B_PER_S = {"H200": 4.30e12}
"""Measured copy bandwidth by device-name substring (bytes/s)."""


def measure_copy_bandwidth(device: str | torch.device, nbytes: int | None = None, reps: int | None = None) -> float:
    """(read + write) bytes per second of ``dst.copy_(src)`` for ``nbytes``-byte buffers on ``device`` (default
    1 GiB x 10 on GPU, 64 MiB x 3 on CPU; one untimed copy first)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = nbytes or (2 ** 30 if cuda else 64 * 2 ** 20)
    reps = reps or (10 if cuda else 3)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def device_name(device: str | torch.device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.cache
def copy_bandwidth(device: str) -> tuple[float, str]:
    """(bytes/s, source) for ``device``: the table entry whose key the device name contains ("table:H200"), else a
    measured copy ("measured"; once per process)."""
    name = device_name(device)
    for key, bw in COPY_BANDWIDTH_B_PER_S.items():
        if key in name:
            return bw, f"table:{key}"
    return measure_copy_bandwidth(device), "measured"


def _elem(model) -> int:
    return next(p for p in model.parameters() if p.dim() >= 2).element_size()


def decode_step_bytes(model, batch: int, context_tokens: int) -> dict[str, int]:
    """Bytes one decode step moves at ``batch`` sequences of ``context_tokens`` cached tokens (module docstring).

    Returns:
        ``{"weights", "cache", "state", "total"}`` in bytes: W (+ B embedding rows), B * T * c, B * 2 * s, the sum.

    Raises:
        ValueError: a model that is neither a HyLo hybrid (``config.mixer_types``) nor a Llama / Qwen3-style
            transformer (``model.model.layers[*].self_attn``).
    """
    hybrid = hasattr(getattr(model, "config", None), "mixer_types")
    layers = list(getattr(getattr(model, "model", None), "layers", []))
    if not hybrid and not (layers and all(hasattr(layer, "self_attn") for layer in layers)):
        raise ValueError(f"{type(model).__name__}: no decode bound for this architecture (HyLo or Llama/Qwen3-style "
                         f"transformers only)")
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    weights += emb.numel() * emb.element_size() if tied else batch * emb.shape[1] * emb.element_size()
    elem = _elem(model)
    per_token, state = 0, 0
    if hybrid:
        for layer in layers:
            m = layer.mixer
            if layer.mixer_type == "mla":
                per_token += (m.kv_rank + m.rope_dim + (m.num_kv_heads if m.use_qk_norm else 0)) * elem
            else:
                state += m.state_bytes_per_sequence()
    else:
        cfg = model.config
        d_h = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = len(layers) * 2 * cfg.num_key_value_heads * d_h * elem
    cache, state_rw = batch * context_tokens * per_token, batch * 2 * state
    return {"weights": weights, "cache": cache, "state": state_rw, "total": weights + cache + state_rw}


def bound_fields(model, batch: int, context_tokens: int, tpot_s: float | None, device: str | torch.device,
                 bandwidth: tuple[float, str] | None = None) -> dict[str, Any]:
    """Record fields: ``bound_bytes_per_step`` (+ ``bound_weight_bytes``, ``bound_cache_bytes``,
    ``bound_state_bytes``), ``copy_bandwidth_B_per_s``, ``bandwidth_source``, ``bound_tpot_s`` (s) and
    ``fraction_of_bound`` (bound_tpot_s / tpot_s; None without a measured TPOT).

    ``bandwidth``: (bytes/s, source) to use instead of :func:`copy_bandwidth` of ``device``.
    """
    b = decode_step_bytes(model, batch, context_tokens)
    bw, source = bandwidth if bandwidth is not None else copy_bandwidth(str(torch.device(device)))
    bound = b["total"] / bw
    return {"bound_bytes_per_step": b["total"], "bound_weight_bytes": b["weights"], "bound_cache_bytes": b["cache"],
            "bound_state_bytes": b["state"], "copy_bandwidth_B_per_s": bw, "bandwidth_source": source,
            "bound_tpot_s": bound, "fraction_of_bound": bound / tpot_s if tpot_s else None}
