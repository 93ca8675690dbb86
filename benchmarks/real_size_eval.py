"""`hylo-bench ruler` and `hylo-bench eval` end to end on real-size checkpoints (one GPU), through the CLI.

Builds a Qwen3-1.7B-shaped 7MLA21GDN hybrid (recipe HyLo-Qwen-7MLA21GDN-8K-SFT) and its Qwen3-1.7B-shaped backbone
with random bf16 weights, saves both as checkpoint directories (``save_pretrained``; the demo tokenizer beside them:
prompt lengths are what matter, the models' 151,936-row embeddings cover its 3,148 ids), writes local fixture files
for the 8 lm-eval tasks (``tests/tasks/lmeval_fixtures.py``, the offline ``--data-dir`` layout), then runs the
user's commands in subprocesses, exactly as a user types them:

    hylo-bench ruler --model DIR --lengths 8k,64k --tasks ... --samples N --device cuda --json
    hylo-bench eval DIR --tasks arc_easy,...,gsm8k --data-dir D --limit N --batch-size auto --device cuda --json

``eval`` runs first (once per ``--eval-batch-sizes`` value); its GSM8K generation goes through the native engine
for the hybrid (``--engine auto``).

Random weights score about 0: this checks that the real-size path runs (engine, kernels, lm-eval bridge) and
times it. Records: one per (model, command) with ``seconds``, ``status`` (ok | error | timeout), the exit code
and the JSON the command printed. Writes benchmarks/results/real_size_eval.json after every command.
Usage (H200): python benchmarks/real_size_eval.py --budget-s 420
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from _common import result_envelope, write_result  # noqa: E402

RECIPE = "HyLo-Qwen-7MLA21GDN-8K-SFT"
EVAL_TASKS = "arc_easy,arc_challenge,hellaswag,openbookqa,piqa,race,winogrande,gsm8k"


def save_checkpoint(spec: str, out: Path, device: str) -> dict:
    """Random-weight build of ``spec`` (recipe or ``backbone:<recipe>``) saved to ``out`` with the demo tokenizer."""
    from hylo_bench.models.checkpoint import demo_teacher_dir
    from hylo_bench.serving.build import build_model

    t0 = time.perf_counter()
    model, info = build_model(spec, device, torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(out)
    for f in Path(demo_teacher_dir()).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    info.pop("config", None)
    return {**info, "save_s": round(time.perf_counter() - t0, 1),
            "checkpoint_gib": round(sum(p.stat().st_size for p in out.iterdir()) / 2**30, 3)}


def flat_scores(out: dict | None) -> dict:
    """Flat record fields from a command's ``--json`` object: ``ruler_mean_<length>`` (0-100) for ruler,
    ``<task>_<metric>`` (0-100) for eval."""
    if not out:
        return {}
    if "mean" in out:
        return {f"ruler_mean_{length}": v for length, v in out["mean"].items()}
    return {f"{task}_{metric}": v for task, ms in out.get("scores", {}).items() for metric, v in ms.items()}


def run_cli(args: list[str], timeout_s: float) -> dict:
    """Run ``python -m hylo_bench ARGS``; the JSON object it prints (last line starting with '{') and timings."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "hylo_bench", *args], capture_output=True, text=True,
                           timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        print(f"{' '.join(args[:3])}: timeout; stderr tail:\n{err[-2000:]}", flush=True)
        return {"status": "timeout", "seconds": round(time.perf_counter() - t0, 1), "stderr_tail": err[-1500:]}
    secs = round(time.perf_counter() - t0, 1)
    out = None
    text = p.stdout.strip()
    start = text.find("{")
    if start >= 0:
        try:
            out = json.loads(text[start:])
        except json.JSONDecodeError:
            out = None
    rec = {"status": "ok" if p.returncode == 0 else "error", "exit_code": p.returncode, "seconds": secs,
           **flat_scores(out)}
    if p.returncode != 0:
        rec["stderr_tail"] = p.stderr[-1500:]
    print(f"{' '.join(args[:3])}: exit {p.returncode} in {secs} s", flush=True)
    if p.returncode != 0:
        print(p.stderr[-3000:], flush=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/real-size-eval"))
    ap.add_argument("--lengths", default="8k,64k")
    ap.add_argument("--tasks", default="niah_single_1,niah_multikey_1,niah_multivalue,ruler_vt,ruler_cwe,ruler_fwe")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--eval-limit", type=int, default=8)
    ap.add_argument("--models", default="hybrid,transformer")
    ap.add_argument("--eval-batch-sizes", default="auto", help="one eval run per value (N or auto), before ruler")
    ap.add_argument("--commands", default="eval,ruler", help="which CLI commands to run per model")
    ap.add_argument("--eval-engine", default="auto", help="generate_until engine of eval: auto | generate | native")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--smoke", action="store_true", help="CPU, the demo model only, 1K, tiny limits: checks the "
                    "script's logic.")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "real_size_eval.json")
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.lengths, args.samples, args.eval_limit, args.models = "1k", 1, 2, "hybrid"
        args.eval_batch_sizes = "4"  # auto on CPU would probe 64 x 8192-token forwards for generate()
    from tests.tasks.lmeval_fixtures import write_fixtures

    os.environ.setdefault("HYLO_BENCH_DB", str(args.work / "store.sqlite"))
    doc = result_envelope("real_size_eval")
    doc.update(recipe=RECIPE, ruler_lengths=args.lengths, ruler_tasks=args.tasks, ruler_samples=args.samples,
               eval_tasks=EVAL_TASKS, eval_limit=args.eval_limit,
               note="random bf16 weights: scores ~0; the point is that the real-size CLI path runs, and its time")
    data = write_fixtures(args.work / "lm-eval-data", num_rows=args.eval_limit)
    specs = {"hybrid": "demo" if args.smoke else RECIPE, "transformer": f"backbone:{RECIPE}"}
    for name in args.models.split(","):
        ckpt = args.work / name
        info = save_checkpoint(specs[name], ckpt, device)
        print(f"{name}: {info}", flush=True)
        commands = [("eval", ["eval", str(ckpt), "--tasks", EVAL_TASKS, "--data-dir", str(data), "--limit",
                              str(args.eval_limit), "--batch-size", bs, "--engine", args.eval_engine, "--device",
                              device, "--json", "--results-dir", str(args.work / "results")])
                    for bs in args.eval_batch_sizes.split(",")]
        commands.append(("ruler", ["ruler", "--model", str(ckpt), "--lengths", args.lengths, "--tasks", args.tasks,
                                   "--samples", str(args.samples), "--device", device, "--json", "--results-dir",
                                   str(args.work / "results")]))
        commands = [(cmd, argv) for cmd, argv in commands if cmd in args.commands.split(",")]
        for cmd, argv in commands:
            left = args.budget_s - (time.perf_counter() - t_start)
            rec = {"model": info["name"], "layout": info["layout"], "kind": info["kind"], "command": cmd,
                   "checkpoint_gib": info["checkpoint_gib"], "argv": " ".join(["hylo-bench", *argv])}
            if left < 30:
                rec.update(status="skipped_time_budget")
            else:
                rec.update(run_cli(argv, left))
            doc["records"].append(rec)
            write_result(args.out, doc)
        shutil.rmtree(ckpt, ignore_errors=True)
    print(f"done in {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
