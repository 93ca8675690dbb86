"""The paper's length finding on one GPU, in one command: an upcycled hybrid keeps long-context ability only up to
the length it was distilled at (HyLo Table 2: the 8K-trained 1B hybrid scores RULER 55.1 at 8K and 0.8 at 64K,
the 64K-trained one 40.8 at 64K).

Plan (every step is a ``hylo-bench`` command; the run recipes are ``benchmarks/mini_reproduction/*.yaml``):

1. ``make-data``: chat-format training data from the shipped book and the teacher (SmolLM2-135M-Instruct): teacher
   answered instructions, long-document rows at 1K / 4K / 8K, decontaminated against the RULER samples below.
2. ``upcycle --recipe ild.yaml --layout auto:6MLA24GDN``: Enhanced-ILD at 1K (the MLA layers placed by
   measurement); ``ild_random``: the same with ``--init random`` on the same layers and steps (the init's worth).
3. From the ILD student (``--init-from``): run S ``short.yaml`` (KD at 1K only) and run L ``staged.yaml`` (KD 1K ->
   4K -> 8K), the same total tokens.
4. ``ruler`` on teacher, S and L: RULER's 11 synthetic tasks, ``--samples`` per task, at 1K, 2K, 4K, 8K and 16K
   (beyond every training length), batched greedy ``generate()``.
5. ``benchmarks/results/mini_reproduction.json`` (one record per model role, task and length, 95 % Wilson
   intervals, plus the training numbers) and ``hylo-bench report`` (its length-generalisation figure).

Independent commands run concurrently (``--jobs``): on one GPU the 135M-parameter models leave it mostly idle.
Results are written as they arrive; a command that fails or runs past ``--budget-s`` is recorded with its status.
``--tiny`` runs the same plan on CPU with a tiny chat teacher (the embedded demo teacher with a ChatML template) and
small lengths (CI).

Usage (H200; the image lacks fla, TileLang, gguf, SQLAlchemy and wonderwords: carry
``../shared/tools/make-gpu-bundle.sh --tilelang``; the GGUF travels in parts; benchmarks/README.md has the calls)::

    hylo-bench make-data --out /tmp/mini_cpu/data --long-tokens 4M ...   # beforehand, on CPU
    python3 benchmarks/mini_reproduction.py --teacher /tmp/smol.gguf --data /tmp/mini/data --budget-s 1380
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks._common import result_envelope, write_result  # noqa: E402

RECIPES = HERE / "mini_reproduction"
TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "ruler_vt", "ruler_cwe", "ruler_fwe"]
ROLES = ("teacher", "short", "staged")
PAPER = {"trained_8k": {8192: 55.1, 16384: 11.9, 32768: 2.4, 65536: 0.8},
         "trained_64k": {8192: 52.5, 16384: 48.3, 32768: 44.5, 65536: 40.8}}
"""HyLo-Llama-4MLA12GDN RULER means by length, trained at 8K and at 64K (paper Table 2)."""
KD_SPEED_OF_ILD = 0.55
KD_STARTUP_S = 150.0
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|bos|>' + m['role'] + '\n' + m['content'] + '<|eos|>\n' }}"
                      "{% endfor %}{% if add_generation_prompt %}{{ '<|bos|>assistant\n' }}{% endif %}")


def wilson(p: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion ``p`` over ``n`` samples, in the same units as ``p`` (0-1)."""
    if n <= 0:
        return (0.0, 1.0)
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


@dataclass
class Job:
    """One ``hylo-bench`` command; starts when ``deps`` have finished ok and ``wait_for`` exists."""

    name: str
    cmd: list[str] | None  # None: built by ``build`` when the job starts
    deps: list[str] = field(default_factory=list)
    wait_for: Path | None = None
    build: object = None
    proc: subprocess.Popen | None = None
    status: str = "pending"  # pending, running, ok, failed, skipped, timeout
    t0: float = 0.0
    seconds: float = 0.0


