"""Where a decode step's time goes: the Qwen3-1.7B-shaped 7MLA21GDN hybrid (random weights) on one GPU.

For each engine variant (CUDA graph of the ``torch.compile``'d step, with and without merged projections,
``hylo_bench.decode.fused``) at each context and batch size: time per output token, the memory-bandwidth bound
(:mod:`hylo_bench.serving.bound`: weights once + each sequence's latent cache and 2x its states, over the copy
bandwidth) and its fraction, and a kernel breakdown from ``torch.profiler`` over graph replays (matmuls, MLA decode,
GDN step, fused element-wise, other; kernels per step; the part of the step no kernel covers). Also: every distinct
decode GEMV shape alone, at each ``--gemv-rows`` row count, as achieved bandwidth.

Records go to ``benchmarks/results/decode_profile.json`` (one per variant and context, one per GEMV shape);
``--table`` writes the top kernels of each profile as text.

Usage (one H200, about 5 minutes; compile + autotune dominate)::

    source .gpu-bundle/install.sh && python3 benchmarks/decode_profile.py --out $OUT/decode_profile.json
    python3 benchmarks/decode_profile.py --smoke --out /tmp/p.json   # CPU check of the script's logic
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result
from batched_decode import build, free

from hylo_bench.serving.bound import copy_bandwidth, decode_step_bytes

CATEGORIES = (("mla_decode", ("_mla_decode",)), ("gdn_step", ("fused_recurrent", "_gdn_decode_token")),
              ("matmul", ("gemv", "gemm", "sm90", "xmma", "cutlass", "triton_tem", "splitk", "_mm_", "cublas")),
              ("fused_elementwise", ("triton_poi", "triton_red", "triton_per")))


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_events(prof) -> list[tuple[str, float]]:
    """(name, device seconds) of every GPU kernel / memcpy / memset the profiler saw, in order."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.elapsed_us() / 1e6))
    return out


