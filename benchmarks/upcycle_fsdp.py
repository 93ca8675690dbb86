"""FSDP2 distillation at long context: Qwen3-8B-shaped teacher -> Qwen3-1.7B-shaped 7MLA21GDN student.

Random weights built from configs on the GPU (no downloads; speed and memory do not depend on weight values).
Each point (n_gpus, seq_len) runs in its own ``torchrun --nproc-per-node n_gpus`` child, which trains through
the real stage loop (``hylo_bench.upcycle.train.trainer.train_stage`` with ``dist_ctx``: FSDP2 full shard of
student and teacher, bf16 compute over fp32 master weights, activation checkpointing per layer, the chunked
hidden-state KL, teacher under no_grad), one sequence of ``seq_len`` tokens per GPU per step. Each point's peak
memory (largest over its GPUs), tokens/s (median of the steps after the first) and MFU, or an ``oom`` /
``failed`` / ``timeout`` status, becomes one record of ``benchmarks/results/upcycle_fsdp.json``.

MFU = (6 N_s + 2 N_t + attention) FLOPs per token x tokens/s / (n_gpus x 989 TFLOP/s), where N are the matmul
parameters (lm_heads included, embeddings excluded) and attention adds the causal score + value FLOPs of the
student's MLA layers (forward + backward, x3) and of every teacher layer (forward); recomputation by activation
checkpointing is not counted (MFU, not HFU). PaLM (arXiv 2204.02311) App. B.

Usage (2 x H200; one command, under 10 minutes for the three default points)::

    torchrun --nproc-per-node 2 benchmarks/upcycle_fsdp.py          # 2x64K, 1x64K, 2x128K
    python benchmarks/upcycle_fsdp.py --seq-len 65536 --n-gpus 1     # plain python works too
    python benchmarks/upcycle_fsdp.py --tiny --n-gpus 2              # CPU smoke test (gloo, tiny shapes)

Under an outer ``torchrun`` only its rank 0 drives (the other ranks exit at once); the children get a clean
environment and their own rendezvous.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

H200_BF16_PEAK_FLOPS = 989e12  # dense bf16, vendor datasheet (H100/H200 SXM)
QWEN3 = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
             head_dim=128, num_key_value_heads=8, hidden_act="silu", bos_token_id=0, eos_token_id=1)
SHAPES = {
    "student": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                    tie_word_embeddings=True),  # Qwen3-1.7B
    "teacher": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                    tie_word_embeddings=False),  # Qwen3-8B
}
MLA_LAYERS = [1, 5, 9, 13, 17, 21, 25]  # 7MLA21GDN (training-recipe.md §3.3, HyLo-Qwen-7MLA21GDN)
TINY_QWEN3 = dict(vocab_size=512, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=4096,
                  head_dim=16, num_key_value_heads=2, hidden_act="silu", bos_token_id=0, eos_token_id=1)
TINY_SHAPES = {
    "student": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    tie_word_embeddings=True),
    "teacher": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                    tie_word_embeddings=False),
}
TINY_MLA_LAYERS = [1, 3]
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


# ----------------------------------------------------------------------------------------------------------------
# child: one point, one rank


def build_models(tiny: bool, device: str):
    """(student HyLoForCausalLM fp32, teacher Qwen3ForCausalLM bf16 on GPU / fp32 on CPU), random weights."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hylo_bench.config.student import hybrid_config_for
    from hylo_bench.models.hybrid import HyLoForCausalLM

    base, shapes, mla = (TINY_QWEN3, TINY_SHAPES, TINY_MLA_LAYERS) if tiny else (QWEN3, SHAPES, MLA_LAYERS)
    torch.manual_seed(0)
    with torch.device(device):
        student = HyLoForCausalLM(hybrid_config_for(Qwen3Config(**base, **shapes["student"]), mla, "gdn"))
        teacher = Qwen3ForCausalLM(Qwen3Config(**base, **shapes["teacher"]))
    teacher = teacher.to(torch.bfloat16 if device.startswith("cuda") else torch.float32).eval()
    teacher.requires_grad_(False)
    return student.float(), teacher


