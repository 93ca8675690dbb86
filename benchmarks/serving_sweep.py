"""Serving sweep on one H200: Qwen3-1.7B-shaped HyLo 7MLA21GDN vs the Qwen3-1.7B-shaped transformer (random bf16
weights, real shapes), native engine (:mod:`hylo_bench.decode.engine`), batch 1, prefill + 128 decoded tokens at
8K, 64K, 256K, 1M and 2M tokens; plus the batch-1 decode at 64K as a fraction of the memory-bandwidth bound, and
the ``hylo-bench kv`` memory model next to the measured peak memory. Writes ``benchmarks/results/serving_sweep.json``
(benchmark format) after every point and stops cleanly inside ``--budget-s``.

A driver over ``hylo-bench sweep``'s library (:mod:`hylo_bench.serving.sweep`): every point runs in its own
``sweep_worker`` process (an OOM is ``status: oom`` and cannot poison the next point) with the sweep's budget
rules. Per point the worker allocates the engine, times the first and the last prefill chunk (chunk cost grows
linearly with its offset, so TTFT ~= n_chunks * (first + last) / 2) and runs the full prefill only when that
estimate fits the time left less the point's reserve; otherwise the point is ``mode: estimated``: decode is
measured after a synthetic context (caches filled with random values; decode cost does not depend on them) and
TTFT is the chunk estimate (``ttft_estimated_s``, ``why_estimated``). MLA prefill attention is quadratic:
FLOPs ~= 2 * T^2 * (d_qk + d_v) * n_heads * n_mla (the causal half of 4 T^2 d per head), ~2.5e17 at 2M for 7 MLA
layers, about 10 minutes at 400 TFLOP/s, so 2M is expected to be ``estimated`` (the record says why).

Order: environment and copy bandwidth, GPU parity checks (in this process, on the hybrid built here), HyLo 8K -> 2M
(64K also without CUDA graphs with ``--eager-variant``, ``--compile-variant`` contexts also compiled), then the
baseline 8K -> 2M (larger contexts skipped after its first OOM). Benchmark-only, on top of the sweep's records:
the parity record, ``check: bandwidth_bound`` records (the record's decode bytes over the copy bandwidth measured
here), ``decode_bytes_per_token`` and ``kv_model*_within_5pct`` on each point, and the envelope's ``summary``.

Usage (H200, one command; about 8 minutes)::

    source .gpu-bundle/install.sh && export HYLO_BENCH_GIT_SHA=<sha> PYTHONUNBUFFERED=1 && \\
      python3 benchmarks/serving_sweep.py --budget-s 480 && cp benchmarks/results/serving_sweep.json $OUT/

CPU smoke test of the script's logic (tiny models): ``python benchmarks/serving_sweep.py --smoke --out /tmp/s.json``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result

from hylo_bench.serving.sweep import SweepConfig, SweepRun

GIB = 2 ** 30
RECIPE = "HyLo-Qwen-7MLA21GDN-8K-SFT"


class Sweep(SweepRun):
    """The library's sweep run, saving this benchmark's envelope (with ``elapsed_s``) through ``_common``."""

    def save(self) -> None:
        self.env["elapsed_s"] = time.monotonic() - self.t0
        write_result(self.cfg.out, self.env)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def smoke_models(d: Path) -> tuple[str, str]:
    """Tiny random-weight checkpoints for ``--smoke`` (a 2MLA2GDN Qwen3-style hybrid and a Qwen3 transformer, vocab
    256): the workers load them as any checkpoint directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hylo_bench.config.hylo_config import HyLoConfig
    from hylo_bench.models.hybrid import HyLoForCausalLM

    torch.manual_seed(0)
    cfg = HyLoConfig(vocab_size=256, hidden_size=64, intermediate_size=128, n_layer=4, mla_layers=[1, 3],
                     num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=48,
                     qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, gdn_num_heads=2, gdn_head_dim=16,
                     use_qk_norm=True, base_model_type="qwen3")
    HyLoForCausalLM(cfg).save_pretrained(d / "hybrid")
    base = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    Qwen3ForCausalLM(base).save_pretrained(d / "baseline")
    return str(d / "hybrid"), str(d / "baseline")


def parity_checks(run: Sweep, spec: str, device: str, dtype: torch.dtype) -> None:
    """Kernel and engine checks on the GPU (recorded), on the hybrid built in this process: Triton vs torch MLA
    decode, fla vs torch GDN decode step, engine prefill logits vs the model's forward, CUDA-graph tokens vs eager
    tokens."""
    from hylo_bench.decode.engine import Engine
    from hylo_bench.decode.linear_layer import LinearServing
    from hylo_bench.kernels.mla_decode import mla_decode
    from hylo_bench.serving.build import build_model

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    rec = {"check": "parity", "status": "ok"}
    model = None
    try:
        model, _ = build_model(spec, device, dtype)
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
    del model
    free()
    run.add(rec)