def profile_steps(fn, steps: int, device: str):
    """Run ``fn`` ``steps`` times under torch.profiler; (kernel events, wall seconds per step)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        if device != "cpu":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    return kernel_events(prof), wall, prof


def breakdown(events: list[tuple[str, float]], steps: int) -> dict:
    """Per-step seconds by category, kernels per step, and the top kernels by total time."""
    rec = {f"{cat}_s": 0.0 for cat, _ in CATEGORIES} | {"other_s": 0.0}
    by_name: dict[str, float] = {}
    for name, t in events:
        rec[f"{category(name)}_s"] += t / steps
        by_name[name] = by_name.get(name, 0.0) + t / steps
    rec["kernel_time_per_step_s"] = sum(t for _, t in events) / steps
    rec["kernels_per_step"] = len(events) / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    return rec, top


ENGINE_SHAPES = ("gdn_merged_in", "gdn_o", "mla_merged_in", "mla_out", "mlp_merged_gate_up", "mlp_down", "lm_head")


# gemv record back end -> hylo_bench.kernels.gemv.triton_kernel.KERNEL
GEMV_KERNELS = {"triton": "rowblock", "triton_onepass": "rowblock", "triton_nopdl": "rowblock",
                "triton_persistent": "persistent", "triton_tma": "persistent_tma", "triton_rowblock": "rowblock",
                "triton_dotfused": "rowblock"}
# gemv record back end -> triton_kernel.ROWS_KERNEL (the kernel of 2..16 rows; "triton": the default, "dot")
GEMV_ROWS_KERNELS = {"triton_rowblock": "rowblock", "triton_dotfused": "dot_fused"}


def gemv_records(model, bw: float, device: str, dtype, backends=("cublas", "triton", "triton_onepass"),
                 rows: tuple[int, ...] = (1,)) -> list[dict]:
    """Each distinct decode GEMV shape alone, for each row count in ``rows`` (the batch), timed over a CUDA graph of
    50 calls that cycle through enough copies of the weight (>= 256 MB in all) that none is read from L2. Back ends:
    "cublas" (``F.linear``) and "triton" (:func:`hylo_bench.kernels.gemv.fused_gemv` with the prologue / epilogue the
    engine fuses into that GEMV: RMSNorm into the first projections, gate_up and lm_head; the residual add into
    o / out; SwiGLU + residual into down); for more than one row "triton" is the default multi-row kernel
    (``ROWS_KERNEL``), "triton_dotfused" / "triton_rowblock" name the others."""
    cfg = model.config
    layers = model.model.layers
    gdn = next(layer.mixer for layer in layers if layer.mixer_type == "gdn")
    mla = next(layer.mixer for layer in layers if layer.mixer_type == "mla")
    mlp = layers[0].mlp
    D = cfg.hidden_size
    first = mla.q_proj if hasattr(mla, "q_proj") else mla.q_a_proj
    norm, res, glu = "norm", "res", "glu+res"
    shapes = {
        "gdn_q_or_k": (tuple(gdn.q_proj.weight.shape), norm), "gdn_v_or_g": (tuple(gdn.v_proj.weight.shape), norm),
        "gdn_merged_in": ((2 * gdn.key_dim + 2 * gdn.value_dim + 2 * gdn.num_heads, D), norm),
        "gdn_o": (tuple(gdn.o_proj.weight.shape), res), "mla_first_q": (tuple(first.weight.shape), norm),
        "mla_kv_a": (tuple(mla.kv_a_proj_with_mqa.weight.shape), norm),
        "mla_merged_in": ((first.weight.shape[0] + mla.kv_a_proj_with_mqa.weight.shape[0], D), norm),
        "mla_out": (tuple(mla.out_proj.weight.shape), res),
        "mlp_gate_or_up": (tuple(mlp.gate_proj.weight.shape), norm),
        "mlp_merged_gate_up": ((2 * mlp.gate_proj.weight.shape[0], D), norm),
        "mlp_down": (tuple(mlp.down_proj.weight.shape), glu), "lm_head": (tuple(model.lm_head.weight.shape), norm),
    }
    recs = []
    for name, ((n_out, n_in), fuse), M in ((n, v, m) for n, v in shapes.items() for m in rows):
        nbytes = n_out * n_in * torch.finfo(dtype).bits // 8
        copies = max(2, -(-2 ** 28 // nbytes)) if device != "cpu" else 1
        ws = [torch.randn(n_out, n_in, device=device, dtype=dtype) for _ in range(copies)]
        x = torch.randn(M, 1, 2 * n_in if fuse == glu else n_in, device=device, dtype=dtype)
        nw = torch.rand(n_in, device=device, dtype=dtype) + 0.5
        r = torch.randn(M, 1, n_out, device=device, dtype=dtype)
        for backend in backends:
            if backend == "cublas":
                xin = x[..., :n_in]
                fn = functools.partial(F.linear, xin)
            else:
                if device == "cpu" or name not in ENGINE_SHAPES or (backend == "triton_onepass" and fuse != norm):
                    continue
                from hylo_bench.kernels.gemv import fused_gemv
                from hylo_bench.kernels.gemv import triton_kernel as tk

                if M == 1 and backend in ("triton_dotfused", "triton_rowblock"):
                    continue
                tk.ONE_PASS_NORM = backend == "triton_onepass"
                tk.KERNEL = GEMV_KERNELS.get(backend, "rowblock")
                tk.ROWS_KERNEL = GEMV_ROWS_KERNELS.get(backend, "dot")
                from hylo_bench.kernels import pdl as pdl_mode

                pdl_mode.MODE = False if backend == "triton_nopdl" else "auto"

                fn = functools.partial(fused_gemv, x, norm_weight=nw if fuse == norm else None, glu=fuse == glu,
                                       residual=r if fuse != norm else None, backend="triton")
            reps = 50 if device != "cpu" else 2
            try:
                for w in ws[:3]:
                    fn(w)
                if device != "cpu":
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for i in range(reps):
                            fn(ws[i % copies])
                    g.replay()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    g.replay()
                    e1.record()
                    torch.cuda.synchronize()
                    t = e0.elapsed_time(e1) / 1e3 / reps
                    del g
                else:
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn(ws[0])
                    t = (time.perf_counter() - t0) / reps
                rec = {"time_us": t * 1e6, "gb_per_s": nbytes / t / 1e9, "fraction_of_copy_bandwidth": nbytes / t / bw,
                       "status": "ok"}
            except Exception as exc:  # noqa: BLE001 - recorded, next shape
                rec = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
            if backend.startswith("triton") and rec["status"] == "ok":
                kern = {"rowblock": tk._fused_gemv_kernel, "persistent": tk._fused_gemv_persistent_kernel,
                        "persistent_tma": tk._fused_gemv_tma_kernel}[tk.KERNEL]
                if M > 1 and tk.ROWS_KERNEL != "rowblock":
                    kern = tk._fused_gemv_dot_kernel
                rec["triton_config"] = str(kern.best_config)[:200]
            recs.append({"kind": "gemv", "name": name, "backend": backend, "rows": M,
                         "fused": fuse if backend.startswith("triton") else "none", "out_features": n_out,
                         "in_features": n_in, "weight_bytes": nbytes, **rec})
            print(recs[-1], flush=True)
        del ws, x
    free()
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192,65536", help="context lengths in tokens (one engine sized for the "
                    "largest serves all)")
    ap.add_argument("--variants", default="merged-default,merged-default+gemv+prestep",
                    help="engine variants, comma-separated: {merged,unmerged}-{maxautotune,default,autotune,eager}: "
                         "projections merged or not; torch.compile mode max-autotune-no-cudagraphs, default, "
                         "max_autotune without coordinate-descent GEMV decomposition, or no compile; suffix +gemv: "
                         "the fused Triton GEMVs (Engine(gemv_backend='triton')), +gemv=in.out: only those "
                         "(Engine(fused_gemvs=...)); +prestep: the one-kernel GDN conv + gates "
                         "(Engine(gdn_prestep_backend='triton')); +onepass: the fused GEMV's RMSNorm statistics in its "
                         "main loop (default: a first pass); +kernel=persistent|persistent_tma: the fused GEMV's "
                         "persistent kernel (default: rowblock); +nopdl: the GEMV and pre-step kernels without "
                         "programmatic dependent launch; +l2pf=gemv.mla|gemv|mla|none: which kernels ask L2 for "
                         "their weights / cache rows before the PDL wait (default none); "
                         "+gdn=fla|triton|torch: the GDN decode back end (default "
                         "auto: the one-kernel "
                         "token on CUDA). Without suffixes: gemv and pre-step on torch")
    ap.add_argument("--batches", default="1", help="decode batch sizes, comma-separated (one engine sized for the "
                    "largest)")
    ap.add_argument("--gemv-rows", default="1", help="row counts of the per-shape GEMV timings, comma-separated")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per point")
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    ap.add_argument("--no-gemv-records", action="store_true", help="skip the per-shape GEMV timings")
    ap.add_argument("--gemv-backends", default="cublas,triton,triton_onepass,triton_dotfused,triton_rowblock",
                    help=f"per-shape GEMV back ends: cublas and {', '.join(GEMV_KERNELS)} (the fused kernel's forms)")
    ap.add_argument("--table", type=Path, default=None, help="write the top kernels of each profile here")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "decode_profile.json")
    args = ap.parse_args()

    from hylo_bench.decode.engine import Engine

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    env = result_envelope("decode_profile")
    model, info = build(device, dtype, args.smoke)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        contexts = [64, 256]
    bw, bw_source = copy_bandwidth(device)
    env.update(model=info["name"], layout=info["layout"], copy_bandwidth_gb_per_s=bw / 1e9, bandwidth_source=bw_source)
    if not args.no_gemv_records:
        env["records"] += gemv_records(model, bw, device, dtype, tuple(args.gemv_backends.split(",")),
                                       tuple(int(m) for m in args.gemv_rows.split(",")))
    write_result(args.out, env)
    tables = []
    cap = max(contexts) + args.steps + 16
    for variant in [v for v in args.variants.split(",") if v]:
        variant_base, *extras = variant.split("+")
        how, _, flavour = variant_base.partition("-")
        merged, compiled = how == "merged", flavour != "eager"
        from hylo_bench.decode.engine import DEFAULT_FUSED_GEMVS

        gemv, fused, prestep, one_pass, kernel, pdl = "torch", DEFAULT_FUSED_GEMVS, "torch", False, "rowblock", "auto"
        rows_kernel = "dot"
        gdn = "auto"
        l2pf: tuple[str, ...] = ()
        for extra in extras:
            if extra.startswith("gemv"):
                gemv = "triton"
                fused = tuple(extra.partition("=")[2].split(".")) if "=" in extra else fused
            elif extra == "prestep":
                prestep = "triton"
            elif extra == "onepass":  # the fused GEMV's RMSNorm statistics in its main loop
                one_pass = True
            elif extra == "nopdl":  # the row-block GEMV without programmatic dependent launch
                pdl = False
            elif extra.startswith("l2pf="):  # the L2 prefetch before the PDL wait (hylo_bench.kernels.l2_prefetch)
                l2pf = tuple(x for x in extra.partition("=")[2].split(".") if x != "none")
                if not set(l2pf) <= {"gemv", "mla"}:
                    raise SystemExit(f"+{extra} in {variant!r}: expected gemv, mla, gemv.mla or none")
            elif extra.startswith("gdn="):  # the GDN decode back end (LinearServing)
                gdn = extra.partition("=")[2]
            elif extra.startswith("kernel="):  # the fused GEMV's kernel (triton_kernel.KERNELS)
                kernel = extra.partition("=")[2]
            elif extra.startswith("rows="):  # the fused GEMV's kernel for 2..16 rows (triton_kernel.ROWS_KERNELS)
                rows_kernel = extra.partition("=")[2]
            else:
                raise SystemExit(f"unknown variant suffix +{extra} in {variant!r}")
        kw = {"compile_mode": "max-autotune-no-cudagraphs"} if flavour == "maxautotune" else \
            {"compile_options": {"max_autotune": True, "coordinate_descent_tuning": False}} if flavour == "autotune" \
            else {"compile_mode": "default"}
        if not args.smoke:
            from hylo_bench.kernels.gemv import triton_kernel

            triton_kernel.ONE_PASS_NORM = one_pass
            triton_kernel.KERNEL = kernel
            triton_kernel.ROWS_KERNEL = rows_kernel
            triton_kernel.L2_PREFETCH = "gemv" in l2pf
            from hylo_bench.kernels.mla_decode import triton_kernel as mla_kernel

            mla_kernel.L2_PREFETCH = "mla" in l2pf
            from hylo_bench.kernels import pdl as pdl_mode

            pdl_mode.MODE = pdl
        t0 = time.perf_counter()
        engine = Engine(model, max(batches), cap, 8192, cuda_graphs=device != "cpu",
                        compile=compiled and not args.smoke,
                        merge_projections=merged, gemv_backend=gemv, fused_gemvs=fused,
                        gdn_prestep_backend=prestep if device != "cpu" else "torch",
                        gdn_decode_backend=gdn if device != "cpu" else "torch", **({} if args.smoke else kw))
        for T, B in ((t, b) for t in contexts for b in batches):
            rec = {"kind": "decode", "variant": variant, "seq_len": T, "batch_size": B, "merged_projections": merged,
                   "compile": compiled and not args.smoke, "cuda_graphs": device != "cpu",
                   "gemv_backend": gemv, "fused_gemvs": ".".join(fused) if gemv == "triton" else "",
                   "gdn_prestep_backend": prestep, "gemv_one_pass_norm": one_pass, "gemv_kernel": kernel,
                   "gemv_rows_kernel": rows_kernel,
                   "gemv_pdl": str(pdl), "l2_prefetch": ".".join(l2pf) or "none",
                   "gdn_decode_backend": next((m.gdn_backend for m in engine.mixers if hasattr(m, "gdn_backend")),
                                              "")}
            try:
                timings = engine.decode_benchmark(B, T, args.steps)
                nbytes = decode_step_bytes(model, B, T)["total"]
                rec.update(tpot_s=timings.tpot_s, tokens_per_s=B / timings.tpot_s, bytes_per_step=nbytes,
                           bound_tpot_s=nbytes / bw, fraction_of_bound=nbytes / bw / timings.tpot_s,
                           peak_memory_gib=timings.decode_peak_gib or 0.0, setup_s=time.perf_counter() - t0)
                tok = torch.zeros(B, dtype=torch.long, device=device)
                pos = torch.full((B,), T, dtype=torch.long, device=device)
                with torch.inference_mode():
                    events, wall, _ = profile_steps(functools.partial(engine._decode, tok, pos), args.profile_steps,
                                                    device)
                parts, top = breakdown(events, args.profile_steps)
                rec.update(parts, profiled_wall_per_step_s=wall,
                           uncovered_per_step_s=max(0.0, timings.tpot_s - parts["kernel_time_per_step_s"]))
                if not events and device != "cpu":  # graph kernels not traced: profile the step outside the graph
                    with torch.inference_mode():
                        events, _, _ = profile_steps(functools.partial(engine._step_fn, tok, pos),
                                                     args.profile_steps, device)
                    parts, top = breakdown(events, args.profile_steps)
                    rec.update({f"nograph_{k}": v for k, v in parts.items()})
                tables.append(f"== {variant} @ {T} tokens, batch {B}: tpot {timings.tpot_s * 1e3:.3f} ms, kernels "
                              f"{parts['kernel_time_per_step_s'] * 1e3:.3f} ms/step, {parts['kernels_per_step']:.0f} "
                              f"kernels/step\n" + "\n".join(f"{t * 1e6:9.1f} us  {category(n):18s} {n[:110]}"
                                                            for n, t in top)
                              + "\n-- one step in order (first 80 kernels):\n"
                              + "\n".join(f"{t * 1e6:7.2f} us  {n[:120]}"
                                          for n, t in events[:min(80, int(parts['kernels_per_step']))]))
                if device != "cpu":  # the GDN token kernel's (BV, num_warps), tuned on its first call
                    from hylo_bench.kernels.gated_delta import decode_token_triton as token_kernel

                    rec["gdn_token_config"] = ";".join(f"BV={bv},warps={w}" for bv, w in token_kernel._BEST.values())
                rec["status"] = "ok"
            except torch.cuda.OutOfMemoryError as exc:
                rec.update(status="oom", error=str(exc)[:300])
            except Exception as exc:  # noqa: BLE001 - recorded; next variant
                rec.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
            env["records"].append(rec)
            write_result(args.out, env)
            print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
            if args.table:
                args.table.write_text("\n\n".join(tables) + "\n")
        del engine
        free()
    print("\n\n".join(tables))
    dec = [r for r in env["records"] if r.get("kind") == "decode" and r.get("status") == "ok"]
    env["summary"] = {f"{r['variant']}@{r['seq_len']}x{r['batch_size']}": round(r["fraction_of_bound"], 4)
                      for r in dec}
    write_result(args.out, env)
    print(f"wrote {args.out}: {env['summary']}")


if __name__ == "__main__":
    main()
