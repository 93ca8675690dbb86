"""What a RULER-style stream of prompts costs per prefill: prompts of slightly different lengths (as RULER's
samples are) through ``Engine.prefill_row`` of the Qwen3-1.7B-shaped HyLo 7MLA21GDN (random bf16 weights), per
prefill chunk size, a 64K prefill per layer-glue back end, and which torch ops the element-wise time of one prefill
belongs to.

A new prompt length gives the last prefill chunk a new shape; cuDNN attention builds one execution graph per
shape (``hylo_bench.kernels.prefix_attention``), so a length seen for the first time can cost more than a repeat.

Records (benchmark format, ``benchmarks/results/prefill_shapes.json``, rewritten after every record):

- ``benchmark: prefill_shapes``: one per timed prefill: ``seq_len`` (prompt tokens), ``prefill_chunk``,
  ``query_bucket`` (cuDNN's queries padded to a multiple of it; ``--query-buckets``), ``new_length`` (this length
  had not been prefilled before by this engine), ``ttft_s`` (the prefill, synchronised),
  ``order`` (its place in the stream).
- ``benchmark: prefill_glue``: one 64K prefill (``--ops-chunk``) per layer-glue back end (``--glue``, default
  ``torch,fla``: ``Engine(layer_glue_backend=...)``, :mod:`hylo_bench.kernels.layer_glue`), the median of three
  after a warm-up: ``layer_glue``, ``ttft_s``.
- ``benchmark: prefill_ops``: the ``--top`` torch ops by device time of one prefill (``--ops-chunk``), each with
  its input shapes: ``op``, ``input_shapes``, ``device_s``, ``calls``.

Usage (H200, about 2 minutes): ``python benchmarks/prefill_shapes.py --out $OUT/prefill_shapes.json``
CPU check of the logic (tiny model, seconds): ``python benchmarks/prefill_shapes.py --tiny --out /tmp/s.json``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope
from batched_decode import Run, _error, _ints, build, free
from prefill_profile import timed

# prompt lengths of one RULER task's samples at 64K with the demo tokenizer (niah_single_1, 6 samples), then
# repeats and two more new lengths
LENGTHS_64K = (65242, 65238, 65239, 65241, 65245, 65242, 65238, 65363, 65127, 65242)


def top_ops(fn, top: int) -> list[dict]:
    """Run ``fn`` once under torch.profiler with input shapes; the ``top`` (op, shapes) by self device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        dev_us = getattr(ev, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "self_cuda_time_total", 0.0)
        rows.append({"op": ev.key, "input_shapes": str(ev.input_shapes)[:200], "device_s": dev_us / 1e6,
                     "calls": ev.count})
    rows.sort(key=lambda r: -r["device_s"])
    return rows[:top]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-seconds", type=float, default=200.0)
    ap.add_argument("--chunks", default="8192,16384,32768", help="prefill chunk sizes (tokens), comma-separated")
    ap.add_argument("--query-buckets", default="",
                    help="cuDNN query buckets to stream each chunk size with, comma-separated (prefix_attention."
                         "CUDNN_QUERY_BUCKET; 1 = no padding; '' = the default only)")
    ap.add_argument("--ops-chunk", type=int, default=16384, help="chunk of the profiled prefill (0: none)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--glue", default="torch,fla", help="layer-glue back ends to time ('' = none)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefill_shapes.json")
    args = ap.parse_args(argv)
    from hylo_bench.decode.engine import Engine

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    lengths = tuple(n // 512 for n in LENGTHS_64K) if args.tiny else LENGTHS_64K
    chunks = [32, 64] if args.tiny else _ints(args.chunks)
    env = result_envelope("prefill_shapes")
    env.update(tiny=args.tiny, lengths=list(lengths))
    run = Run(args.out, args.max_seconds, env)
    model, info = build(device, dtype, args.tiny)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, max(lengths)), generator=gen)

    def prefill_s(engine, n: int) -> float:
        return timed(lambda: engine.prefill_row(0, ids[:, :n]), device)

    from hylo_bench.kernels import prefix_attention

    buckets = _ints(args.query_buckets) if args.query_buckets else [prefix_attention.CUDNN_QUERY_BUCKET]
    default_bucket = prefix_attention.CUDNN_QUERY_BUCKET
    with torch.inference_mode():
        for chunk, bucket in ((c, b) for c in chunks for b in buckets):
            # new_length is per stream (a fresh engine each); torch's cuDNN graph cache is per process, so a later
            # stream may reuse graphs an earlier one built for the same shapes and strides
            prefix_attention.CUDNN_QUERY_BUCKET = bucket
            base = {"benchmark": "prefill_shapes", "layout": info["layout"], "batch_size": 1, "prefill_chunk": chunk,
                    "query_bucket": bucket}
            if run.left() < 20 and not args.tiny:
                run.add(base | {"status": "skipped", "error": f"{run.left():.0f} s left"})
                continue
            try:
                engine = Engine(model, 1, max(lengths) + 8, chunk)
                engine.prefill_row(0, ids[:, : 2 * chunk + 1])  # kernel compiles (not a stream length)
                seen: set[int] = set()
                for order, n in enumerate(lengths):
                    rec = base | {"seq_len": n, "order": order, "new_length": n not in seen}
                    seen.add(n)
                    run.add(rec | {"ttft_s": prefill_s(engine, n), "status": "ok"})
            except Exception as exc:  # noqa: BLE001 - record and go on
                run.add(_error(base, exc))
            engine = None
            free()
        prefix_attention.CUDNN_QUERY_BUCKET = default_bucket
        glues = ["torch"] if args.tiny else [g for g in args.glue.split(",") if g]
        for glue in glues if args.ops_chunk else []:
            chunk = 32 if args.tiny else args.ops_chunk
            base = {"benchmark": "prefill_glue", "layout": info["layout"], "batch_size": 1, "prefill_chunk": chunk,
                    "seq_len": lengths[0], "layer_glue": glue}
            if run.left() < 20 and not args.tiny:
                run.add(base | {"status": "skipped", "error": f"{run.left():.0f} s left"})
                continue
            try:
                engine = Engine(model, 1, max(lengths) + 8, chunk, layer_glue_backend=glue)
                engine.prefill_row(0, ids[:, : lengths[0]])
                times = sorted(prefill_s(engine, lengths[0]) for _ in range(3))
                run.add(base | {"ttft_s": times[1], "status": "ok"})
            except Exception as exc:  # noqa: BLE001 - record and go on
                run.add(_error(base, exc))
            engine = None
            free()
        if args.ops_chunk and (run.left() > 20 or args.tiny):
            chunk = 32 if args.tiny else args.ops_chunk
            engine = Engine(model, 1, max(lengths) + 8, chunk)
            engine.prefill_row(0, ids[:, : lengths[0]])
            for row in top_ops(lambda: engine.prefill_row(0, ids[:, : lengths[0]]), args.top):
                run.add({"benchmark": "prefill_ops", "layout": info["layout"], "seq_len": lengths[0],
                         "prefill_chunk": chunk, "status": "ok"} | row)
    env["finished"] = True
    run.save()


if __name__ == "__main__":
    main()