def run_jobs(jobs: list[Job], logs: Path, max_parallel: int, deadline: float, on_done) -> None:
    """Run the jobs respecting dependencies, at most ``max_parallel`` at a time, until ``deadline``."""
    by = {j.name: j for j in jobs}
    logs.mkdir(parents=True, exist_ok=True)
    while True:
        for j in jobs:
            if j.status == "running" and j.proc.poll() is not None:
                j.status = "ok" if j.proc.returncode == 0 else "failed"
                j.seconds = time.time() - j.t0
                print(f"[{time.strftime('%H:%M:%S')}] {j.name}: {j.status} after {j.seconds:.0f} s", flush=True)
                on_done(j)
        if time.time() > deadline:
            for j in jobs:
                if j.status == "running":
                    j.proc.kill()
                    j.status, j.seconds = "timeout", time.time() - j.t0
                    on_done(j)
                elif j.status == "pending":
                    j.status = "skipped"
            return
        for j in jobs:
            if j.status == "pending" and any(by[d].status in ("failed", "skipped", "timeout") for d in j.deps):
                j.status = "skipped"
                print(f"{j.name}: skipped (a dependency did not finish)", flush=True)
        running = sum(j.status == "running" for j in jobs)
        for j in jobs:
            if running >= max_parallel:
                break
            if j.status != "pending" or any(by[d].status != "ok" for d in j.deps):
                continue
            if j.wait_for is not None and not j.wait_for.exists():
                continue
            cmd = j.cmd if j.cmd is not None else j.build()
            print(f"[{time.strftime('%H:%M:%S')}] start {j.name}: {' '.join(cmd)}", flush=True)
            log = open(logs / f"{j.name}.log", "w")
            j.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
            j.status, j.t0 = "running", time.time()
            running += 1
        if all(j.status not in ("pending", "running") for j in jobs):
            return
        if running == 0:  # nothing runs and nothing could start: what waits for a file will never get it
            for j in jobs:
                if j.status == "pending":
                    j.status = "skipped"
                    print(f"{j.name}: skipped ({j.wait_for} never appeared)", flush=True)
            return
        time.sleep(2)


