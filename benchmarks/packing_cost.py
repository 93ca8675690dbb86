"""Cost of document boundaries in training: student forward + backward on packed rows, with and without cu_seqlens.

A Qwen3-1.7B-shaped 7MLA21GDN student (random bf16 weights, activation checkpointing), one row of ``--seq-len``
tokens split into documents of a given mean length (uniform random cut points, seed 0). Records per point:
``seq_len``, ``docs``, ``mode`` ("plain": causal over the whole row; "packed": cu_seqlens), ``step_s``,
``tokens_per_s``, ``peak_memory_gib``, ``status``. Writes ``benchmarks/results/packing_cost.json``.

Device command (``.gpu-bundle`` from ``../shared/tools/make-gpu-bundle.sh``)::

    source .gpu-bundle/install.sh && python3 benchmarks/packing_cost.py && \\
      cp benchmarks/results/packing_cost.json $OUT/
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result

from hylo_bench.config.recipes import load_recipe, recipe_hybrid_config
from hylo_bench.models.hybrid import HyLoForCausalLM


def _step(model, ids, cu, reps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = model.model(input_ids=ids, cu_seqlens=cu).last_hidden_state
        out.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--mean-doc", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "packing_cost.json"))
    args = ap.parse_args()
    res = result_envelope("packing_cost")
    cfg = recipe_hybrid_config(load_recipe("HyLo-Qwen-7MLA21GDN-8K-SFT"))
    model = HyLoForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    model.model.gradient_checkpointing = True
    T = args.seq_len
    ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    gen = torch.Generator().manual_seed(0)
    points = [("plain", 1, None)]
    for mean in args.mean_doc:
        n = max(1, T // mean)
        cuts = sorted(torch.randperm(T - 1, generator=gen)[: n - 1].add(1).tolist())
        points.append(("packed", n, torch.tensor([0, *cuts, T], dtype=torch.int32, device="cuda")))
    _step(model, ids, None, 1)  # warm-up (kernel autotune, allocator)
    for mode, docs, cu in points:
        torch.cuda.reset_peak_memory_stats()
        rec = {"seq_len": T, "docs": docs, "mode": mode, "n_gpus": 1}
        try:
            s = _step(model, ids, cu, args.reps)
            rec |= {"step_s": s, "tokens_per_s": T / s, "status": "ok"}
        except Exception as e:  # noqa: BLE001 - record the failure and keep going
            rec |= {"status": f"error: {e!r}"[:300]}
        rec["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        res["records"].append(rec)
        print(rec, flush=True)
        write_result(Path(args.out), res)


if __name__ == "__main__":
    main()