def point(run: Sweep, series: str, spec: str, T: int, **kw) -> dict:
    """One batch-1 point through the sweep's worker, with this benchmark's derived keys."""
    rec = run.measure(series, spec, T, 1, **kw)
    if rec.get("bound_bytes_per_step") is not None:
        rec["decode_bytes_per_token"] = rec["bound_bytes_per_step"]
    for key in ("kv_model", "kv_model_engine"):
        if rec.get(f"{key}_err_pct") is not None:
            rec[f"{key}_within_5pct"] = abs(rec[f"{key}_err_pct"]) <= 5.0
    return run.add(rec)


def bandwidth_record(run: Sweep, rec: dict, bw: float) -> None:
    """The point's decode step against its bound at the copy bandwidth measured by this run (``bw``, B/s)."""
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


def model_facts(env: dict, series: str, prefix: str) -> None:
    """``<prefix>_build_s`` and ``<prefix>_params`` from the series' first measured point (its worker's build)."""
    rec = next((r for r in env["records"] if r.get("series") == series and r.get("params") is not None), None)
    if rec is not None:
        env[f"{prefix}_build_s"], env[f"{prefix}_params"] = rec.get("build_s"), rec["params"]


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
    from hylo_bench.serving.bound import measure_copy_bandwidth

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
    bw_at = 256 if args.smoke else 65536
    env = result_envelope("serving_sweep")
    env.update(recipe=RECIPE, budget_s=args.budget_s, contexts=contexts, baseline_contexts=base_contexts,
               prefill_chunk=chunk, decode_steps=steps, smoke=args.smoke,
               memory_model_note="kv_model_gib = weights + state + tokens x KV bytes/token (hylo-bench kv); "
                                 "kv_model_engine_gib adds the engine's q/k-norm key scales; compared with the "
                                 "decode-phase peak (torch max_memory_allocated)")

    def show(rec: dict) -> None:
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}
        print(f"[{time.monotonic() - run.t0:6.1f}s] {shown}", flush=True)

    with tempfile.TemporaryDirectory(prefix="serving-sweep-") as tmp:
        hybrid, base = smoke_models(Path(tmp)) if args.smoke else (RECIPE, f"backbone:{RECIPE}")
        cfg = SweepConfig(model=hybrid, contexts_tokens=contexts, batch_sizes=[1], out=args.out, decode_steps=steps,
                          prefill_chunk_tokens=chunk, cuda_graphs=graphs, device=device,
                          dtype=str(dtype).removeprefix("torch."), budget_s=args.budget_s)
        run = Sweep(cfg, on_record=show, env=env)  # the budget clock starts here
        run.save()
        bw = measure_copy_bandwidth(device, *((4 * GIB, 10) if device == "cuda" else ()))
        env["copy_bandwidth_gb_per_s"] = bw / 1e9
        if not args.no_checks:
            parity_checks(run, hybrid, device, dtype)

        # HyLo first, longest contexts last: 1M runs in full when its chunk-timed estimate fits the budget minus a
        # reserve for 2M (estimated) and the baseline series; 2M is expected to be estimated.
        reserves = {T: (150 if T <= 256 * 1024 else 100 if T <= 1024 * 1024 else 80) for T in contexts}
        if args.smoke:
            reserves = {T: 0 for T in contexts}
        if args.reserve_s is not None:
            reserves = {T: args.reserve_s for T in contexts}
        for T in sorted(contexts):
            rec = point(run, "hylo", hybrid, T, reserve_s=reserves[T])
            if T == bw_at:
                bandwidth_record(run, rec, bw)
                if graphs and args.eager_variant:
                    eager = point(run, "hylo", hybrid, T, variant="eager", cuda_graphs=False, reserve_s=reserves[T])
                    bandwidth_record(run, eager, bw)
            if T in compile_at:
                comp = point(run, "hylo", hybrid, T, variant="compiled", compile=True, reserve_s=reserves[T])
                bandwidth_record(run, comp, bw)
        model_facts(env, "hylo", "hybrid")

        oom_at = None
        for T in sorted(base_contexts):
            if oom_at is not None:
                run.skip("baseline", base, T, 1, f"{oom_at} tokens already ran out of memory")
                continue
            rec = point(run, "baseline", base, T, cuda_graphs=False, reserve_s=10)
            if rec["status"] == "oom":
                oom_at = T
            if T == bw_at:
                bandwidth_record(run, rec, bw)
        model_facts(env, "baseline", "baseline")
    env["finished"] = True
    env["summary"] = summarise(env)
    run.save()
    print(f"summary: {env['summary']}", flush=True)
    print(f"done in {time.monotonic() - run.t0:.0f} s: {args.out}", flush=True)


if __name__ == "__main__":
    main()
