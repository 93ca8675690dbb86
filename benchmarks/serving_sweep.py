"""Serving sweep on one H200: Qwen3-1.7B-shaped HyLo 7MLA21GDN vs the Qwen3-1.7B-shaped transformer (random bf16
weights, real shapes), native engine (:mod:`hylo_bench.decode.engine`), batch 1, prefill + 128 decoded tokens at
8K, 64K, 256K, 1M and 2M tokens; plus the batch-1 decode at 64K as a fraction of the memory-bandwidth bound, and
the ``hylo-bench kv`` memory model next to the measured peak memory. Writes ``benchmarks/results/serving_sweep.json``
(benchmark format) after every point and stops cleanly inside ``--budget-s``.

Order: environment and copy bandwidth, GPU parity checks, HyLo 8K -> 2M (64K also without CUDA graphs), then the
baseline 8K -> 2M (larger contexts skipped after its first OOM). Per context the script allocates the engine (an
OOM here is recorded as ``status: oom``), times the first and the last prefill chunk (chunk cost grows linearly
with its offset, so TTFT ~= n_chunks * (first + last) / 2) and runs the full prefill only when that estimate fits
the remaining budget; otherwise the point is ``mode: estimated``: decode is measured after a synthetic context
(caches filled with random values; decode cost does not depend on them) and TTFT is the chunk estimate.
MLA prefill attention is quadratic: FLOPs ~= 2 * T^2 * (d_qk + d_v) * n_heads * n_mla (the causal half of
4 T^2 d per head), ~2.5e17 at 2M for 7 MLA layers, about 10 minutes at 400 TFLOP/s, so 2M is expected to be
``estimated`` (the record says why).

Usage (H200, one command; about 8 minutes)::

    source .gpu-bundle/install.sh && export HYLO_BENCH_GIT_SHA=<sha> PYTHONUNBUFFERED=1 && \\
      python3 benchmarks/serving_sweep.py --budget-s 480 && cp benchmarks/results/serving_sweep.json $OUT/

CPU smoke test of the script's logic (tiny models): ``python benchmarks/serving_sweep.py --smoke --out /tmp/s.json``.
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
    """Budget clock and the results file (rewritten after every record; a watchdog ends the process cleanly)."""

    def __init__(self, out: Path, budget_s: float, env: dict):
        self.t0, self.budget_s, self.out, self.env = time.monotonic(), budget_s, out, env
        self.lock = threading.Lock()
        self.save()
        threading.Thread(target=self._watchdog, daemon=True).start()

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        with self.lock:
            self.env["elapsed_s"] = time.monotonic() - self.t0
            write_result(self.out, self.env)

    def add(self, rec: dict) -> dict:
        rec = {k: v for k, v in rec.items() if not isinstance(v, (dict, list))}
        self.env["records"].append(rec)
        self.save()
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}
        print(f"[{time.monotonic() - self.t0:6.1f}s] {shown}", flush=True)
        return rec

    def _watchdog(self) -> None:
        time.sleep(max(0.0, self.left() + 20))
        self.env["aborted"] = "watchdog: budget exceeded while a point was running; its record is missing"
        try:
            self.env["summary"] = summarise(self.env)
        except Exception as exc:  # noqa: BLE001 - the records are what matters
            self.env["summary"] = f"not computed: {exc}"
        self.save()
        print(self.env["aborted"], flush=True)
        os._exit(0)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(device: str, nbytes: int = 4 * GIB, reps: int = 10) -> float:
    """Device copy bandwidth in bytes/s: (read + write) bytes of ``dst.copy_(src)`` per second."""
    if device == "cpu":
        nbytes, reps = 64 * 2 ** 20, 3
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    if device != "cpu":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del src, dst
    free()
    return 2 * nbytes * reps / dt


def build(kind: str, device: str, dtype: torch.dtype, smoke: bool):
    """(model, info) for ``hybrid`` / ``baseline``: recipe shapes, or tiny shapes with ``smoke``."""
    from hylo_bench.serving.build import _materialise, build_model

    if not smoke:
        return build_model(RECIPE if kind == "hybrid" else f"backbone:{RECIPE}", device, dtype)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hylo_bench.config.hylo_config import HyLoConfig
    from hylo_bench.models.hybrid import HyLoForCausalLM

    if kind == "hybrid":
        cfg = HyLoConfig(vocab_size=256, hidden_size=64, intermediate_size=128, n_layer=4, mla_layers=[1, 3],
                         num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=48,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, gdn_num_heads=2, gdn_head_dim=16,
                         use_qk_norm=True, base_model_type="qwen3")
        with torch.device("meta"):
            model = HyLoForCausalLM(cfg)
        _materialise(model, device, dtype, ("A_log", "dt_bias"))
        return model.eval(), {"name": "smoke hybrid", "kind": "hybrid", "layout": "2MLA2GDN", "weights": "random",
                              "config": cfg}
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    _materialise(model, device, dtype, ())
    return model.eval(), {"name": "smoke transformer", "kind": "transformer", "layout": "transformer",
                          "weights": "random", "config": cfg}


def decode_bytes_per_token(model, engine, T: int, B: int) -> int:
    """Bytes one decode step must read: every weight except the embedding table (one row), plus the KV / latent
    cache of T tokens per sequence, plus the linear-layer states (read and written)."""
    emb = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    if model.get_output_embeddings().weight is emb:  # tied head: the whole matrix is read by the LM head
        weights += emb.numel() * emb.element_size()
    cache = engine.cache_bytes()
    cap = engine.max_context
    per_token = (cache.get("mla_latent", 0) + cache.get("mla_key_scale", 0) + cache.get("kv", 0)) / cap / \
        engine.max_batch
    state = cache.get("linear_state", 0) / engine.max_batch
    return int(weights + B * (T * per_token + 2 * state))


def parity_checks(run: Run, model, device: str) -> None:
    """Kernel and engine checks on the GPU (recorded): Triton vs torch MLA decode, fla vs torch GDN decode step,
    engine prefill logits vs the model's forward, CUDA-graph tokens vs eager tokens."""
    from hylo_bench.decode.engine import Engine
    from hylo_bench.decode.linear_layer import LinearServing
    from hylo_bench.kernels.mla_decode import mla_decode

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    rec = {"check": "parity", "status": "ok"}
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        B, H, T, R, P, G = 1, 16, 70_001, 256, 64, 8
        args = [torch.randn(s, generator=g).to(device, torch.bfloat16) for s in ((B, H, R), (B, H, P), (B, T, R + P))]
        ks = (torch.rand(B, T, G, generator=g) + 0.5).to(device, torch.bfloat16)
        n = torch.tensor([T - 5], device=device)
        if device != "cpu":
            a = mla_decode(*args, n, scale=0.088, key_scale=ks, backend="triton")
            rec["mla_decode_triton_vs_torch_rel"] = rel(a, mla_decode(*args, n, scale=0.088, key_scale=ks,
                                                                      backend="torch"))
        layer = next(m for m in model.model.layers if m.mixer_type == "gdn")
        x = torch.randn(2, 1, model.config.hidden_size, generator=g).to(device, layer.gdn.q_proj.weight.dtype)
        outs = []
        for backend in (("fla", "torch") if device != "cpu" else ("torch",)):
            srv = LinearServing(layer.gdn, "gdn", gdn_decode_backend=backend)
            st = srv.new_state(2)
            torch.manual_seed(1)
            st.recurrent.normal_(0, 0.1)
            for c in st.conv:
                c.normal_()
            outs.append((srv.decode(x, st), st.recurrent.clone()))
        if len(outs) == 2:
            rec["gdn_decode_fla_vs_torch_rel"] = rel(outs[0][0], outs[1][0])
            rec["gdn_state_fla_vs_torch_rel"] = rel(outs[0][1], outs[1][1])
        ids = torch.randint(0, model.config.vocab_size, (1, 1000), generator=g).to(device)
        with torch.inference_mode():
            want = model(ids, logits_to_keep=1).logits[:, -1]
        e_graph = Engine(model, 1, 1100, 256, cuda_graphs=device != "cpu")
        rec["engine_prefill_vs_forward_rel"] = rel(e_graph.prefill(ids), want)
        tok_g, _ = e_graph.generate(ids, 16)
        del e_graph
        tok_e, _ = Engine(model, 1, 1100, 256).generate(ids, 16)
        rec["graph_tokens_equal_eager"] = bool(torch.equal(tok_g, tok_e))
    except Exception as exc:  # noqa: BLE001 - a failed check is a result
        rec.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
    free()
    run.add(rec)


