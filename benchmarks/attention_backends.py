"""Which SDPA kernel the MLA prefill should run: one prefill chunk's attention at the 7MLA21GDN shapes
(16 query heads, 8 key/value heads, d_qk = 192, d_V = 128, bf16) over a cached prefix, per SDPA back end.

The chunked prefill (:func:`hylo_bench.models.attention.prefix_causal_attention`) attends T chunk queries over
S = start + T keys with a lower-right causal mask; at 2M tokens this is most of the TTFT (issue 22: at most 250 s
needs about 630 TFLOP/s on this attention). Each point times ``F.scaled_dot_product_attention`` under
``torch.nn.attention.sdpa_kernel([backend])`` (the public back-end switch) for:

- ``mask``: ``lower_right`` (the engine's call: torch's ``CausalBias``, which picks its own kernel among flash
  and memory-efficient, so it is timed under those two only), ``none`` (the chunk over the prefix only, S - T
  keys: the part of a split prefill that needs no mask) or ``causal`` (the chunk over itself, T keys);
- ``gqa``: ``enable_gqa=True`` or K/V heads repeated to 16;
- ``pad_values``: V zero-padded to d_qk or not.

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
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result  # noqa: E402

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
        if pad:
            v = F.pad(v, (0, d_qk - d_v))
        if not gqa:
            k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
        attn_mask = causal_lower_right(T, keys) if mask == "lower_right" else None

        def call():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=mask == "causal",
                                                  enable_gqa=gqa)

        times = []
        with sdpa_kernel([BACKENDS[backend]]), torch.inference_mode():
            call()  # warm-up (and the back end's refusal, if any)
            for _ in range(repeats):
                if device == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    call()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
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


def main(argv: list[str] | None = None) -> None:
    from hylo_bench.config.units import parse_length

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", default="16k", help="prefill chunk T (query tokens)")
    ap.add_argument("--contexts", default="64k,2m", help="S: tokens cached after the chunk, comma-separated")
    ap.add_argument("--backends", default="flash,efficient,cudnn")
    ap.add_argument("--masks", default="lower_right,none,causal")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=300.0, help="stop starting new points after this")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "attention_backends.json")
    args = ap.parse_args(argv)
    shape = {"H": 16, "G": 8, "d_qk": 192, "d_v": 128}
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    T = 16 if args.tiny else parse_length(args.chunk)
    contexts = [64] if args.tiny else [parse_length(c) for c in args.contexts.split(",")]
    backends = ["math"] if args.tiny else args.backends.split(",")
    if args.tiny:
        shape = {"H": 4, "G": 2, "d_qk": 24, "d_v": 16}
    doc = result_envelope("attention_backends")
    doc.update(shape=shape, chunk=T, tiny=args.tiny)
    t0 = time.monotonic()
    masks = args.masks.split(",")
    variants = [(gqa, pad) for gqa in (True, False) for pad in (False, True)]
    for S in contexts:
        for mask in masks:
            for backend in backends:
                for gqa, pad in variants:
                    if mask == "lower_right" and backend not in ("flash", "efficient", "math"):
                        continue  # CausalBias dispatches to flash / memory-efficient itself
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
