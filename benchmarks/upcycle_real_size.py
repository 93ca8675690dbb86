"""Real-size upcycling on one GPU: Qwen3-8B-shaped teacher -> Qwen3-1.7B-shaped 7MLA21GDN student.

Builds both checkpoints from their configs with random weights (speed and memory do not depend on weight
values), then runs the real command line::

    hylo-bench upcycle --base QWEN3_1.7B --teacher QWEN3_8B --layout 7MLA21GDN \
        --stages 2k:ild@<20 steps>,8k@<20 steps> --batch-size 1

and writes benchmarks/results/upcycle_real_size.json with tokens/s and peak GPU memory per stage.
Usage (H200): python benchmarks/upcycle_real_size.py --work /tmp/hylo-real --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result  # noqa: E402

QWEN3 = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
             head_dim=128, num_key_value_heads=8, hidden_act="silu", bos_token_id=0, eos_token_id=1)
SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=False),
}


def build_checkpoint(name: str, out: Path, tokenizer) -> None:
    """Random-weight Qwen3 checkpoint (bf16) built on the GPU, saved with the given tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").is_file():
        return
    cfg = Qwen3Config(**QWEN3, **SHAPES[name])
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    torch.cuda.empty_cache()


H200_BF16_PEAK_FLOPS = 989e12  # dense bf16, vendor datasheet (H100/H200 SXM)


def param_counts(manifest: dict) -> tuple[int, int, int]:
    """Parameter counts of the student (from the manifest's hybrid config), the 1.7B base and the 8B teacher."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hylo_bench.config.hylo_config import HyLoConfig
    from hylo_bench.models.hybrid import HyLoForCausalLM

    with torch.device("meta"):
        counts = [sum(p.numel() for p in Qwen3ForCausalLM(Qwen3Config(**QWEN3, **SHAPES[n])).parameters())
                  for n in SHAPES]
        base = dict(QWEN3, **SHAPES["qwen3-1.7b"], model_type="qwen3")
        student = HyLoForCausalLM(HyLoConfig.from_dicts(base, manifest["hybrid_config"])) \
            if "hybrid_config" in manifest else None
    n_student = sum(p.numel() for p in student.parameters()) if student is not None else 0
    return n_student, counts[0], counts[1]


def make_tokenizer():
    """Byte-level BPE (8k vocab) on the shipped text; ids stay below Qwen3's vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hylo_bench.upcycle.documents import shipped_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([shipped_text()], trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<|bos|>", "<|eos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/hylo-real"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--timeout-s", type=int, default=480, help="Stop the upcycle command after this many seconds.")
    ap.add_argument("--eval-windows", type=int, default=0, help="Held-out KL windows (0: skip; fla autotune is slow)")
    ap.add_argument("--out-json", type=Path, default=Path(__file__).parent / "results" / "upcycle_real_size.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    t0 = time.time()
    for name in SHAPES:
        build_checkpoint(name, args.work / name, tok)
    build_s = time.time() - t0
    data = args.work / "data.txt"
    from hylo_bench.upcycle.documents import shipped_text

    data.write_text(shipped_text())
    stages = f"2k:ild@{args.steps * 2048},8k@{args.steps * 8192}"
    out = args.work / "student"
    cmd = [sys.executable, "-m", "hylo_bench", "upcycle", "--base", str(args.work / "qwen3-1.7b"),
           "--teacher", str(args.work / "qwen3-8b"), "--layout", "7MLA21GDN", "--data", str(data),
           "--stages", stages, "--batch-size", "1", "--out", str(out), "--device", "cuda", "--no-stage-checkpoints",
           "--eval-windows", str(args.eval_windows)]
    t1 = time.time()
    try:
        returncode = subprocess.run(cmd, env=os.environ | {"PYTHONUNBUFFERED": "1"}, timeout=args.timeout_s).returncode
    except subprocess.TimeoutExpired:  # the manifest is written after every step: keep what was measured
        returncode = 124
    manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").is_file() else {}
    n_student, n_base, n_teacher = param_counts(manifest)
    records = []
    for st in manifest.get("stages", []):
        tps = [r["tokens_per_s"] for r in st.get("losses", [])][2:] or [float("nan")]
        records.append({"stage": st["name"], "kind": st["kind"], "seq_len": st["seq_len_tokens"],
                        "steps": st.get("steps", 0), "n_gpus": 1, "tokens_per_s": statistics.median(tps),
                        "peak_memory_gib": st.get("peak_memory_gib"), "stage_seconds": st.get("seconds"),
                        "first_loss": (st.get("losses") or [{}])[0].get("loss"),
                        "last_loss": (st.get("losses") or [{}])[-1].get("loss"),
                        "status": "ok" if st.get("status") == "done" else "failed"})
        # MFU: model FLOPs (6 N per trained token, 2 N per teacher token; attention ignored) over bf16 dense peak
        teacher_n = n_base if st["kind"] == "ild" else n_teacher
        flops_per_token = 6 * n_student + 2 * teacher_n
        records[-1]["mfu"] = flops_per_token * records[-1]["tokens_per_s"] / H200_BF16_PEAK_FLOPS
    env = result_envelope("upcycle_real_size")
    env.update(command=" ".join(cmd[1:]), returncode=returncode, build_checkpoints_s=build_s,
               upcycle_wall_s=time.time() - t1, student_layout="7MLA21GDN", mla_layers=[1, 5, 9, 13, 17, 21, 25],
               kl_init=manifest.get("kl_init"), gdn_backend_note="see the log line 'GDN backend: ...'",
               records=records)
    write_result(args.out_json, env)
    print(json.dumps(env, indent=2))
    sys.exit(0 if records else 1)


if __name__ == "__main__":
    main()