def point(run: Run, model, info: dict, T: int, *, steps: int, chunk: int, graphs: bool, reserve_s: float,
          device: str, variant: str = "", compile_step: bool = False) -> dict:
    """One context: allocate, estimate TTFT from two chunks, full run when it fits the budget, else estimated."""
    from hylo_bench.decode.engine import make_engine
    from hylo_bench.serving.sweep_worker import memory_model_gib

    chunk = min(chunk, T)
    rec = {"series": "hylo" if info["kind"] == "hybrid" else "baseline", "model": info["name"],
           "layout": info["layout"], "seq_len": T, "batch_size": 1, "decode_steps": steps, "prefill_chunk": chunk,
           "cuda_graphs": graphs, "compile": compile_step, "variant": variant}
    rec.update(memory_model_gib(model, info, 1, T + steps))
    cfg = model.config
    if info["kind"] == "hybrid":
        n_mla, H = len(cfg.mla_layers), cfg.num_attention_heads
        rec["prefill_attention_flops"] = 2.0 * T * T * (cfg.qk_head_dim + cfg.v_head_dim) * H * n_mla
    else:
        d_h = cfg.head_dim
        rec["prefill_attention_flops"] = 2.0 * T * T * 2 * d_h * cfg.num_attention_heads * cfg.num_hidden_layers
    engine = None
    try:
        if device != "cpu":
            torch.cuda.reset_peak_memory_stats()
        engine = make_engine(model, 1, T + steps, chunk, cuda_graphs=graphs,
                             **({"compile": True} if compile_step else {}))
        rec["kv_cache_gib"] = sum(engine.cache_bytes().values()) / GIB
        rec["decode_bytes_per_token"] = decode_bytes_per_token(model, engine, T, 1)
        n_chunks = math.ceil(T / chunk)
        if n_chunks >= 3:  # warm-up chunk, then the first and the last chunk
            engine.time_prefill_chunk(1, 0, chunk)
            t_first = engine.time_prefill_chunk(1, 0, chunk)
            if device != "cpu":
                torch.cuda.reset_peak_memory_stats()
            t_last = engine.time_prefill_chunk(1, T - chunk, chunk)
            rec["prefill_chunk_peak_gib"] = torch.cuda.max_memory_allocated() / GIB if device != "cpu" else None
            rec["ttft_estimated_s"] = n_chunks * (t_first + t_last) / 2
            rec["first_chunk_s"], rec["last_chunk_s"] = t_first, t_last
        est = rec.get("ttft_estimated_s", 0.0)
        full = est * 1.15 + 20 < run.left() - reserve_s
        if full:
            ids = torch.randint(0, cfg.vocab_size, (1, T)).to(device)
            engine.generate(ids[:, : min(T, 2048)], 3)  # compile / autotune, CUDA-graph capture
            _, t = engine.generate(ids, steps)
            rec.update(mode="full", **t.to_dict())
            rec["graph_error"] = getattr(engine, "graph_error", None)
            if "ttft_estimated_s" in rec:
                rec["ttft_estimate_ratio"] = rec["ttft_estimated_s"] / t.ttft_s
        else:
            t = engine.decode_benchmark(1, T, steps)
            rec.update(mode="estimated", **t.to_dict())
            rec["graph_error"] = getattr(engine, "graph_error", None)
            rec["ttft_s"] = None
            left = max(0.0, run.left() - reserve_s)
            rec["why_estimated"] = (f"full prefill estimated at {est:.0f} s (first/last chunk timing), more than the "
                                    f"{left:.0f} s left in the budget" if est else
                                    f"budget exhausted ({left:.0f} s left after the reserve)")
        peaks = [v for v in (rec.get("prefill_peak_gib"), rec.get("prefill_chunk_peak_gib"),
                             rec.get("decode_peak_gib")) if v is not None]
        rec["peak_memory_gib"] = max(peaks) if peaks else None
        if rec.get("decode_peak_gib") is not None:
            for key in ("kv_model", "kv_model_engine"):
                rec[f"{key}_err_pct"] = 100.0 * (rec["decode_peak_gib"] - rec[f"{key}_gib"]) / rec[f"{key}_gib"]
                rec[f"{key}_within_5pct"] = abs(rec[f"{key}_err_pct"]) <= 5.0
        rec["status"] = "ok"
    except torch.cuda.OutOfMemoryError as exc:
        rec.update(status="oom", error=str(exc).splitlines()[0][:300] if str(exc) else "OutOfMemoryError")
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        rec.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
    del engine
    free()
    return run.add(rec)


