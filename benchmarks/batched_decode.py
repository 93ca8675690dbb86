"""Batched decode and continuous-batching throughput of the native engine on one GPU: the Qwen3-1.7B-shaped
HyLo 7MLA21GDN (``HyLo-Qwen-7MLA21GDN-8K-SFT``, random bf16 weights of the real shapes, as serving_sweep.py builds
it) at 64K tokens per sequence.

Records (benchmark format, ``benchmarks/results/batched_decode.json``, rewritten after every point):

- ``benchmark: batched_decode``, one per batch size (default 1, 8, 32): decode after a synthetic 64K context per
  sequence (caches filled with random values; the decode cost does not depend on them) through
  ``Engine.decode_benchmark`` with CUDA graphs: ``tpot_s`` (median step), ``tokens_per_s``, the step's bandwidth
  bound ``bound_tpot_s`` and ``fraction_of_bound`` (:mod:`hylo_bench.serving.bound`: weights once + each
  sequence's MLA latent rows and 2x its GDN state, over the copy bandwidth, 4.30e12 B/s on an H200), ``mode:
  estimated``, ``setup_s`` (engine allocation, Triton compiles, CUDA-graph capture).
- ``benchmark: batched_decode_prefill``: the batch-1 prefill estimated from its first and last chunk (chunk cost
  grows linearly with the offset: n_chunks * (first + last) / 2), copied into the decode records' ``ttft_s``
  (under continuous batching each request's prefill runs alone). Measured after the decode points, so a slow
  first prefill (fla kernel compiles) cannot cost them.
- ``benchmark: ruler_continuous_batching``, one per batch size (default 8, then 1): RULER-shaped requests (random
  token prompts of 90-100 % of the context, ``--ruler-new-tokens`` greedy tokens each; random weights never stop
  early) through :func:`hylo_bench.decode.batching.continuous_generate` (slots refilled as requests finish):
  ``samples_per_s``, ``tokens_per_s``, prefill and decode seconds.

- ``benchmark: batched_decode_parity``: continuous batching with the device's kernels and CUDA graphs against
  batch-1 decoding (2K prompts, 16 tokens): ``requests_equal`` of ``requests``.

Every point runs in try/except and records its ``status`` (ok | oom | error | skipped); ``--max-seconds`` skips
the points that would not fit and a watchdog writes the file and exits if a point overruns.

Usage (H200, about 200 s): ``python benchmarks/batched_decode.py --max-seconds 200``
CPU check of the logic (tiny model, seconds): ``python benchmarks/batched_decode.py --tiny --out /tmp/b.json``
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result

GIB = 2 ** 30
RECIPE = "HyLo-Qwen-7MLA21GDN-8K-SFT"


class Run:
    """Budget clock and results file (rewritten after every record); a watchdog saves and exits if the budget is
    overrun by more than ``grace_s`` while a point runs."""

    def __init__(self, out: Path, max_seconds: float, env: dict, grace_s: float = 15.0):
        self.t0, self.max_seconds, self.out, self.env = time.monotonic(), max_seconds, out, env
        self.lock = threading.Lock()
        self.save()
        self._grace = grace_s
        threading.Thread(target=self._watchdog, daemon=True).start()

    def left(self) -> float:
        return self.max_seconds - (time.monotonic() - self.t0)

    def save(self) -> None:
        with self.lock:
            self.env["elapsed_s"] = time.monotonic() - self.t0
            write_result(self.out, self.env)

    def add(self, rec: dict) -> dict:
        rec = {k: v for k, v in rec.items() if not isinstance(v, (dict, list))}
        rec["at_s"] = time.monotonic() - self.t0
        self.env["records"].append(rec)
        self.save()
        shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in rec.items()}
        print(f"[{rec['at_s']:6.1f}s] {shown}", flush=True)
        return rec

    def _watchdog(self) -> None:
        time.sleep(max(0.0, self.left() + self._grace))
        self.env["aborted"] = "watchdog: --max-seconds exceeded while a point was running; its record is missing"
        self.save()
        print(self.env["aborted"], flush=True)
        os._exit(0)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(device: str, dtype: torch.dtype, tiny: bool):
    """(model, info): the recipe's shapes with random weights, or a tiny 2MLA2GDN q/k-norm hybrid."""
    from hylo_bench.serving.build import _materialise, build_model

    if not tiny:
        return build_model(RECIPE, device, dtype)
    from hylo_bench.config.hylo_config import HyLoConfig
    from hylo_bench.models.hybrid import HyLoForCausalLM

    cfg = HyLoConfig(vocab_size=256, hidden_size=64, intermediate_size=128, n_layer=4, mla_layers=[1, 3],
                     num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=48,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, gdn_num_heads=2, gdn_head_dim=16,
                     use_qk_norm=True, base_model_type="qwen3", eos_token_id=None)
    with torch.device("meta"):
        model = HyLoForCausalLM(cfg)
    _materialise(model, device, dtype, ("A_log", "dt_bias"))
    return model.eval(), {"name": "tiny hybrid", "kind": "hybrid", "layout": "2MLA2GDN", "weights": "random",
                          "config": cfg}


