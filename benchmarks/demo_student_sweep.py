"""One point of the demo-upcycle sweep: upcycle the embedded teacher into the 2MLA2GDN demo student with the given
stages and learning rates, then score the student on RULER at 1K (20 seed-42 samples of niah_single_1,
niah_single_2, niah_multikey_1, greedy, 6 new tokens).

This sweep chose the demo defaults in ``hylo_bench/config/upcycle.py`` (``DEMO_STAGES``, ``DEMO_ILD_LR``,
``DEMO_KD_LR``); ``benchmarks/results/demo_student_sweep.json`` holds the 13 points measured on one H200 (several
points ran as parallel processes on the GPU, so ``upcycle_s`` is not a speed measurement).

Usage (on the device, with the wonderwords wheel carried; writes ``$OUT/NAME.json``)::

    python3 benchmarks/demo_student_sweep.py w5 1k:ild@750k 4e-3 4e-3 4
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from hylo_bench.config.upcycle import UpcycleConfig
from hylo_bench.models.loading import load_model
from hylo_bench.tasks.ruler import generate_sample, score_prediction
from hylo_bench.upcycle.run import run

TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
SAMPLES = 20


def main(name: str, stages: str, ild_lr: float, kd_lr: float, batch_size: int) -> dict:
    """Upcycle, score, and return the record (scores 0-100, KL in nats/token, time in seconds)."""
    t0 = time.time()
    manifest = run(UpcycleConfig(out=f"/tmp/sw/{name}", stages=stages, ild_lr=ild_lr, kd_lr=kd_lr,
                                 batch_size=batch_size, save_stage_checkpoints=False, eval_windows=4, device="cuda"))
    upcycle_s = time.time() - t0
    student, tok, _ = load_model(f"/tmp/sw/{name}", "cuda", torch.float32)
    scores, examples = {}, {}
    for task in TASKS:
        hits = 0.0
        for i in range(SAMPLES):
            s = generate_sample(task, tok, 1024, i, seed=42)
            ids = tok(s["prompt"], return_tensors="pt").input_ids.cuda()
            out = student.generate(ids, max_new_tokens=6, do_sample=False)
            pred = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            hits += score_prediction(task, pred, s["outputs"])
            if i == 0:
                examples[task] = [pred, s["outputs"]]
        scores[task] = 100 * hits / SAMPLES
    return {"name": name, "stages": stages, "ild_lr": ild_lr, "kd_lr": kd_lr, "batch_size": batch_size,
            "scores": scores, "mean": sum(scores.values()) / len(TASKS), "kl_init": manifest["kl_init"],
            "kl_after": [s.get("kl_after") for s in manifest["stages"]], "upcycle_s": round(upcycle_s),
            "examples": examples}


if __name__ == "__main__":
    rec = main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
    print(json.dumps(rec), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), f"{rec['name']}.json"), "w", encoding="utf-8") as f:
        json.dump(rec, f)
