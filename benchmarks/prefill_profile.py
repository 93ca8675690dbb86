"""Where a long prefill's time goes in the native engine: the Qwen3-1.7B-shaped HyLo 7MLA21GDN
(``HyLo-Qwen-7MLA21GDN-8K-SFT``, random bf16 weights of the real shapes) on one GPU.

Records (benchmark format, ``benchmarks/results/prefill_profile.json``, rewritten after every point):

- ``benchmark: prefill_profile``, one per (variant, ``engine_batch``): a full chunked prefill of ``seq_len``
  random tokens into batch row 0 (``Engine.prefill_row``, the continuous-batching path) of an engine with
  ``engine_batch`` slots, timed twice after a warm-up (``ttft_s``: the second), then once under
  ``torch.profiler``: device seconds by kernel category (``attention_s``: SDPA kernels; ``gdn_s``: fla's chunked
  GDN kernels and our convolutions; ``matmul_s``; ``elementwise_s``; ``other_s``), and the MLA prefill's
  attention FLOPs (``prefill_attention_flops``, :func:`hylo_bench.serving.sweep_worker.prefill_attention_flops`) over
  its measured seconds (``attention_tflop_per_s``).
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
    """Run ``fn`` once under torch.profiler: (seconds by category, top 15 kernels by device seconds)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rec = {f"{cat}_s": 0.0 for cat, _ in CATEGORIES} | {"other_s": 0.0}
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = e.time_range.elapsed_us() / 1e6
            rec[f"{category(e.name)}_s"] += t
            by_name[e.name] = by_name.get(e.name, 0.0) + t
    rec["kernel_time_s"] = sum(by_name.values())
    return rec, sorted(by_name.items(), key=lambda kv: -kv[1])[:15]


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-seconds", type=float, default=400.0)
    ap.add_argument("--context", default="64k")
    ap.add_argument("--engine-batches", default="1,8", help="Engine slots per point (prefill into row 0).")
    ap.add_argument("--variants", default="cudnn_split,sdpa", help="prefill attention back ends, comma-separated")
    ap.add_argument("--prefill-chunk", default="16k")
    ap.add_argument("--long", default="2m", help="Context of the chunk-estimate records ('' = none).")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefill_profile.json")
    args = ap.parse_args(argv)
    from hylo_bench.config.units import parse_length
    from hylo_bench.decode.engine import Engine
    from hylo_bench.serving.sweep_worker import prefill_attention_flops

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    T, chunk = parse_length(args.context), parse_length(args.prefill_chunk)
    long_T = parse_length(args.long) if args.long else 0
    if args.tiny:
        T, chunk, long_T = 96, 32, 192
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
            rec = {"benchmark": "prefill_profile", "layout": info["layout"], "variant": variant, "seq_len": T,
                   "batch_size": 1, "engine_batch": nb, "prefill_chunk": chunk}
            if run.left() < 30 and not args.tiny:
                run.add(rec | {"status": "skipped", "error": f"{run.left():.0f} s left"})
                continue
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
            run.add(rec)
            engine = None
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
