"""Where a long prefill's time goes in the native engine: the Qwen3-1.7B-shaped HyLo 7MLA21GDN
(``HyLo-Qwen-7MLA21GDN-8K-SFT``, random bf16 weights of the real shapes) on one GPU.

Records (benchmark format, ``benchmarks/results/prefill_profile.json``, rewritten after every point):

- ``benchmark: prefill_profile``, one per (variant, ``engine_batch``, ``prefill_chunk``): a full chunked prefill of
  ``seq_len``
  random tokens into batch row 0 (``Engine.prefill_row``, the continuous-batching path) of an engine with
  ``engine_batch`` slots, timed twice after a warm-up (``ttft_s``: the second), then once under
  ``torch.profiler``: device seconds by kernel category (``attention_s``: SDPA kernels; ``gdn_s``: fla's chunked
  GDN kernels and our convolutions; ``matmul_s``; ``elementwise_s``; ``other_s``), and the MLA prefill's
  attention FLOPs (``prefill_attention_flops``, :func:`hylo_bench.serving.sweep_worker.prefill_attention_flops`) over
  its measured seconds (``attention_tflop_per_s``); and the device's idle time inside the prefill (``gpu_busy_s``,
  ``gpu_span_s``, ``gpu_idle_s``, ``idle_gaps``: :func:`device_idle`).
  Variants: the chunked-prefill attention back end (``cudnn_split``, ``sdpa``: kernels.md §10.1), set through
  ``$HYLO_BENCH_PREFIX_ATTENTION_BACKEND`` for the point; the kernel table says which attention kernel ran.
- ``benchmark: prefill_chunk_estimate``: per variant, the first and last chunk of a ``--long`` prefill (2M by
  default) timed over a synthetic cache: ``ttft_estimated_s`` = chunks x (first + last) / 2 (chunk cost grows
  linearly with the offset), ``mode: estimated``.

Usage (H200, about 4 minutes): ``python benchmarks/prefill_profile.py --max-seconds 400``
CPU check of the logic (tiny model, seconds): ``python benchmarks/prefill_profile.py --tiny --out /tmp/p.json``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope
from batched_decode import Run, _error, _ints, build, free

CATEGORIES = (("attention", ("flash", "fmha", "attention", "efficient", "sdpa")),
              ("gdn", ("chunk", "gated_delta", "fused_recurrent", "causal_conv", "conv1d", "l2norm", "cumsum",
                       "solve_tril", "wy_fast", "fwd_kernel")),
              ("matmul", ("gemm", "gemv", "sm90", "xmma", "cutlass", "nvjet", "splitk", "_mm_", "cublas")),
              ("elementwise", ("elementwise", "vectorized", "reduce", "triton_poi", "triton_red", "copy", "cat")))


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_once(fn) -> tuple[dict, list[tuple[str, float]]]:
    """Run ``fn`` once under torch.profiler: (seconds by category plus the device's idle time, top 15 kernels by
    device seconds). ``kernel_time_s`` sums the kernels; ``gpu_busy_s`` is the union of their intervals,
    ``gpu_span_s`` the first kernel's start to the last one's end and ``gpu_idle_s`` the span not covered by any
    kernel: time the device waited for the host (launch overhead, host synchronisation). ``idle_gaps`` names the
    host ops that ran during the longest idle intervals."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rec = {f"{cat}_s": 0.0 for cat, _ in CATEGORIES} | {"other_s": 0.0}
    by_name: dict[str, float] = {}
    kernels, host = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = e.time_range.elapsed_us() / 1e6
            rec[f"{category(e.name)}_s"] += t
            by_name[e.name] = by_name.get(e.name, 0.0) + t
            kernels.append((e.time_range.start, e.time_range.end))
        else:
            host.append((e.time_range.start, e.time_range.end, e.name))
    rec["kernel_time_s"] = sum(by_name.values())
    rec.update(device_idle(kernels, host))
    return rec, sorted(by_name.items(), key=lambda kv: -kv[1])[:15]


def device_idle(kernels: list[tuple[float, float]], host: list[tuple[float, float, str]], top: int = 8) -> dict:
    """Busy time (union of the kernel intervals), span and idle time of the device, in seconds, from profiler
    intervals in microseconds; ``idle_gaps``: the ``top`` longest idle intervals, each with the three host ops
    (no longer than four times the gap, so not the whole prefill's outer calls) that overlap it most: what the host
    was doing while the device waited."""
    if not kernels:
        return {"gpu_busy_s": 0.0, "gpu_span_s": 0.0, "gpu_idle_s": 0.0, "idle_gaps_over_50us": 0,
                "idle_in_gaps_over_50us_s": 0.0, "idle_gaps": ""}
    kernels = sorted(kernels)
    busy, gaps = 0.0, []
    cur_start, cur_end = kernels[0]
    for start, end in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_end, start))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = cur_end - kernels[0][0]
    described = []
    for dur, g0, g1 in sorted(gaps, reverse=True)[:top]:
        inside = [(min(h1, g1) - max(h0, g0), h1 - h0, name) for h0, h1, name in host if h0 < g1 and h1 > g0]
        inner = sorted((o, name) for o, length, name in inside if length <= 4 * dur)[-3:]
        described.append(f"{dur:.0f}us:" + "|".join(name[:40] for _, name in reversed(inner)))
    return {"gpu_busy_s": busy / 1e6, "gpu_span_s": span / 1e6, "gpu_idle_s": (span - busy) / 1e6,
            "idle_gaps_over_50us": sum(1 for d, _, _ in gaps if d > 50),
            "idle_in_gaps_over_50us_s": sum(d for d, _, _ in gaps if d > 50) / 1e6,
            "idle_gaps": "; ".join(described)}


