"""fla's GDN state pass at the 7MLA21GDN prefill shapes, per launch configuration, and a whole 64K prefill per
configuration: does the pass gain from more programs?

fla 0.6.0's ``chunk_gated_delta_rule_fwd_kernel_h_blockdim64`` walks a sequence's 64-token chunks one after another
in one program per (head, block of BV value columns): 6 heads x 512 / BV programs for the Qwen3-1.7B-shaped
7MLA21GDN (K = 256, V = 512), 48 at BV = 64 and 96 at BV = 32 (its autotuner's two choices on Hopper) on the H200's
132 SMs. In the H200 prefill profile it took 53 ms of a 64K prompt's 0.73 s (``prefill_shapes_glue.json``). The
configurations are set through fla's own config cache, read on every call in ``FLA_CACHE_MODE=always`` (a
``{kernel}.json`` with a ``default_config`` under ``$FLA_CONFIG_DIR``, here a new temporary directory;
``fla/ops/utils/cache.py``), so nothing of fla is patched; both variables must be set before fla is imported, which
this script does.

Records (``benchmarks/results/gdn_state_pass.json``, rewritten after each):

- ``benchmark: gdn_state_pass``: the pass alone (``chunk_gated_delta_rule_fwd_h``, bf16, one sequence of
  ``seq_len`` tokens with an initial state and its final state, as the engine's chunked prefill calls it), per
  ``config`` ("autotune", or BV / num_warps / num_stages): ``time_s`` (median of ``--reps`` CUDA-event timed calls
  after one untimed), ``min_time_s``, ``max_abs_diff`` against the autotuned result (any config must give the same
  states), ``programs``. (fla's other way to more programs, its intra-card split, is ``gdn_intracard.py``'s.)
- ``benchmark: gdn_state_pass_prefill``: a whole ``--prefill-tokens`` prefill of random tokens into row 0 of a
  32-slot engine (``Engine.prefill_row``, 16K chunks) per config (the autotuned one and the ``--top`` fastest of
  the pass alone), and two prompts at once on two streams (``prefill_rows_shared``, as RULER's continuous batching
  runs them): ``ttft_s`` (median of 5), ``two_streams_per_prompt_s`` (median of 3, over 2).

Usage (one GPU, about 5 minutes with the first compiles):
    python benchmarks/gdn_state_pass.py --out $OUT/gdn_state_pass.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

KERNEL = "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"
# the 7MLA21GDN layer: 6 heads, K 256, V 512 (gdn_head_dim 256, gdn_expand_v 2)
HEADS, K_DIM, V_DIM = 6, 256, 512
CONFIGS = [(bv, warps, stages) for bv in (16, 32, 64) for warps in (2, 4) for stages in (2, 3, 4)]


def config_json(bv: int, num_warps: int, num_stages: int) -> dict:
    """fla's config-cache file body for one launch configuration (``KernelConfigFile.default_config``)."""
    return {"default_config": {"kwargs": {"BV": bv}, "num_warps": num_warps, "num_stages": num_stages,
                               "num_ctas": 1}}


