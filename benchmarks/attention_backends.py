"""Which attention kernel the MLA prefill should run: one prefill chunk's attention at a recipe's MLA shapes
(``--recipe``, default the 7MLA21GDN: 16 query heads, 8 key/value heads, d_qk = 64 + 64, d_V = 128, bf16) over a
cached prefix, per SDPA back end, and the engine's own function per back end.

The chunked prefill (:func:`hylo_bench.kernels.prefix_attention.prefix_attention`) attends T chunk queries over
S = start + T keys with a lower-right causal mask; at 2M tokens this is most of the TTFT. Each SDPA point times
``F.scaled_dot_product_attention`` under ``torch.nn.attention.sdpa_kernel([backend])`` (the public back-end
switch); the back ends ``prefix:sdpa`` and ``prefix:cudnn_split`` time ``prefix_attention(..., backend=...)`` with
the lower-right mask (the cuDNN split: the chunk over the prefix unmasked plus the chunk over itself, merged by
log-sum-exp). Axes:

- ``mask``: ``lower_right`` (the engine's call: torch's ``CausalBias``, which picks its own kernel among flash
  and memory-efficient, so it is timed under those two only), ``none`` (the chunk over the prefix only, S - T
  keys: the part of a split prefill that needs no mask) or ``causal`` (the chunk over itself, T keys);
- ``gqa``: ``enable_gqa=True`` or K/V heads repeated to 16;
- ``pad_values``: V zero-padded to d_qk or not (only where d_V < d_qk).

Records (``benchmark: attention_backends``): ``backend``, ``mask``, ``gqa``, ``pad_values``, ``seq_len`` (S),
``chunk`` (T), ``time_s`` (median of ``--repeats`` CUDA-event timings after one warm-up), ``attention_flops``
(2 T S_eff H (d_qk + d_V), S_eff the mean keys a query sees), ``tflop_per_s``, ``status`` (``ok`` or
``unsupported`` / ``oom`` with the error's first line), and on CUDA ``kernel``: the longest-running kernel of
one profiled call, so a record says what ran even where the back-end switch does not bind. Rewritten after every
point.

Usage (H200, about a minute): ``python benchmarks/attention_backends.py --out $OUT/attention_backends.json``
CPU check (tiny shapes, the math back end): ``python benchmarks/attention_backends.py --tiny --out /tmp/a.json``
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import call_times, result_envelope, write_result  # noqa: E402

from hylo_bench.kernels.prefix_attention import prefix_attention  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def effective_keys(mask: str, T: int, S: int) -> float:
    """Mean keys attended per query: ``lower_right`` S - T + (T + 1) / 2, ``none`` S - T, ``causal`` (T + 1) / 2."""
    return {"lower_right": S - T + (T + 1) / 2, "none": S - T, "causal": (T + 1) / 2}[mask]


def attention_flops(mask: str, T: int, S: int, H: int, d_qk: int, d_v: int) -> float:
    """2 * T * S_eff * H * (d_qk + d_v): QK^T and PV multiply-adds (softmax not counted)."""
    return 2.0 * T * effective_keys(mask, T, S) * H * (d_qk + d_v)


def run_point(backend: str, mask: str, gqa: bool, pad: bool, T: int, S: int, shape: dict, device: str,
              dtype: torch.dtype, repeats: int) -> dict:
    H, G, d_qk, d_v = shape["H"], shape["G"], shape["d_qk"], shape["d_v"]
    keys = {"lower_right": S, "none": S - T, "causal": T}[mask]
    rec = {"benchmark": "attention_backends", "backend": backend, "mask": mask, "gqa": gqa, "pad_values": pad,
           "seq_len": S, "chunk": T, "key_len": keys, "batch_size": 1, "heads": H, "kv_heads": G,
           "attention_flops": attention_flops(mask, T, S, H, d_qk, d_v)}
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, H, T, d_qk, device=device, dtype=dtype, generator=g)
        k = torch.randn(1, G, keys, d_qk, device=device, dtype=dtype, generator=g)
        v = torch.randn(1, G, keys, d_v, device=device, dtype=dtype, generator=g)
        if pad and not backend.startswith("prefix:"):  # prefix_attention pads V itself
            v = F.pad(v, (0, d_qk - d_v))
        if not gqa:
            k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
        attn_mask = causal_lower_right(T, keys) if mask == "lower_right" else None

        def call():
            if backend.startswith("prefix:"):
                return prefix_attention(q, k, v, d_qk ** -0.5, keys - T, pad_values=pad,
                                        backend=backend.removeprefix("prefix:"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=mask == "causal",
                                                  enable_gqa=gqa)

        switch = contextlib.nullcontext() if backend.startswith("prefix:") else sdpa_kernel([BACKENDS[backend]])
        with switch, torch.inference_mode():
            call()  # warm-up (and the back end's refusal, if any)
            times = call_times(call, repeats, cuda=device == "cuda")
            if device == "cuda":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    call()
                    torch.cuda.synchronize()
                kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                if kernels:
                    rec["kernel"] = max(kernels, key=lambda e: e.time_range.elapsed_us()).name[:160]
        secs = statistics.median(times)
        rec.update(time_s=secs, tflop_per_s=rec["attention_flops"] / secs / 1e12, status="ok")
    except torch.OutOfMemoryError as exc:
        rec.update(status="oom", error=(str(exc).strip().splitlines() or ["OutOfMemoryError"])[0][:300])
    except RuntimeError as exc:  # a back end that refuses these inputs says so in a RuntimeError
        rec.update(status="unsupported", error=str(exc).strip().splitlines()[0][:300])
    finally:
        q = k = v = None
        if device == "cuda":
            torch.cuda.empty_cache()
    return rec


def mla_shape(recipe: str) -> dict:
    """{"H", "G", "d_qk", "d_v"} of a recipe's MLA layers (query heads, key/value heads, q/k and value head dims)."""
    from hylo_bench.config.recipes import load_recipe, recipe_hybrid_config

    cfg = recipe_hybrid_config(load_recipe(recipe))
    return {"H": cfg.num_attention_heads, "G": cfg.num_key_value_heads,
            "d_qk": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, "d_v": cfg.v_head_dim}


