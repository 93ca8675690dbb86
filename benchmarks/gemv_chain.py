"""What one kernel boundary costs in the batch-1 decode step: the MLP of 28 Qwen3-1.7B-shaped layers (RMSNorm ->
gate_up [12288, 2048] -> SwiGLU -> down [2048, 6144] + residual, bf16 random weights, each layer its own weights
so nothing stays in L2) captured in one CUDA graph, as the engine runs it (two fused GEMV kernels a layer,
:func:`hylo_bench.kernels.gemv.fused_gemv`, PDL on) and as one persistent kernel a layer with a grid barrier
between the two GEMVs (:mod:`hylo_bench.kernels.gemv.chain`, per variant: registers tiles ahead, L2 prefetch of
the phase-2 slab, grid size).

Records (one per variant and round, rounds interleaved): ``us_per_layer``, ``bound_us_per_layer`` (the two weights
over the device's copy bandwidth), ``fraction_of_bound``, ``rel_err_vs_engine`` (the 28-layer output against the
engine path's), ``status``. The difference between the engine's and the chain's time per layer is what removing
one boundary a layer saves.

Usage (one GPU, about a minute)::

    source .gpu-bundle/install.sh && python3 benchmarks/gemv_chain.py --out $OUT/gemv_chain.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result

from hylo_bench.serving.bound import copy_bandwidth

VARIANTS = {
    "chain_pf1": {"pf": 1},
    "chain_pf2": {"pf": 2},
    "chain_pf2_l2": {"pf": 2, "l2_prefetch": True},
    "chain_pf1_512": {"pf": 1, "programs": 512},
    "chain_pf2_l2_512": {"pf": 2, "l2_prefetch": True, "programs": 512},
    "chain_pf2_8sm": {"pf": 2, "programs_per_sm": 8},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=6144)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gemv_chain.json"))
    a = ap.parse_args(argv)
    from hylo_bench.kernels.gemv import fused_gemv
    from hylo_bench.kernels.gemv.chain import mlp_chain_triton

    dev = torch.device("cuda")
    K, I, L = a.hidden, a.intermediate, a.layers
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = [((torch.rand(K, generator=gen, device=dev) + 0.5).to(torch.bfloat16),
               (torch.randn(2 * I, K, generator=gen, device=dev) / K ** 0.5).to(torch.bfloat16),
               (torch.randn(K, I, generator=gen, device=dev) / I ** 0.5 / L ** 0.5).to(torch.bfloat16))
              for _ in range(L)]
    x0 = torch.randn(1, K, generator=gen, device=dev).to(torch.bfloat16)
    bw, bw_source = copy_bandwidth("cuda")
    weight_bytes = (2 * I * K + K * I) * 2
    bound_us = weight_bytes / bw * 1e6
    env = result_envelope("gemv_chain")
    env.update(hidden=K, intermediate=I, layers=L, weight_bytes_per_layer=weight_bytes,
               copy_bandwidth_gb_per_s=bw / 1e9, bandwidth_source=bw_source)

    def engine(x):
        for nw, gu, dn in layers:
            h = fused_gemv(x, gu, norm_weight=nw, eps=1e-6, backend="triton")
            x = fused_gemv(h, dn, glu=True, residual=x, backend="triton")
        return x

    def chain(kw):
        def run(x):
            for nw, gu, dn in layers:
                x = mlp_chain_triton(x, nw, 1e-6, gu, dn, **kw)
            return x
        return run

    fns = {"engine": engine}
    fns.update({v: chain(VARIANTS[v]) for v in a.variants.split(",") if v})
    graphs, outs, xbuf = {}, {}, x0.clone()
    for name, fn in fns.items():
        try:
            fn(xbuf)
            fn(xbuf)  # the chain's first call reads the occupancy on a small grid
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs[name] = fn(xbuf)
            graphs[name] = g
        except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
            env["records"].append({"variant": name, "status": f"error: {type(e).__name__}: {e}"[:300]})
            print(name, "error", e, flush=True)
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    ref = outs["engine"].float() if "engine" in graphs else None
    errs = {n: ((o.float() - ref).norm() / ref.norm()).item() if ref is not None else None for n, o in outs.items()}
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for r in range(a.rounds):
        for name, g in graphs.items():
            g.replay()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(a.replays):
                g.replay()
            e.record()
            e.synchronize()
            us = s.elapsed_time(e) * 1e3 / a.replays / L
            times[name].append(us)
            env["records"].append({"variant": name, "round": r, "layers": L, "batch_size": 1, "us_per_layer": us,
                                   "bound_us_per_layer": bound_us, "fraction_of_bound": bound_us / us,
                                   "rel_err_vs_engine": errs[name], "status": "ok"})
        write_result(a.out, env)
    env["summary"] = {n: {"median_us_per_layer": statistics.median(t), "fraction_of_bound": bound_us /
                          statistics.median(t)} for n, t in times.items()}
    write_result(a.out, env)
    for n, s in env["summary"].items():
        print(f"{n:20s} {s['median_us_per_layer']:8.2f} us/layer  {s['fraction_of_bound']:.3f} of bound  "
              f"err {errs[n] if errs[n] is None else format(errs[n], '.2e')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