def programs(bv: int) -> int:
    """Programs of one pass over one sequence: one per (head, block of ``bv`` value columns)."""
    return HEADS * -(-V_DIM // bv)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per call of the pass alone (a prefill chunk)")
    ap.add_argument("--prefill-tokens", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=2, help="configs of the pass alone also timed in a whole prefill")
    ap.add_argument("--budget-s", type=float, default=400.0, help="skip the prefill points after this many seconds")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gdn_state_pass.json")
    args = ap.parse_args(argv)
    # a directory of this run's own: the script writes and deletes the kernel's config file there, so a config dir
    # of the user's (a set $FLA_CONFIG_DIR) is never touched
    config_dir = Path(tempfile.mkdtemp(prefix="fla-configs-"))
    os.environ["FLA_CONFIG_DIR"] = str(config_dir)
    if os.environ.setdefault("FLA_CACHE_MODE", "always") != "always":
        raise SystemExit(f"FLA_CACHE_MODE={os.environ['FLA_CACHE_MODE']!r}: this script needs 'always' (or unset)")
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import call_times, result_envelope, write_result
    from fla.ops.common import chunk_delta_h

    t_start = time.monotonic()
    kernel = getattr(chunk_delta_h, KERNEL)
    config_file = config_dir / f"{KERNEL}.json"
    doc = result_envelope("gdn_state_pass")
    doc.update(kernel=KERNEL, heads=HEADS, k_dim=K_DIM, v_dim=V_DIM)

    def add(rec: dict) -> None:
        doc["records"].append(rec)
        write_result(args.out, doc)
        print(rec, flush=True)

    def use(config: tuple[int, int, int] | None) -> None:
        """Launch with ``config`` from the next call on; None: autotune again."""
        if config is None:
            config_file.unlink(missing_ok=True)
            kernel.cache.clear()  # a file's config stays in the autotuner's cache otherwise
        else:
            config_file.write_text(json.dumps(config_json(*config)))

    def timed(fn, reps: int) -> tuple[float, float]:
        fn()  # compiles (a new config) or autotunes
        times = call_times(fn, reps, cuda=True)
        return statistics.median(times), min(times)

    def inputs(T: int):
        g = torch.Generator(device="cuda").manual_seed(0)
        k = torch.nn.functional.normalize(torch.randn(1, T, HEADS, K_DIM, device="cuda", generator=g), dim=-1)
        w = torch.randn(1, T, HEADS, K_DIM, device="cuda", generator=g) * 0.05
        u = torch.randn(1, T, HEADS, V_DIM, device="cuda", generator=g)
        gates = -(torch.arange(T, device="cuda") % 64 + 1).float().mul(0.01)  # chunk-local cumulative log decays
        h0 = torch.zeros(1, HEADS, K_DIM, V_DIM, device="cuda")
        return k.bfloat16(), w.bfloat16(), u.bfloat16(), gates[None, :, None].expand(1, T, HEADS).contiguous(), h0

    def pass_of(x):
        """The pass over inputs ``x`` (:func:`inputs`) as the engine's prefill calls it."""
        k, w, u, gates, h0 = x
        return lambda: chunk_delta_h.chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=gates, initial_state=h0,
                                                                  output_final_state=True)

    with torch.inference_mode():
        run = pass_of(inputs(args.tokens))
        use(None)
        ref = run()
        med, low = timed(run, args.reps)
        picked = next(iter(kernel.cache.values()), None)
        add({"benchmark": "gdn_state_pass", "config": "autotune", "autotuned": str(picked), "seq_len": args.tokens,
             "time_s": med, "min_time_s": low, "status": "ok"})
        for config in CONFIGS:
            rec = {"benchmark": "gdn_state_pass", "config": "BV={},num_warps={},num_stages={}".format(*config),
                   "bv": config[0], "num_warps": config[1], "num_stages": config[2], "programs": programs(config[0]),
                   "seq_len": args.tokens}
            try:
                use(config)
                out = run()
                diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(out, ref))
                med, low = timed(run, args.reps)
                rec.update(time_s=med, min_time_s=low, max_abs_diff=diff, status="ok")
            except Exception as exc:  # noqa: BLE001 - a config Triton cannot build: record it and go on
                rec.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
            add(rec)
        del run, ref

    from batched_decode import build

    from hylo_bench.decode.engine import Engine

    fastest = sorted((r for r in doc["records"] if r.get("bv") and r["status"] == "ok" and r["max_abs_diff"] < 0.5),
                     key=lambda r: r["time_s"])[: args.top]
    model, _ = build("cuda", torch.bfloat16, False)
    T = args.prefill_tokens
    g = torch.Generator(device="cuda")
    ids = [torch.randint(0, 150000, (1, T), device="cuda", generator=g.manual_seed(s)) for s in (1, 2)]
    engine = Engine(model, 32, T + 64, 16384)

    def one_row() -> None:
        engine.prefill_row(0, ids[0])

    def two_rows() -> None:
        engine.prefill_rows_shared([(0, ids[0], None, ()), (1, ids[1], None, ())])

    def wall(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for config in [None] + [(r["bv"], r["num_warps"], r["num_stages"]) for r in fastest] + [None]:
        rec = {"benchmark": "gdn_state_pass_prefill", "config": "autotune" if config is None else
               "BV={},num_warps={},num_stages={}".format(*config), "seq_len": T, "prefill_chunk": 16384}
        if time.monotonic() - t_start > args.budget_s:
            add(rec | {"status": "skipped_time_budget"})
            continue
        use(config)
        with torch.inference_mode():
            first = wall(one_row)
            one = [wall(one_row) for _ in range(5)]
            two = [wall(two_rows) for _ in range(3)]
        add(rec | {"first_s": first, "ttft_s": statistics.median(one), "two_streams_per_prompt_s":
                   statistics.median(two) / 2, "status": "ok"})
    doc["elapsed_s"] = time.monotonic() - t_start
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