def flops_per_token(student, teacher, seq_len: int) -> tuple[float, float]:
    """(model FLOPs per trained token incl. attention, the same without attention) -- see the module docstring."""
    def matmul_params(m):
        emb = m.model.embed_tokens.weight
        return sum(p.numel() for p in m.parameters() if p is not emb)

    params_only = 6.0 * matmul_params(student) + 2.0 * matmul_params(teacher)
    sc, tc = student.config, teacher.config
    # causal attention per token, forward: QK^T and PV over T/2 keys on average -> 2 * (T/2) * (d_qk + d_v) * heads
    s_attn = seq_len * sc.num_attention_heads * (sc.qk_nope_head_dim + sc.qk_rope_head_dim + sc.v_head_dim)
    t_attn = seq_len * tc.num_attention_heads * 2 * tc.head_dim
    attn = 3.0 * len(sc.mla_layers) * s_attn + 1.0 * tc.num_hidden_layers * t_attn
    return params_only + attn, params_only


PROFILE_GROUPS = (("prof_attention_s", ("flash", "fmha", "attention")),
                  ("prof_gdn_s", ("chunk_", "gated_delta", "tilelang", "recompute_w_u", "wy_", "solve_tril",
                                  "l2norm", "kernel_kernel")),
                  ("prof_matmul_s", ("gemm", "sm90", "xmma", "cutlass", "gemv", "splitk")),
                  ("prof_nccl_s", ("nccl",)),
                  ("prof_optimizer_s", ("multi_tensor", "adam", "foreach")))


def profile_breakdown(prof, device_type: str) -> dict:
    """Device seconds of the profiled optimizer step by kernel group (first matching group; rest in
    ``prof_other_s``) and the summed kernel time ``prof_kernel_s``."""
    out = {k: 0.0 for k, _ in PROFILE_GROUPS} | {"prof_other_s": 0.0, "prof_kernel_s": 0.0}
    if device_type != "cuda":
        return out
    import torch

    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = e.time_range.elapsed_us() / 1e6
        name = e.name.lower()
        key = next((k for k, keys in PROFILE_GROUPS if any(s in name for s in keys)), "prof_other_s")
        out[key] += t
        out["prof_kernel_s"] += t
    return out


def child_main(args) -> None:
    """Run one point as one rank of a torchrun job; rank 0 writes the point's record to ``args.record``."""
    import torch

    from hylo_bench.upcycle.stages import Stage
    from hylo_bench.upcycle.train import distributed as dist_utils
    from hylo_bench.upcycle.train.trainer import StageOptions, train_stage

    ctx = dist_utils.init_distributed("cpu" if args.tiny else "cuda")
    if ctx is None:
        raise SystemExit("--child runs under torchrun only")
    record = {"seq_len": args.seq_len, "n_gpus": ctx.world_size, "backend": ctx.backend, "steps": args.steps,
              "activation_checkpointing": not args.no_activation_checkpointing, "kl_chunk_size": args.kl_chunk_size,
              "grad_accum": args.grad_accum, "compile": args.compile}
    dev = torch.device(ctx.device)
    if dev.type == "cuda":
        from hylo_bench.kernels.gated_delta import select_gdn_backend

        record["gdn_backend"], record["gdn_backend_reason"] = select_gdn_backend(dev, True, dtype=torch.bfloat16)
        print(f"GDN backend: {record['gdn_backend']} ({record['gdn_backend_reason']})", flush=True)
    prof = None
    if args.profile_table and ctx.is_main and args.steps >= 2:
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else []),
                       schedule=schedule(wait=1, warmup=0, active=1, repeat=1), record_shapes=True)
    try:
        student, teacher = build_models(args.tiny, ctx.device)
        fpt, fpt_params = flops_per_token(student, teacher, args.seq_len)
        n_student = sum(p.numel() for p in student.parameters())
        student.model.gradient_checkpointing = not args.no_activation_checkpointing
        dist_utils.shard_model(student, ctx, mixed_precision=dev.type == "cuda")
        dist_utils.shard_model(teacher, ctx, mixed_precision=False)
        if args.compile:
            from hylo_bench.upcycle.train.compile import compile_decoder_layers

            compile_decoder_layers(student, teacher)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        vocab = teacher.config.vocab_size
        gen = torch.Generator().manual_seed(1)
        per_step = ctx.world_size * args.grad_accum
        windows = torch.randint(2, vocab, (args.steps * per_step, args.seq_len), generator=gen)
        stage = Stage(kind="kd", seq_len_tokens=args.seq_len, token_budget=windows.numel())
        opts = StageOptions(lr=1e-5, batch_size=1, grad_accum=per_step, kl_chunk_size=args.kl_chunk_size,
                            autocast_dtype=torch.bfloat16 if dev.type == "cuda" else None, save_every=10 ** 9)
        if prof is not None:
            prof.start()
        with tempfile.TemporaryDirectory() as tmp:
            res = train_stage(student, teacher, stage, windows, opts, Path(tmp) / "resume_dcp", dist_ctx=ctx,
                              on_log=(lambda _r: prof.step()) if prof is not None else None)
        if prof is not None:
            prof.stop()
            record.update(profile_breakdown(prof, dev.type))
            args.profile_table.write_text(prof.key_averages().table(
                sort_by="self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total", row_limit=45,
                max_name_column_width=90) + "\n\nmatmuls by input shape:\n" + prof.key_averages(
                    group_by_input_shape=True).table(sort_by="cuda_time_total" if dev.type == "cuda" else
                                                     "cpu_time_total", row_limit=30, max_name_column_width=40,
                                                     max_shapes_column_width=80))
        tps = [r["tokens_per_s"] for r in res.losses]
        tps = statistics.median(tps[1:] if len(tps) > 1 else tps)  # the first step carries compile / autotune
        peak = res.peak_memory_gib
        record.update(status="ok", peak_memory_gib=peak, tokens_per_s=tps,
                      mfu=fpt * tps / (ctx.world_size * H200_BF16_PEAK_FLOPS),
                      mfu_params_only=fpt_params * tps / (ctx.world_size * H200_BF16_PEAK_FLOPS),
                      step_time_s_first=round(args.seq_len * per_step / res.losses[0]["tokens_per_s"], 3),
                      step_time_s_last=round(args.seq_len * per_step / res.losses[-1]["tokens_per_s"], 3),
                      loss_first=res.losses[0]["loss"], loss_last=res.losses[-1]["loss"], student_params=n_student,
                      flops_per_token=fpt)
    except torch.OutOfMemoryError as e:  # this rank stops; torchrun then stops the others
        peak = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else None
        record.update(status="oom", peak_memory_gib=peak, tokens_per_s=None, mfu=None, error=str(e)[:500])
        Path(f"{args.record}.rank{ctx.rank}").write_text(json.dumps(record))
        os._exit(3)
    if ctx.is_main:
        Path(args.record).write_text(json.dumps(record))
    dist_utils.shutdown()