def steady_tokens_per_s(train_log: Path) -> float:
    """Median tokens/s of a run's steps after its first three (the first ones compile kernels)."""
    rates = [json.loads(line)["tokens_per_s"] for line in train_log.read_text().splitlines() if line.strip()]
    rates = sorted(rates[3:] or rates)
    return float(rates[len(rates) // 2])


def parse_len(text: str) -> int:
    from hylo_bench.config.units import parse_length

    return parse_length(text)


def hb(*args: str) -> list[str]:
    return [sys.executable, "-m", "hylo_bench", *args]


def tiny_teacher(work: Path) -> Path:
    """The demo teacher with a ChatML template over its own special tokens (make-data writes conversations)."""
    from hylo_bench.models.checkpoint import demo_teacher_dir

    d = work / "tiny-teacher"
    if not (d / "config.json").is_file():
        shutil.copytree(demo_teacher_dir(), d, dirs_exist_ok=True)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = TINY_CHAT_TEMPLATE
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return d


def tiny_recipes(work: Path, teacher: Path) -> dict[str, Path]:
    """The three run recipes rewritten for the tiny teacher: its architecture, default dims, small stages."""
    from transformers import AutoConfig

    from hylo_bench.config.student import default_mixer_dims

    c = AutoConfig.from_pretrained(teacher)
    dims = default_mixer_dims(c)
    out = {}
    for name in ("ild", "short", "staged"):
        r = yaml.safe_load((RECIPES / f"{name}.yaml").read_text())
        r["backbone"] = r["teacher"] = str(teacher)
        r["base_architecture"] = {k: getattr(c, k, None) for k in r["base_architecture"]}
        r["base_architecture"]["rope_theta"] = float((getattr(c, "rope_parameters", None) or {}).get("rope_theta",
                                                                                                     1e4))
        r["layout"], r["mla_layers"] = "1MLA3GDN", [1]
        r["mla"].update({k: dims[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                              "v_head_dim")}, num_key_value_heads=c.num_key_value_heads)
        r["gdn"].update(num_heads=dims["gdn_num_heads"], head_dim=dims["gdn_head_dim"])
        for st in r["stages"]:
            st["seq_len_tokens"] = {1024: 256, 4096: 384, 8192: 512}[st["seq_len_tokens"]]
            st["token_budget"] = 2048 if st["kind"] == "ild" else (3072 if name == "short" else 1024)
        r["trained_context_tokens"] = max(st["seq_len_tokens"] for st in r["stages"])
        p = work / "recipes" / f"{name}.yaml"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(yaml.safe_dump(r, sort_keys=False))
        out[name] = p
    return out


def collect(results: Path, roles: dict[str, str]) -> list[dict]:
    """Records (model_role, task, seq_len, score, ci_low, ci_high, n) from the RULER result files, plus the 11-task
    mean per (role, length) as ``task: mean`` (its interval over all its samples)."""
    by_key: dict[tuple[str, str, int], dict] = {}
    for f in sorted(results.glob("ruler-*.json")):
        doc = json.loads(f.read_text())
        role = roles.get(str(doc["model"]["name"]))
        if role is None:
            continue
        for r in doc["records"]:
            by_key[(role, r["task"], int(r["seq_len"]))] = {"score": float(r["score"]), "n": int(r["n"])}
    records = []
    for (role, task, L), v in sorted(by_key.items()):
        lo, hi = wilson(v["score"] / 100, v["n"])
        records.append({"model_role": role, "task": task, "seq_len": L, "score": round(v["score"], 2),
                        "ci_low": round(100 * lo, 2), "ci_high": round(100 * hi, 2), "n": v["n"]})
    for role in ROLES:
        for L in sorted({k[2] for k in by_key if k[0] == role}):
            parts = [v for k, v in by_key.items() if k[0] == role and k[2] == L]
            n = sum(p["n"] for p in parts)
            score = sum(p["score"] for p in parts) / len(parts)
            lo, hi = wilson(score / 100, n)
            records.append({"model_role": role, "task": "mean", "seq_len": L, "score": round(score, 2),
                            "ci_low": round(100 * lo, 2), "ci_high": round(100 * hi, 2), "n": n,
                            "tasks": len(parts)})
    return records


def training_summary(work: Path) -> dict:
    """Per upcycle run: stages (tokens, seconds, tokens/s, peak memory), held-out KL / perplexity, ILD losses."""
    out = {}
    for name in ("ild", "ild_random", "short", "staged"):
        f = work / name / "manifest.json"
        if not f.is_file():
            continue
        m = json.loads(f.read_text())
        stages = []
        for s in m["stages"]:
            secs = s.get("seconds") or 0.0
            stages.append({"name": s["name"], "status": s["status"], "tokens": s.get("tokens_seen", 0),
                           "seconds": round(secs, 1), "tokens_per_s": round(s.get("tokens_seen", 0) / secs)
                           if secs else None, "peak_memory_gib": s.get("peak_memory_gib"),
                           "heldout_after": s.get("heldout_after")})
        out[name] = {"mla_layers": m["hybrid_config"]["mla_layers"], "heldout_init": m.get("heldout_init"),
                     "stages": stages,
                     "losses": [[e["step"], e["loss"]] for s in m["stages"] if s["kind"] == "ild"
                                for e in s.get("losses", [])][:2000]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="smollm2-135m-instruct", help=".gguf file, fetched name or folder")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hylo-mini"))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of the same plan (CI)")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--eval-lengths", default="1k,2k,4k,8k,16k")
    ap.add_argument("--ild-tokens", type=int, default=None, help="override the recipes' ILD budget")
    ap.add_argument("--kd-tokens", type=int, default=None, help="override the KD budget of each run (S and L)")
    ap.add_argument("--batch-tokens", default="16k", help="tokens per optimizer step of every upcycle run (16k: "
                    "two training runs and two RULER runs fit one 141 GB GPU at once)")
    ap.add_argument("--long-tokens", default="4M", help="make-data's long-document tokens per stage length")
    ap.add_argument("--data", type=Path, default=None, help="an earlier make-data folder (its mixture.yaml) instead "
                    "of step 1; RULER samples already cached under WORK/results/cache are reused")
    ap.add_argument("--instruction-rows", type=int, default=1024)
    ap.add_argument("--jobs", type=int, default=6, help="commands run at once")
    ap.add_argument("--budget-s", type=float, default=1380.0)
    ap.add_argument("--eval-reserve-s", type=float, default=380.0, help="time kept for RULER on S and L and the "
                    "report when the KD budget is sized")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "mini_reproduction.json")
    args = ap.parse_args()
    t_start = time.time()
    deadline = t_start + args.budget_s
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    results = work / "results"
    dev = ["--device", args.device] if args.device else []
    if args.tiny:
        teacher = str(tiny_teacher(work))
        recipes = tiny_recipes(work, Path(teacher))
        train_lengths, eval_groups, layout = "256,384,512", [("512,1k", 4)], "auto:1MLA3GDN"
        student_groups = eval_groups
        data_args = ["--long-tokens", "768", "--instruction-rows", "4", "--max-answer-tokens", "8"]
        batch_tokens = "1k"
        tasks = args.tasks if args.tasks != ",".join(TASKS) else "niah_single_1,niah_multikey_1"
        samples = min(args.samples, 2)
    else:
        from hylo_bench.models.checkpoint import resolve_checkpoint_dir

        teacher = str(resolve_checkpoint_dir(args.teacher))  # a .gguf is converted here, once
        recipes = {n: RECIPES / f"{n}.yaml" for n in ("ild", "short", "staged")}
        train_lengths, layout = "1k,4k,8k", "auto:6MLA24GDN"
        lengths = args.eval_lengths.split(",")
        # a task's 50 samples in one batch up to 8K, 25 beyond (a batch that runs out of memory is halved)
        short = [x for x in lengths if x in ("1k", "2k", "4k", "8k")]
        # (the teacher's 16K batch is 10: it runs beside the training runs, and a transformers model materialises
        # its padding mask; the hybrid's left-padded prefill needs no mask)
        eval_groups = ([(",".join(short), 50)] if short else []) + [(x, 10) for x in lengths if x not in short]
        # the students one job per length, the lengths that carry the finding first: a run cut by the budget keeps
        # whole lengths (a RULER run goes length by length)
        first = {"8k": 0, "4k": 1, "1k": 2, "2k": 3}
        student_groups = [(x, 50 if x in short else 25) for x in sorted(lengths, key=lambda x: first.get(x, 9))]
        data_args = ["--long-tokens", args.long_tokens, "--instruction-rows", str(args.instruction_rows),
                     "--batch-size", "64"]
        batch_tokens, tasks, samples = args.batch_tokens, args.tasks, args.samples
    eval_lengths = ",".join(g[0] for g in eval_groups)
    sets = {"ild": ["--set", f"stages.0.token_budget={args.ild_tokens}"]} if args.ild_tokens else {}
    data = (args.data or work / "data") / "mixture.yaml"
    if args.data is not None and not data.is_file():
        sys.exit(f"--data {args.data}: no mixture.yaml there (a hylo-bench make-data --out folder)")
    common = ["--base", teacher, "--teacher", teacher, "--data", str(data), "--results-dir", str(results),
              "--batch-tokens", batch_tokens, "--no-tensorboard", *dev]
    jobs = [] if args.data else [
        Job("make_data", hb("make-data", "--out", str(work / "data"), "--teacher", teacher, "--lengths", train_lengths,
                            "--ruler-lengths", eval_lengths, "--ruler-samples", str(samples), "--ruler-results-dir",
                            str(results), "--overwrite", *data_args, *dev))]
    jobs += [Job("ild", hb("upcycle", "--recipe", str(recipes["ild"]), "--layout", layout, "--out", str(work / "ild"),
                          *common, *sets.get("ild", [])), wait_for=data)]  # the mixture is written before
    # make-data's RULER decontamination pass: training need not wait for it

    def ild_random_cmd() -> list[str]:
        sel = json.loads((work / "ild" / "layer_selection.json").read_text())
        return hb("upcycle", "--recipe", str(recipes["ild"]), "--mla-layers", ",".join(map(str, sel["mla_layers"])),
                  "--init", "random", "--out", str(work / "ild_random"), *common, *sets.get("ild", []))

    jobs.append(Job("ild_random", None, wait_for=work / "ild" / "layer_selection.json", build=ild_random_cmd))
    adaptive: dict = {}

    def kd_sets(run: str) -> list[str]:
        """The KD budget of S and L: the recipes' (or --kd-tokens), cut to what the time left allows at the ILD
        run's measured speed (two KD runs share the GPU; RULER and the report need --eval-reserve-s after)."""
        if "kd_tokens" not in adaptive:
            recipe_kd = sum(st["token_budget"] for st in yaml.safe_load(recipes["short"].read_text())["stages"])
            want = args.kd_tokens or recipe_kd
            tps = steady_tokens_per_s(work / "ild" / "train_log.jsonl")
            # a KD step (teacher forward, student forward + backward of every layer) runs at ~0.6 of an ILD step's
            # tokens/s at 1K and faster at 8K; the first steps of a run (kernel compilation and autotuning) take
            # ~150 s (H200, attempt 1 of this plan)
            allow = KD_SPEED_OF_ILD * tps * max(0.0, deadline - time.time() - args.eval_reserve_s - KD_STARTUP_S)
            step = 3 * parse_len(batch_tokens)
            kd = max(step, min(want, int(allow) // step * step))
            adaptive.update(kd_tokens=kd, requested_kd_tokens=want, ild_tokens_per_s=round(tps))
            print(f"KD budget per run: {kd:,} tokens (asked {want:,}; ILD ran at {tps:,.0f} tokens/s)", flush=True)
        kd = adaptive["kd_tokens"]
        if run == "short":
            return ["--set", f"stages.0.token_budget={kd}"]
        return [x for i in range(3) for x in ("--set", f"stages.{i}.token_budget={kd // 3}")]

    for run in ("short", "staged"):
        jobs.append(Job(run, None, deps=["ild"], build=lambda run=run: hb(
            "upcycle", "--recipe", str(recipes[run]), "--init-from", str(work / "ild"), "--out", str(work / run),
            *common, *kd_sets(run))))
    models = {"teacher": teacher, "short": str(work / "short"), "staged": str(work / "staged")}
    ruler_jobs = [("teacher", g) for g in eval_groups] + [(role, g) for g in student_groups
                                                          for role in ("short", "staged")]
    # the teacher after make-data: its RULER samples come from make-data's cache, and its CPU-bound sampling would
    # slow make-data
    teacher_deps = ["make_data"] if jobs[0].name == "make_data" else []
    for role, (lens, batch) in ruler_jobs:
        jobs.append(Job(f"ruler_{role}_{lens.replace(',', '_')}",
                        hb("ruler", "--model", models[role], "--lengths", lens, "--tasks", tasks, "--samples",
                           str(samples), "--results-dir", str(results), "--engine", "generate", "--batch-size",
                           str(batch), "--beyond-context", *dev),
                        deps=teacher_deps if role == "teacher" else [role]))
    doc = result_envelope("mini_reproduction")
    doc.update(plan={"teacher": args.teacher, "tiny": args.tiny, "data": str(data), "tasks": tasks.split(","),
                     "samples": samples,
                     "eval_lengths": eval_lengths.split(","), "train_lengths": train_lengths.split(","),
                     "recipes": {k: str(v) for k, v in recipes.items()}, "batch_tokens": batch_tokens,
                     "ild_tokens": args.ild_tokens, "kd_tokens": args.kd_tokens},
               paper={"model": "HyLo-Llama-4MLA12GDN", "ruler_mean": PAPER}, jobs={})

    def save(job: Job | None = None) -> None:
        if job is not None:
            doc["jobs"][job.name] = {"status": job.status, "seconds": round(job.seconds, 1)}
        doc["records"] = collect(results, {v: k for k, v in models.items()})
        doc["training"] = training_summary(work)
        doc["wall_s"] = round(time.time() - t_start, 1)
        doc["plan"]["kd_budget"] = dict(adaptive)
        write_result(args.out, doc)

    run_jobs(jobs, work / "logs", args.jobs, deadline, save)
    save()
    try:
        subprocess.run(hb("import", str(args.out), "--results-dir", str(results)), check=False, timeout=300)
        rep = subprocess.run(hb("report", "--results-dir", str(results), "-o", str(work / "report.html")),
                             check=False, timeout=300, capture_output=True, text=True)
        doc["report"] = "ok" if rep.returncode == 0 else f"failed: {(rep.stderr or rep.stdout).strip()[-300:]}"
    except subprocess.TimeoutExpired:
        doc["report"] = "timed out"
    write_result(args.out, doc)
    means = {(r["model_role"], r["seq_len"]): r["score"] for r in doc["records"] if r["task"] == "mean"}
    print("RULER mean by length:", json.dumps({f"{k[0]}@{k[1]}": v for k, v in sorted(means.items())}), flush=True)
    failed = [n for n, j in doc["jobs"].items() if j["status"] != "ok"]
    print(f"done in {time.time() - t_start:.0f} s; results {args.out}; not ok: {failed or 'none'}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