def _error(rec: dict, exc: BaseException) -> dict:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return rec | {"status": "oom", "error": (str(exc).splitlines() or ["OutOfMemoryError"])[0][:300]}
    return rec | {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}


def prefill_estimate(engine, T: int, chunk: int) -> dict:
    """Batch-1 TTFT estimate from a warm-up chunk, then the first and the last chunk of a T-token prompt."""
    n = math.ceil(T / chunk)
    engine.time_prefill_chunk(1, 0, min(chunk, T))
    first = engine.time_prefill_chunk(1, 0, min(chunk, T))
    last = engine.time_prefill_chunk(1, max(0, T - chunk), min(chunk, T)) if n > 1 else first
    return {"ttft_s": n * (first + last) / 2, "first_chunk_s": first, "last_chunk_s": last, "prefill_chunks": n}


def prefill_point(run: Run, model, info: dict, T: int, *, chunk: int, device: str) -> dict:
    """The batch-1 TTFT estimate at T tokens (its own record, ``benchmark: batched_decode_prefill``), copied into
    the ``ttft_s`` of the decode records already written."""
    from hylo_bench.decode.engine import Engine

    rec = {"benchmark": "batched_decode_prefill", "model": info["name"], "variant": "prefill", "layout": info["layout"],
           "seq_len": T, "batch_size": 1,
           "prefill_chunk": chunk, "mode": "estimated"}
    engine = None
    try:
        engine = Engine(model, 1, T, chunk)
        rec.update(prefill_estimate(engine, T, chunk), status="ok")
        for r in run.env["records"]:
            if r.get("benchmark") == "batched_decode" and r.get("status") == "ok":
                r.update(ttft_s=rec["ttft_s"], ttft_note="batch-1 prefill, chunk estimate (a request's own prefill "
                                                         "under continuous batching)")
    except Exception as exc:  # noqa: BLE001
        rec = _error(rec, exc)
    del engine
    free()
    return run.add(rec)