def main(argv: list[str] | None = None) -> None:
    from hylo_bench.config.units import parse_length

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", default="16k", help="prefill chunk T (query tokens)")
    ap.add_argument("--contexts", default="64k,2m", help="S: tokens cached after the chunk, comma-separated")
    ap.add_argument("--recipe", default="HyLo-Qwen-7MLA21GDN-8K-SFT", help="the MLA shapes come from this recipe")
    ap.add_argument("--backends", default="flash,efficient,cudnn,prefix:sdpa,prefix:cudnn_split")
    ap.add_argument("--masks", default="lower_right,none,causal")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=300.0, help="stop starting new points after this")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_backends.json")
    args = ap.parse_args(argv)
    shape = mla_shape(args.recipe)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    T = 16 if args.tiny else parse_length(args.chunk)
    contexts = [64] if args.tiny else [parse_length(c) for c in args.contexts.split(",")]
    backends = ["math", "prefix:sdpa"] if args.tiny else args.backends.split(",")
    if args.tiny:
        shape = {"H": 4, "G": 2, "d_qk": 24, "d_v": 16}
    doc = result_envelope("attention_backends")
    doc.update(shape=shape, chunk=T, tiny=args.tiny)
    t0 = time.monotonic()
    masks = args.masks.split(",")
    pads = (False, True) if shape["d_v"] < shape["d_qk"] else (False,)
    variants = [(gqa, pad) for gqa in (True, False) for pad in pads]
    for S in contexts:
        for mask in masks:
            for backend in backends:
                for gqa, pad in variants:
                    if mask == "lower_right" and backend not in ("flash", "efficient", "math", "prefix:sdpa",
                                                                 "prefix:cudnn_split"):
                        continue  # CausalBias dispatches to flash / memory-efficient itself
                    if backend.startswith("prefix:") and (mask != "lower_right" or not gqa):
                        continue  # the engine's function: its own mask, GQA as the engine calls it
                    if time.monotonic() - t0 > args.max_seconds:
                        rec = {"benchmark": "attention_backends", "backend": backend, "mask": mask, "gqa": gqa,
                               "pad_values": pad, "seq_len": S, "chunk": T, "status": "skipped",
                               "error": f"--max-seconds {args.max_seconds:.0f} reached"}
                    else:
                        rec = run_point(backend, mask, gqa, pad, T, S, shape, device, dtype, args.repeats)
                    doc["records"].append(rec)
                    write_result(args.out, doc)
                    print({k: rec.get(k) for k in ("backend", "mask", "gqa", "pad_values", "seq_len", "time_s",
                                                    "tflop_per_s", "status")}, flush=True)


if __name__ == "__main__":
    main()
