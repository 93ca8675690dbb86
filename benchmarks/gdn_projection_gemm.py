"""The GDN prefill's six input projections as GEMMs, per way of launching them (docs/kernels.md §3.7).

A GDN layer of the Qwen3-1.7B-shaped 7MLA21GDN layout projects x [T, 2048] to q, k (6 x 256 each), v, the output
gate g (6 x 512 each) and a, b (6 each): 9,228 output columns. The engine's merged weight holds them as rows
q | k | v | a | b | g. Variants, each over the same weight (views of its rows, or a padded copy):

- ``six``: one GEMM per projection (the module's forward, what the engine's prefill runs);
- ``merged``: one GEMM of all 9,228 columns (git be6ad08..a91c418; its output rows are 18,456 bytes, not a multiple
  of 16);
- ``aligned3``: q | k | v (6,144 columns), a | b (12) and g (3,072) as three GEMMs, each output row 16-byte aligned
  except the 12-column one;
- ``padded``: one GEMM over the rows reordered q | k | v | g | a | b and zero-padded to a multiple of 64 columns
  (9,280): aligned rows, 0.6 % more FLOPs.

Records: ``variant``, ``seq_len`` (T, tokens per call), ``time_s`` per call (median of ``--reps`` CUDA-event timed
calls after a warm-up), ``tflop_per_s`` (the 2 T D 9,228 useful FLOPs over that time), ``gemms`` per call.
``--tiny`` runs small shapes on CPU (a smoke test of the script, not a timing).

    python benchmarks/gdn_projection_gemm.py --tokens 8192,16384 --out $OUT/gdn_projection_gemm.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import call_times, result_envelope, write_result  # noqa: E402

VARIANTS = ("six", "merged", "aligned3", "padded")


def layout(D: int, H: int, K: int, Vd: int) -> dict[str, int]:
    """Output columns per projection, in the merged weight's row order (q, k, v, a, b, g)."""
    return {"q": H * K, "k": H * K, "v": H * Vd, "a": H, "b": H, "g": H * Vd}


def make_variant(name: str, weight: torch.Tensor, sizes: dict[str, int]):
    """(fn(x) -> {projection: [T, n] tensor}, GEMMs per call) for variant ``name`` over the merged ``weight``
    [sum(sizes), D] (rows in ``sizes``' order). Every variant returns the same six projections.

    Raises:
        ValueError: an unknown variant.
    """
    names = list(sizes)
    offsets, row = {}, 0
    for n in names:
        offsets[n] = (row, row + sizes[n])
        row += sizes[n]
    rows = {n: weight[a:b] for n, (a, b) in offsets.items()}
    if name == "six":
        return (lambda x: {n: F.linear(x, w) for n, w in rows.items()}), 6
    if name == "merged":
        def merged(x):
            y = F.linear(x, weight)
            return {n: y[:, a:b] for n, (a, b) in offsets.items()}
        return merged, 1
    if name == "aligned3":
        qkv_end, ab_end = offsets["v"][1], offsets["b"][1]
        w_qkv, w_ab, w_g = weight[:qkv_end], weight[qkv_end:ab_end], weight[ab_end:]

        def aligned3(x):
            qkv, ab, g = F.linear(x, w_qkv), F.linear(x, w_ab), F.linear(x, w_g)
            q_end, k_end, a_end = offsets["q"][1], offsets["k"][1], offsets["a"][1] - qkv_end
            return {"q": qkv[:, :q_end], "k": qkv[:, q_end:k_end], "v": qkv[:, k_end:], "a": ab[:, :a_end],
                    "b": ab[:, a_end:], "g": g}
        return aligned3, 3
    if name == "padded":
        order = ["q", "k", "v", "g", "a", "b"]
        n_cols = sum(sizes.values())
        padded = weight.new_zeros(-(-n_cols // 64) * 64, weight.shape[1])
        pos, at = {}, 0
        for n in order:
            padded[at:at + sizes[n]] = rows[n]
            pos[n] = (at, at + sizes[n])
            at += sizes[n]

        def pad(x):
            y = F.linear(x, padded)
            return {n: y[:, a:b] for n, (a, b) in pos.items()}
        return pad, 1
    raise ValueError(f"unknown variant {name!r}; expected one of {VARIANTS}")


def time_call(fn, x: torch.Tensor, reps: int) -> float:
    """Median seconds of ``reps`` calls after two warm-up calls (CUDA events on CUDA, wall clock on CPU)."""
    for _ in range(2):
        fn(x)
    return statistics.median(call_times(lambda: fn(x), reps, cuda=x.is_cuda))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8192,16384", help="T per call, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="small shapes on CPU (smoke test)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gdn_projection_gemm.json")
    args = ap.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    D, H, K, Vd = (64, 2, 16, 32) if args.tiny else (2048, 6, 256, 512)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    sizes = layout(D, H, K, Vd)
    g = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(sum(sizes.values()), D, device=device, dtype=dtype, generator=g) * D ** -0.5
    doc = result_envelope("gdn_projection_gemm")
    doc.update(hidden_size=D, gdn_heads=H, head_k_dim=K, head_v_dim=Vd, output_columns=sum(sizes.values()))
    tokens = [int(t) for t in args.tokens.split(",")] if not args.tiny else [48]
    with torch.inference_mode():
        for T in tokens:
            x = torch.randn(T, D, device=device, dtype=dtype, generator=g)
            for name in args.variants.split(","):
                fn, gemms = make_variant(name, weight, sizes)
                secs = time_call(fn, x, 3 if args.tiny else args.reps)
                flops = 2 * T * D * sum(sizes.values())
                rec = {"benchmark": "gdn_projection_gemm", "variant": name, "seq_len": T, "gemms": gemms,
                       "time_s": secs, "tflop_per_s": flops / secs / 1e12, "status": "ok"}
                doc["records"].append(rec)
                write_result(args.out, doc)
                print(rec, flush=True)


if __name__ == "__main__":
    main()