def decode_point(run: Run, model, info: dict, T: int, B: int, *, steps: int, chunk: int, graphs: bool,
                 compile_step: bool, device: str) -> dict:
    from hylo_bench.decode.engine import Engine
    from hylo_bench.serving.bound import bound_fields, copy_bandwidth

    rec = {"benchmark": "batched_decode", "model": info["name"], "layout": info["layout"], "seq_len": T,
           "batch_size": B, "decode_steps": steps, "cuda_graphs": graphs, "compile": compile_step, "mode": "estimated"}
    engine = None
    try:
        t0 = time.monotonic()
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats()
        engine = Engine(model, B, T + steps + 1, chunk, cuda_graphs=graphs, compile=compile_step)
        rec["kv_cache_gib"] = sum(engine.cache_bytes().values()) / GIB
        engine.decode_benchmark(B, T, 3)  # Triton compiles / autotune, CUDA-graph capture for this batch
        rec["setup_s"] = time.monotonic() - t0
        t = engine.decode_benchmark(B, T, steps)
        rec.update({k: v for k, v in t.to_dict().items() if k not in ("ttft_s", "prefill_tokens_per_s")})
        rec["graph_error"] = getattr(engine, "graph_error", None)
        rec.update(ttft_s=None, ttft_note="not measured (yet): see the batched_decode_prefill record")
        rec.update(bound_fields(model, B, T, t.tpot_s, device, copy_bandwidth(device)))
        rec["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - recorded, the next point runs
        rec = _error(rec, exc)
    del engine
    free()
    return run.add(rec)


def ruler_point(run: Run, model, info: dict, T: int, B: int, *, samples: int, new_tokens: int, chunk: int,
                graphs: bool, device: str, seed: int = 0) -> dict:
    from hylo_bench.decode.batching import BatchStats, Request, continuous_generate
    from hylo_bench.decode.engine import Engine

    rec = {"benchmark": "ruler_continuous_batching", "model": info["name"], "variant": "continuous batching",
           "layout": info["layout"], "seq_len": T,
           "batch_size": B, "num_samples": samples, "new_tokens": new_tokens, "cuda_graphs": graphs}
    engine = None
    try:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(int(0.9 * T), T + 1, (samples,), generator=g).tolist()
        vocab = model.config.vocab_size
        reqs = [Request(ids=torch.randint(0, vocab, (n,), generator=g).tolist(), max_new_tokens=new_tokens)
                for n in lengths]
        t0 = time.monotonic()
        engine = Engine(model, B, T + new_tokens, chunk, cuda_graphs=graphs)
        warm = [Request(ids=r.ids[: min(len(r.ids), chunk)], max_new_tokens=3) for r in reqs[:B]]
        continuous_generate(engine, warm)  # compiles, graph capture for B (untimed)
        rec["setup_s"] = time.monotonic() - t0
        stats = BatchStats(batch_size=B)
        if device != "cpu":
            torch.cuda.synchronize()
        w0 = time.perf_counter()
        out = continuous_generate(engine, reqs, stats=stats)
        wall = time.perf_counter() - w0
        rec.update(seconds=wall, samples_per_s=samples / wall, tokens_per_s=stats.generated_tokens / wall,
                   prefill_s=stats.prefill_s, decode_s=stats.decode_s, decode_steps=stats.decode_steps,
                   generated_tokens=stats.generated_tokens, prompt_tokens=stats.prefill_tokens,
                   all_full_length=all(len(o) == new_tokens for o in out),
                   peak_memory_gib=torch.cuda.max_memory_allocated() / GIB if device != "cpu" else None,
                   graph_error=getattr(engine, "graph_error", None), status="ok")
    except Exception as exc:  # noqa: BLE001
        rec = _error(rec, exc)
    del engine
    free()
    return run.add(rec)


def parity_point(run: Run, model, info: dict, *, B: int, T: int, new_tokens: int, chunk: int, graphs: bool,
                 seed: int = 1) -> dict:
    """Continuous batching on the device (its kernels, CUDA graphs) against batch-1 ``generate_until``: 2B requests
    of T/2..T tokens. bf16 GEMMs of another batch size may round differently, so a near-tie can flip a greedy token
    with random weights; the record gives the share of requests whose tokens are equal."""
    from hylo_bench.decode.batching import Request, continuous_generate
    from hylo_bench.decode.engine import Engine

    rec = {"benchmark": "batched_decode_parity", "check": "parity", "layout": info["layout"], "seq_len": T,
           "batch_size": B,
           "new_tokens": new_tokens, "cuda_graphs": graphs}
    try:
        g = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(T // 2, T + 1, (2 * B,), generator=g)]
        batched = continuous_generate(Engine(model, B, T + new_tokens, chunk, cuda_graphs=graphs),
                                      [Request(ids=p, max_new_tokens=new_tokens) for p in prompts])
        free()
        single = Engine(model, 1, T + new_tokens, chunk, cuda_graphs=graphs)
        one = [single.generate_until(torch.tensor([p]), new_tokens, set()) for p in prompts]
        same = [a == b for a, b in zip(batched, one)]
        rec.update(requests=len(prompts), requests_equal=sum(same), tokens_equal_batch1=all(same),
                   first_token_equal=sum(a[:1] == b[:1] for a, b in zip(batched, one)), status="ok")
    except Exception as exc:  # noqa: BLE001
        rec = _error(rec, exc)
    free()
    return run.add(rec)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-seconds", type=float, default=200.0, help="Stop cleanly within this many seconds.")
    ap.add_argument("--context", default="64k", help="Tokens per sequence.")
    ap.add_argument("--batches", default="1,8,32", help="Decode batch sizes.")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prefill-chunk", default="16k")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (about 45 s per batch).")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--ruler-batches", default="8,1", help="Continuous-batching slots per RULER point ('' = none).")
    ap.add_argument("--ruler-samples", type=int, default=16, help="Requests per RULER point at batch > 1 (batch 1: "
                    "a quarter of them, at least 2).")
    ap.add_argument("--ruler-new-tokens", type=int, default=64)
    ap.add_argument("--decode-reserve-s", type=float, default=25.0, help="Seconds a decode point needs to start.")
    ap.add_argument("--grace-s", type=float, default=15.0, help="The watchdog saves and exits this long after "
                    "--max-seconds if a point is still running.")
    ap.add_argument("--tiny", action="store_true", help="Tiny model on CPU: checks the script's logic in seconds.")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "batched_decode.json")
    args = ap.parse_args(argv)
    from hylo_bench.config.units import parse_length
    from hylo_bench.serving.bound import copy_bandwidth

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    T, chunk, steps = parse_length(args.context), parse_length(args.prefill_chunk), args.decode_steps
    batches, ruler_batches = _ints(args.batches), _ints(args.ruler_batches)
    samples, new_tokens = args.ruler_samples, args.ruler_new_tokens
    if args.tiny:
        T, chunk, steps, batches, samples, new_tokens = 96, 32, 4, [1, 2, 4], 6, 4
        ruler_batches = [3, 1]
    graphs = not args.no_cuda_graphs and device == "cuda"
    env = result_envelope("batched_decode")
    env.update(recipe=RECIPE, tiny=args.tiny, max_seconds=args.max_seconds, seq_len=T, batches=batches,
               ruler_batches=ruler_batches, decode_steps=steps, prefill_chunk=chunk, cuda_graphs=graphs,
               compile=args.compile, bound_formula="bytes = weights + B * (T * latent bytes/token + 2 * linear "
                                                   "state bytes); bound_tpot_s = bytes / copy bandwidth")
    run = Run(args.out, args.max_seconds, env, grace_s=args.grace_s)
    bw, source = copy_bandwidth(device)
    env.update(copy_bandwidth_B_per_s=bw, bandwidth_source=source)
    t0 = time.monotonic()
    model, info = build(device, dtype, args.tiny)
    env.update(build_s=time.monotonic() - t0, params=sum(p.numel() for p in model.parameters()))
    run.save()
    for B in batches:
        if run.left() < (0 if args.tiny else args.decode_reserve_s):
            run.add({"benchmark": "batched_decode", "layout": info["layout"], "seq_len": T, "batch_size": B,
                     "status": "skipped", "error": f"{run.left():.0f} s left of --max-seconds"})
            continue
        decode_point(run, model, info, T, B, steps=steps, chunk=chunk, graphs=graphs, compile_step=args.compile,
                     device=device)
    ttft = None
    if run.left() >= (0 if args.tiny else 30):  # first prefill: fla's chunk kernels compile
        ttft = prefill_point(run, model, info, T, chunk=chunk, device=device).get("ttft_s")
    else:
        run.add({"benchmark": "batched_decode_prefill", "layout": info["layout"], "seq_len": T, "status": "skipped",
                 "error": f"{run.left():.0f} s left of --max-seconds"})
    for B in ruler_batches:
        n = samples if B > 1 else max(2, samples // 4)
        per_prefill = ttft or 0.0
        need = 0 if args.tiny else 20 + 1.3 * n * per_prefill
        if run.left() < need:
            run.add({"benchmark": "ruler_continuous_batching", "layout": info["layout"], "seq_len": T,
                     "batch_size": B, "num_samples": n, "status": "skipped",
                     "error": f"needs about {need:.0f} s ({n} prefills of {per_prefill:.1f} s); "
                              f"{run.left():.0f} s left of --max-seconds"})
            continue
        ruler_point(run, model, info, T, B, samples=n, new_tokens=new_tokens, chunk=chunk, graphs=graphs,
                    device=device)
    if run.left() >= (0 if args.tiny else 20):
        parity_point(run, model, info, B=2 if args.tiny else 4, T=48 if args.tiny else 2048,
                     new_tokens=4 if args.tiny else 16, chunk=chunk, graphs=graphs)
    else:
        run.add({"benchmark": "batched_decode_parity", "check": "parity", "layout": info["layout"], "status": "skipped",
                 "error": f"{run.left():.0f} s left of --max-seconds"})
    env["finished"] = True
    run.save()
    print(f"done in {time.monotonic() - run.t0:.0f} s: {args.out}", flush=True)


if __name__ == "__main__":
    main()