PREFIX_ENV = "HYLO_BENCH_PREFIX_ATTENTION_BACKEND"  # hylo_bench.kernels.prefix_attention.CHOICE.env


def set_variant(variant: str) -> None:
    """Route the MLA prefill's attention to back end ``variant`` (the registry's environment override)."""
    os.environ[PREFIX_ENV] = variant


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def prefill_point(run: Run, model, info: dict, ids: torch.Tensor, variant: str, nb: int, chunk: int, flops: float,
                  device: str, tiny: bool) -> dict:
    """One ``prefill_profile`` record: a full prefill of ``ids`` into row 0 of an ``nb``-slot engine at ``chunk``
    tokens per chunk, timed twice after a warm-up, then profiled once (CUDA)."""
    from hylo_bench.decode.engine import Engine

    T = ids.shape[1]
    rec = {"benchmark": "prefill_profile", "layout": info["layout"], "variant": variant, "seq_len": T,
           "batch_size": 1, "engine_batch": nb, "prefill_chunk": chunk}
    if run.left() < 30 and not tiny:
        return rec | {"status": "skipped", "error": f"{run.left():.0f} s left"}
    try:
        engine = Engine(model, nb, T + 8, chunk)
        set_variant(variant)
        with torch.inference_mode():
            engine.prefill_row(0, ids[:, : min(T, 2 * chunk)])  # kernel compiles
            first = timed(lambda: engine.prefill_row(0, ids), device)
            ttft = timed(lambda: engine.prefill_row(0, ids), device)
            rec.update(first_run_s=first, ttft_s=ttft, prefill_tokens_per_s=T / ttft,
                       prefill_attention_flops=flops, status="ok")
            if device == "cuda":
                cats, top = profile_once(lambda: engine.prefill_row(0, ids))
                rec.update(cats, attention_tflop_per_s=flops / cats["attention_s"] / 1e12
                           if cats["attention_s"] else None)
                rec["top_kernels"] = "; ".join(f"{n[:80]}={t * 1e3:.1f}ms" for n, t in top)
    except Exception as exc:  # noqa: BLE001 - record and go on
        rec = _error(rec, exc)
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-seconds", type=float, default=400.0)
    ap.add_argument("--context", default="64k")
    ap.add_argument("--engine-batches", default="1,8", help="Engine slots per point (prefill into row 0).")
    ap.add_argument("--variants", default="cudnn_split,sdpa", help="prefill attention back ends, comma-separated")
    ap.add_argument("--prefill-chunk", default="16k", help="tokens per prefill chunk; several: comma-separated")
    ap.add_argument("--long", default="2m", help="Context of the chunk-estimate records ('' = none).")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefill_profile.json")
    args = ap.parse_args(argv)
    from hylo_bench.config.units import parse_length
    from hylo_bench.decode.engine import Engine
    from hylo_bench.serving.sweep_worker import prefill_attention_flops

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    T = parse_length(args.context)
    chunks = [parse_length(c) for c in args.prefill_chunk.split(",")]
    chunk = chunks[0]
    long_T = parse_length(args.long) if args.long else 0
    if args.tiny:
        T, long_T = 96, 192
        chunks = [min(c, 32) for c in chunks]
        chunk = chunks[0]
    env = result_envelope("prefill_profile")
    env.update(seq_len=T, prefill_chunk=chunk, tiny=args.tiny)
    run = Run(args.out, args.max_seconds, env)
    model, info = build(device, dtype, args.tiny)
    cfg = model.config
    flops = prefill_attention_flops(cfg, 1, T)
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    variants = ["sdpa"] if args.tiny else args.variants.split(",")  # cuDNN needs CUDA
    for variant in variants:
        for nb in _ints(args.engine_batches):
            for chunk in chunks:
                run.add(prefill_point(run, model, info, ids, variant, nb, chunk, flops, device, args.tiny))
                free()
    for variant in variants if long_T else []:
        rec = {"benchmark": "prefill_chunk_estimate", "layout": info["layout"], "variant": variant,
               "seq_len": long_T, "batch_size": 1, "prefill_chunk": chunk, "mode": "estimated"}
        if run.left() < 40 and not args.tiny:
            run.add(rec | {"status": "skipped", "error": f"{run.left():.0f} s left"})
            continue
        try:
            engine = Engine(model, 1, long_T + 8, chunk)
            set_variant(variant)
            engine.time_prefill_chunk(1, 0, chunk)
            first = engine.time_prefill_chunk(1, 0, chunk)
            last = engine.time_prefill_chunk(1, long_T - chunk, chunk)
            n = -(-long_T // chunk)
            rec.update(first_chunk_s=first, last_chunk_s=last, prefill_chunks=n,
                       ttft_estimated_s=n * (first + last) / 2,
                       prefill_attention_flops=prefill_attention_flops(cfg, 1, long_T), status="ok")
        except Exception as exc:  # noqa: BLE001
            rec = _error(rec, exc)
        run.add(rec)
        engine = None
        free()
    os.environ.pop(PREFIX_ENV, None)
    env["finished"] = True
    run.save()


if __name__ == "__main__":
    main()