# ----------------------------------------------------------------------------------------------------------------
# driver: one child per point, records gathered into the results JSON


def run_point(n_gpus: int, seq_len: int, args, timeout_s: float) -> dict:
    """Launch one point as ``torchrun --nproc-per-node n_gpus`` and turn its outcome into a record."""
    with tempfile.TemporaryDirectory() as tmp:
        rec_path = Path(tmp) / "record.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n_gpus}",
               str(Path(__file__).resolve()), "--child", "--seq-len", str(seq_len), "--steps", str(args.steps),
               "--kl-chunk-size", str(args.kl_chunk_size), "--grad-accum", str(args.grad_accum),
               "--record", str(rec_path)] + (["--tiny"] if args.tiny else []) + \
            (["--no-activation-checkpointing"] if args.no_activation_checkpointing else []) + \
            (["--compile"] if args.compile else []) + \
            (["--profile-table", str(args.profile_table)] if args.profile_table else [])
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV} | {"PYTHONUNBUFFERED": "1"}
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        t0 = time.time()
        print(f"== point: {n_gpus} GPU(s) x {seq_len} tokens (timeout {timeout_s:.0f} s)", flush=True)
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout_s, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True, check=False)
            rc, out = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as e:
            rc, out = 124, (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or "")
        print(out[-4000:], flush=True)
        wall = time.time() - t0
        ooms = sorted(Path(tmp).glob("record.json.rank*"))
        if rec_path.is_file() and rc == 0:
            rec = json.loads(rec_path.read_text())
        elif ooms or "OutOfMemoryError" in out or "CUDA out of memory" in out:
            rec = json.loads(ooms[0].read_text()) if ooms else {"status": "oom"}
            rec["status"] = "oom"
        else:
            rec = {"status": "timeout" if rc == 124 else "failed", "returncode": rc, "error": out[-1500:]}
    base = {"seq_len": seq_len, "n_gpus": n_gpus, "peak_memory_gib": None, "tokens_per_s": None, "mfu": None}
    return base | rec | {"seq_len": seq_len, "n_gpus": n_gpus, "point_wall_s": round(wall, 1)}


