"""Tune the batch-1 decode GEMV's configuration inside the decode step it runs in, not alone.

The row-block GEMV (:mod:`hylo_bench.kernels.gemv.triton_kernel`) is autotuned on its first call per shape by timing
one launch at a time. Inside the decode step's CUDA graph each GEMV overlaps its neighbours (programmatic dependent
launch: it loads its first weight tiles while the kernel before it drains), so the fastest config alone need not be
the fastest in the chain. This script builds the Qwen3-1.7B-shaped 7MLA21GDN engine (random bf16 weights, CUDA
graphs, ``torch.compile``) at one context, then for each GEMV shape the step uses (largest first) tries every
config of the kernel's list with the other shapes held at their current best, timing the whole step (median TPOT
of ``--steps`` graph replays; every trial is recorded under ``trials``); a second pass repeats the descent from the
first pass's result. It then times the standalone-autotuned configs, the step-tuned ones and the table the package
ships, interleaved.

Records (``benchmarks/results/gemv_step_tune.json``): ``kind: gemv_shape`` per shape (its key, weight bytes, the
standalone and the step-tuned config as ``standalone_BLOCK_N`` ... ``step_tuned_num_warps``); ``kind: decode``
for the A/B rounds (``variant`` ``standalone`` | ``step_tuned`` | ``shipped_table``, ``tpot_s``, ``bound_tpot_s``,
``fraction_of_bound``).
``--table`` writes the step-tuned configs in the format of ``hylo_bench/kernels/gemv/tuned/<device>.json``.

Usage (one H200, about 6 minutes)::

    source .gpu-bundle/install.sh && python3 benchmarks/gemv_step_tune.py --out $OUT/gemv_step_tune.json \\
        --table $OUT/NVIDIA_H200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result
from batched_decode import build

from hylo_bench.io_utils import atomic_write_text
from hylo_bench.kernels.gemv.tuned import CONFIG_FIELDS, KEY_FIELDS
from hylo_bench.serving.bound import copy_bandwidth, decode_step_bytes


def config_dict(cfg) -> dict:
    """A Triton config as the tuned-table entry's fields (``CONFIG_FIELDS``)."""
    return {**cfg.kwargs, "num_warps": cfg.num_warps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=60, help="timed graph replays per trial (median)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--ab-rounds", type=int, default=4)
    ap.add_argument("--max-seconds", type=float, default=480.0, help="stop the descent after this long")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gemv_step_tune.json")
    ap.add_argument("--table", type=Path, default=None)
    args = ap.parse_args()
    t_start = time.monotonic()

    import json

    from hylo_bench.decode.engine import Engine
    from hylo_bench.kernels.gemv import triton_kernel as tk

    tk.USE_TUNED = False  # the descent sets the autotuner's per-shape picks; the shipped table is one A/B variant
    device, dtype = "cuda", torch.bfloat16
    env = result_envelope("gemv_step_tune")
    model, info = build(device, dtype, False)
    bw, _ = copy_bandwidth(device)
    T = args.context
    nbytes = decode_step_bytes(model, 1, T)["total"]
    env.update(model=info["name"], layout=info["layout"], copy_bandwidth_gb_per_s=bw / 1e9, seq_len=T)
    engine = Engine(model, 1, T + 4 * args.steps + 16, 8192, cuda_graphs=True, compile=True)

    def tpot(steps: int = args.steps) -> float:
        engine._graphs.clear()  # recapture: the launches recorded in the graph carry the configs
        return engine.decode_benchmark(1, T, steps).tpot_s

    kern = tk._fused_gemv_kernel
    base = tpot()
    keys = sorted(kern.cache, key=lambda k: -k[kern.keys.index("N")] * k[kern.keys.index("K")])
    standalone = {k: kern.cache[k] for k in keys}
    print(f"baseline {base * 1e3:.4f} ms, {len(keys)} GEMV shapes: "
          + ", ".join(f"{k[kern.keys.index('N')]}x{k[kern.keys.index('K')]}" for k in keys), flush=True)
    best_t = base
    trials = 0
    for p in range(args.passes):
        for key in keys:
            group = key[kern.keys.index("GROUP")]
            cands = [c for c in kern.configs if c.kwargs["BLOCK_K"] >= group]
            keep = kern.cache[key]
            for cfg in cands:
                if time.monotonic() - t_start > args.max_seconds:
                    break
                kern.cache[key] = cfg
                t = tpot()
                trials += 1
                env.setdefault("trials", []).append({"pass": p, "N": key[kern.keys.index("N")],
                                                     "K": key[kern.keys.index("K")], **config_dict(cfg),
                                                     "tpot_s": t})
                if t < best_t * 0.998:
                    best_t, keep = t, cfg
            kern.cache[key] = keep
            env.setdefault("descent", []).append({"pass": p, "key": [str(v) for v in key], "config": config_dict(keep),
                                                  "tpot_s": best_t, "trials": trials})
            write_result(args.out, env)
            print(f"pass {p} {key[:6]}: {config_dict(keep)} -> {best_t * 1e3:.4f} ms ({trials} trials, "
                  f"{time.monotonic() - t_start:.0f} s)", flush=True)
    tuned = {k: kern.cache[k] for k in keys}

    for key in keys:
        field = dict(zip(kern.keys, key))
        kern.cache[key] = standalone[key]
        env["records"].append({"kind": "gemv_shape", **{k: field[k] for k in KEY_FIELDS + ("PDL",)},
                               "weight_bytes": field["N"] * field["K"] * 2,
                               **{f"standalone_{k}": v for k, v in config_dict(standalone[key]).items()},
                               **{f"step_tuned_{k}": v for k, v in config_dict(tuned[key]).items()},
                               "status": "ok"})
    # interleaved A/B with more steps: standalone-autotuned table vs step-tuned table
    for r in range(args.ab_rounds):
        for variant, table in (("standalone", standalone), ("step_tuned", tuned), ("shipped_table", standalone)):
            for k in keys:
                kern.cache[k] = table[k]
            tk.USE_TUNED = variant == "shipped_table"  # hylo_bench/kernels/gemv/tuned/<device>.json
            t = tpot(4 * args.steps)
            env["records"].append({"kind": "decode", "variant": variant, "round": r, "seq_len": T, "batch_size": 1,
                                   "tpot_s": t, "tokens_per_s": 1 / t, "bytes_per_step": nbytes,
                                   "bound_tpot_s": nbytes / bw, "fraction_of_bound": nbytes / bw / t,
                                   "status": "ok"})
            print(env["records"][-1], flush=True)
            write_result(args.out, env)
    dec = [r for r in env["records"] if r["kind"] == "decode"]
    env["summary"] = {v: statistics.median(r["fraction_of_bound"] for r in dec if r["variant"] == v)
                      for v in ("standalone", "step_tuned", "shipped_table")}
    env.update(baseline_tpot_s=base, descent_trials=trials, elapsed_s=time.monotonic() - t_start)
    write_result(args.out, env)
    print(env["summary"], flush=True)
    if args.table:
        entries = [{k: r[k] for k in KEY_FIELDS} | {k: r[f"step_tuned_{k}"] for k in CONFIG_FIELDS}
                   for r in env["records"] if r["kind"] == "gemv_shape"]
        table = {"device": torch.cuda.get_device_name(0), "source": f"benchmarks/gemv_step_tune.py at git "
                 f"{env['git_sha']}, {info['layout']} at {T} tokens",
                 "rowblock": entries}
        atomic_write_text(args.table, json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
