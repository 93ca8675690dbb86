"""fla's intra-card split of the GDN chunked prefill (``FLA_INTRACARD_CP``) at the 7MLA21GDN GDN shapes.

The state pass of fla's chunked gated delta rule (``chunk_gated_delta_rule_fwd_kernel_h``) walks a sequence's
64-token chunks one after another, one program per (head, value block): for H = 6 heads it leaves most of the
GPU idle, and it is the largest GDN kernel of a 64K prefill (``prefill_shapes_glue.json``). fla 0.6.0 can split a
long sequence into sub-sequences, summarise each one's effect on the state in parallel (a float32 [K, V + K]
summary per sub-sequence and head), chain the summaries, then run the sub-sequences in parallel from their
reconstructed initial states (``fla/ops/common/intracard_cp.py``). It acts only under ``torch.inference_mode`` on
varlen calls (``cu_seqlens``), and splits only calls of at least three sub-sequences (8,192 tokens each at these
shapes on a 132-SM GPU): a 16K prefill chunk is never split, a 32K one is.

One call per record: ``chunk_gated_delta_rule`` over q, k [1, T, 6, 256], v [1, T, 6, 512] bf16, float32 log decay
g and beta, a float32 initial state and ``cu_seqlens = [0, T]``, as the engine's prefill of one chunk calls it.
Records: ``seq_len`` (T), ``intracard`` (on|off), ``time_s`` (median of ``--reps`` CUDA-event timed calls after
two warm-up calls, which pay the autotuning), ``first_call_s`` (the first call, autotuning included),
``max_abs_diff_o`` and ``max_rel_diff_state`` (on vs off: the output's largest absolute difference and the final
state's largest difference over its largest magnitude), ``status``.

    python benchmarks/gdn_intracard.py --tokens 16384,32768,65536 --out $OUT/gdn_intracard.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import call_times, result_envelope, write_result  # noqa: E402

H, K, V = 6, 256, 512  # the Qwen3-1.7B-shaped 7MLA21GDN recipe's GDN heads and head dims


def _inputs(T: int, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, V)
    # log decay per token in (-inf, 0): the module's -exp(A_log) * softplus(a + dt_bias), here with exp(A_log) = 0.5
    g = -torch.nn.functional.softplus(rnd(1, T, H, dtype=torch.float32)) * 0.5
    beta = torch.sigmoid(rnd(1, T, H, dtype=torch.float32)).to(torch.bfloat16)
    h0 = rnd(1, H, K, V, dtype=torch.float32) * 0.1
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0,
                cu_seqlens=torch.tensor([0, T], device="cuda", dtype=torch.int64))


def _call(inp: dict, intracard: bool):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    os.environ["FLA_INTRACARD_CP"] = "1" if intracard else "0"  # fla reads it at every call
    return chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                  initial_state=inp["initial_state"], output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=inp["cu_seqlens"])


def _time(inp: dict, intracard: bool, reps: int) -> tuple[float, float, tuple]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = _call(inp, intracard)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    _call(inp, intracard)
    times = call_times(lambda: _call(inp, intracard), reps, cuda=True)
    return statistics.median(times), first, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,32768,65536")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gdn_intracard.json"))
    args = ap.parse_args()
    doc = result_envelope("gdn_intracard")
    doc.update(shapes={"heads": H, "head_k_dim": K, "head_v_dim": V},
               max_splits=int(os.environ.get("FLA_INTRACARD_MAX_SPLITS", 32)))
    with torch.inference_mode():
        for T in [int(t) for t in args.tokens.split(",")]:
            inp = _inputs(T)
            ref = None
            for intracard in (False, True):  # off first: the reference of the on point
                rec = {"seq_len": T, "intracard": "on" if intracard else "off"}
                try:
                    t, first, (o, state) = _time(inp, intracard, args.reps)
                    rec.update(time_s=round(t, 6), first_call_s=round(first, 3), status="ok")
                    if ref is None:
                        ref = (o.float(), state.float())
                    else:
                        rec.update(max_abs_diff_o=float((o.float() - ref[0]).abs().max()),
                                   max_rel_diff_state=float((state.float() - ref[1]).abs().max()
                                                            / ref[1].abs().max().clamp_min(1e-30)))
                except Exception as e:  # noqa: BLE001 - record the failure, keep the other points
                    rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
                doc["records"].append(rec)
                write_result(Path(args.out), doc)
                print(rec, flush=True)
            del inp, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