def default_points(args) -> list[tuple[int, int]]:
    n = args.n_gpus
    pts = [(g, s) for s in args.seq_len for g in n]
    for s in args.one_gpu_seq_len:
        if (1, s) not in pts and max(n) > 1:
            pts.append((1, s))
    return sorted(pts, key=lambda p: (p[1], -p[0]))  # short first: 2x64K, 1x64K, then 2x128K


def driver_main(args) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return  # under an outer torchrun only rank 0 drives
    from _common import result_envelope, write_result

    points = default_points(args)
    t_start, records = time.time(), []
    for n_gpus, seq_len in points:
        left = args.budget_s - (time.time() - t_start)
        if left < 30:
            records.append({"seq_len": seq_len, "n_gpus": n_gpus, "peak_memory_gib": None, "tokens_per_s": None,
                            "mfu": None, "status": "skipped", "error": f"--budget-s {args.budget_s} spent"})
            continue
        records.append(run_point(n_gpus, seq_len, args, min(args.point_timeout_s, left)))
        print(json.dumps({k: records[-1].get(k) for k in ("n_gpus", "seq_len", "status", "peak_memory_gib",
                                                            "tokens_per_s", "mfu")}), flush=True)
    env = result_envelope("upcycle_fsdp")  # after the children: the driver never held GPU memory while they ran
    env.update(student="Qwen3-1.7B-shaped 7MLA21GDN (MLA at 1,5,...,25)" if not args.tiny else "tiny 2MLA2GDN",
               teacher="Qwen3-8B-shaped" if not args.tiny else "tiny Qwen3", mla_layers=MLA_LAYERS,
               method="FSDP2 fully_shard (per decoder layer + root) for student and teacher, bf16 compute over fp32 "
                      "master weights (student), activation checkpointing per layer, chunked hidden-state KL, "
                      "one sequence per GPU per step",
               peak_flops_per_gpu=H200_BF16_PEAK_FLOPS, tiny=args.tiny,
               records=[{k: v for k, v in r.items() if v is not None} for r in records])  # absent = not measured
    out = args.out_json if not args.tiny or args.out_json != DEFAULT_OUT else Path(tempfile.gettempdir()) / \
        "upcycle_fsdp_tiny.json"
    write_result(out, env)
    print(f"wrote {out}")
    sys.exit(0 if all(r["status"] in ("ok", "oom") for r in records) else 1)


DEFAULT_OUT = Path(__file__).parent / "results" / "upcycle_fsdp.json"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, nargs="+", default=None,
                    help="tokens per sequence (default 65536 131072; --tiny: 256)")
    ap.add_argument("--n-gpus", type=int, nargs="+", default=None,
                    help="GPUs per point (default: the outer torchrun's world size, else all visible GPUs)")
    ap.add_argument("--one-gpu-seq-len", type=int, nargs="*", default=None,
                    help="also run these lengths on 1 GPU when --n-gpus > 1 (default 65536; --tiny: none)")
    ap.add_argument("--steps", type=int, default=2,
                    help="optimizer steps per point; the first (compile, autotune) is not timed")
    ap.add_argument("--kl-chunk-size", type=int, default=2048)
    ap.add_argument("--grad-accum", type=int, default=1, help="sequences per GPU per optimizer step")
    ap.add_argument("--no-activation-checkpointing", action="store_true",
                    help="keep every activation (short contexts: no recomputation)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each decoder layer of student and teacher (upcycle/train/compile.py)")
    ap.add_argument("--profile-table", type=Path, default=None,
                    help="profile the second optimizer step (rank 0): kernel table to this file, groups in the record")
    ap.add_argument("--budget-s", type=float, default=560, help="stop starting points after this many seconds")
    ap.add_argument("--point-timeout-s", type=float, default=400, help="stop a point after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU with gloo (smoke test)")
    ap.add_argument("--out-json", type=Path, default=DEFAULT_OUT,
                    help="results file (--tiny writes to the temp dir unless given)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.seq_len = args.seq_len[0]
        return args
    args.seq_len = args.seq_len or ([256] if args.tiny else [65536, 131072])
    if args.n_gpus is None:
        world = int(os.environ.get("WORLD_SIZE", "0"))
        if not world and not args.tiny:
            import torch

            world = torch.cuda.device_count()  # counts devices (NVML); creates no CUDA context
        args.n_gpus = [max(1, world)]
    if args.one_gpu_seq_len is None:
        args.one_gpu_seq_len = [] if args.tiny else [65536]
    return args


if __name__ == "__main__":
    a = parse_args()
    child_main(a) if a.child else driver_main(a)