def bandwidth_record(run: Run, rec: dict, bw: float) -> None:
    if rec.get("status") != "ok" or not rec.get("tpot_s"):
        return
    bound = rec["decode_bytes_per_token"] / bw
    run.add({"check": "bandwidth_bound", "series": rec["series"], "seq_len": rec["seq_len"], "batch_size": 1,
             "cuda_graphs": rec["cuda_graphs"], "compile": rec.get("compile", False), "variant": rec.get("variant", ""),
             "tpot_s": rec["tpot_s"],
             "bytes_per_token": rec["decode_bytes_per_token"], "copy_bandwidth_gb_per_s": bw / 1e9,
             "bound_tpot_s": bound, "fraction_of_bound": bound / rec["tpot_s"], "status": "ok"})


def summarise(env: dict) -> dict:
    """Headline numbers for the envelope: per series the largest context measured in full and in estimated mode,
    the first OOM, the 64K bandwidth-bound fraction, the memory-model error range, and for every estimated
    point a FLOP-based TTFT estimate from the attention throughput achieved by the longest full prefill."""
    recs = env["records"]
    out: dict = {}
    for series in ("hylo", "baseline"):
        pts = [r for r in recs if r.get("series") == series and "check" not in r and not r.get("variant")]
        full = [r for r in pts if r.get("status") == "ok" and r.get("mode") == "full"]
        est = [r for r in pts if r.get("status") == "ok" and r.get("mode") == "estimated"]
        errs = [r["kv_model_engine_err_pct"] for r in pts if r.get("kv_model_engine_err_pct") is not None]
        s = {"max_full_tokens": max((r["seq_len"] for r in full), default=None),
             "max_estimated_tokens": max((r["seq_len"] for r in est), default=None),
             "first_oom_tokens": min((r["seq_len"] for r in pts if r.get("status") == "oom"), default=None),
             "kv_model_err_pct_range": [min(errs), max(errs)] if errs else None}
        if full:
            ref = max(full, key=lambda r: r["seq_len"])
            tflops = ref["prefill_attention_flops"] / ref["ttft_s"] / 1e12
            s["attention_tflops_lower_bound"] = tflops
            s["ttft_flops_estimate_s"] = {str(r["seq_len"]): r["prefill_attention_flops"] / tflops / 1e12
                                          for r in est}
        bw = [r for r in recs if r.get("check") == "bandwidth_bound" and r.get("series") == series]
        s["bandwidth_bound_fraction"] = {(r.get("variant") or ("graphs" if r["cuda_graphs"] else "eager")):
                                         r["fraction_of_bound"] for r in bw}
        out[series] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=480.0, help="Stop cleanly within this many seconds.")
    ap.add_argument("--contexts", default="8k,64k,256k,1m,2m")
    ap.add_argument("--baseline-contexts", default="8k,64k,256k,1m,2m")
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--prefill-chunk", default="32k")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--compile-variant", default="", help="Contexts (e.g. 8k,64k) that also run a variant "
                    "'compiled': torch.compile'd decode step inside the CUDA graph.")
    ap.add_argument("--eager-variant", action="store_true", help="Also run the 64K point without CUDA graphs.")
    ap.add_argument("--no-checks", action="store_true", help="Skip the GPU parity checks.")
    ap.add_argument("--reserve-s", type=float, default=None, help="Seconds kept back after each HyLo point "
                    "(default: 150 to 256K, 100 to 1M, 80 beyond).")
    ap.add_argument("--smoke", action="store_true", help="Tiny models on CPU: checks the script's logic.")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serving_sweep.json")
    args = ap.parse_args()
    from hylo_bench.config.units import parse_length

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    contexts = [parse_length(c) for c in args.contexts.split(",") if c.strip()]
    base_contexts = [parse_length(c) for c in args.baseline_contexts.split(",") if c.strip() not in ("", "none")]
    compile_at = {parse_length(c) for c in args.compile_variant.split(",") if c.strip()}
    chunk = parse_length(args.prefill_chunk)
    steps = args.decode_steps
    if args.smoke:
        contexts, base_contexts, chunk, steps = [64, 256, 1024], [64, 256, 1024], 64, 4
    graphs = not args.no_cuda_graphs and device == "cuda"
    env = result_envelope("serving_sweep")
    env.update(recipe=RECIPE, budget_s=args.budget_s, contexts=contexts, baseline_contexts=base_contexts,
               prefill_chunk=chunk, decode_steps=steps, smoke=args.smoke,
               memory_model_note="kv_model_gib = weights + state + tokens x KV bytes/token (hylo-bench kv); "
                                 "kv_model_engine_gib adds the engine's q/k-norm key scales; compared with the "
                                 "decode-phase peak (torch max_memory_allocated)")
    run = Run(args.out, args.budget_s, env)
    torch.manual_seed(0)
    bw = copy_bandwidth(device)
    env["copy_bandwidth_gb_per_s"] = bw / 1e9
    t0 = time.monotonic()
    hybrid, hinfo = build("hybrid", device, dtype, args.smoke)
    env["hybrid_build_s"] = time.monotonic() - t0
    env["hybrid_params"] = sum(p.numel() for p in hybrid.parameters())
    if not args.no_checks:
        parity_checks(run, hybrid, device)

    # HyLo first, longest contexts last: 1M runs in full when its chunk-timed estimate fits the budget minus a
    # reserve for 2M (estimated) and the baseline series; 2M is expected to be estimated.
    reserves = {T: (150 if T <= 256 * 1024 else 100 if T <= 1024 * 1024 else 80) for T in contexts}
    if args.smoke:
        reserves = {T: 0 for T in contexts}
    if args.reserve_s is not None:
        reserves = {T: args.reserve_s for T in contexts}
    for T in sorted(contexts):
        rec = point(run, hybrid, hinfo, T, steps=steps, chunk=chunk, graphs=graphs, reserve_s=reserves[T],
                    device=device)
        if T == (256 if args.smoke else 65536):
            bandwidth_record(run, rec, bw)
            if graphs and args.eager_variant:
                eager = point(run, hybrid, hinfo, T, steps=steps, chunk=chunk, graphs=False, reserve_s=reserves[T],
                              device=device, variant="eager")
                bandwidth_record(run, eager, bw)
        if T in compile_at:
            comp = point(run, hybrid, hinfo, T, steps=steps, chunk=chunk, graphs=graphs, reserve_s=reserves[T],
                         device=device, variant="compiled", compile_step=True)
            bandwidth_record(run, comp, bw)
    del hybrid
    free()

    t0 = time.monotonic()
    base, binfo = build("baseline", device, dtype, args.smoke)
    env["baseline_build_s"] = time.monotonic() - t0
    env["baseline_params"] = sum(p.numel() for p in base.parameters())
    oom_at = None
    for T in sorted(base_contexts):
        if oom_at is not None:
            run.add({"series": "baseline", "model": binfo["name"], "seq_len": T, "batch_size": 1,
                     "status": "skipped", "error": f"{oom_at} tokens already ran out of memory"})
            continue
        rec = point(run, base, binfo, T, steps=steps, chunk=chunk, graphs=False, reserve_s=10, device=device)
        if rec["status"] == "oom":
            oom_at = T
        if T == (256 if args.smoke else 65536):
            bandwidth_record(run, rec, bw)
    del base
    free()
    env["finished"] = True
    env["summary"] = summarise(env)
    run.save()
    print(f"summary: {env['summary']}", flush=True)
    print(f"done in {time.monotonic() - run.t0:.0f} s: {args.out}", flush=True)


if __name__ == "__main__":
    main()
