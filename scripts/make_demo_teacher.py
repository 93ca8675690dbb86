"""Build the embedded demo teacher shipped in ``hylo_bench/data/demo_teacher/``.

The demo teacher is a 4-layer Llama (hidden 128, about 1.3M parameters) with its own BPE tokenizer. Everything it
learns from is produced here, from the package's own text and generator:

* Tokenizer: byte-level BPE (vocab 2048, digits split one per token, specials ``<|bos|> <|eos|> <|pad|>``), trained
  on ``hylo_bench/data/devils-dictionary.txt`` plus RULER prompts drawn with a bootstrap tokenizer that saw only the
  dictionary (so "special magic", needle words and the noise haystack become compact).
* Task data: ``hylo_bench.tasks.ruler.generate_sample`` over the same dictionary as essay haystack: all 8 NIAH
  tasks (niah_single_1/2 and niah_multikey_1 at double weight) plus ruler_vt / ruler_cwe / ruler_fwe at half
  weight, target lengths on a 32-token grid in [--min-len, --max-len] (default 320-1664, i.e. prompts of about
  190-1540 tokens, short ones as an easy curriculum) with a quarter of them exactly 1024; a draw that does not fit
  its length grows by 64 tokens. Each training text is the RULER prompt (``prompt`` = input + " " + gen_prefix),
  the gold answer and EOS; the loss is the answer tokens' cross-entropy plus ``--lm-weight`` times the LM loss on
  the prompt tokens. Every 7-digit gold number is redrawn at each use (needle and answer alike, digits are single
  tokens), so repeated samples cannot be memorised: only retrieval lowers the answer loss.
* Plain text: random 1024-token chunks of the dictionary (first 95 %; the last 5 % is the validation split) as
  whole-sequence LM rows, so the teacher is also a small language model of the demo text.

Seeds: generator seeds are ``seed + 1000`` and up for training (the evaluation set is seed 42, never trained on);
``torch.manual_seed(seed)`` drives the initialisation; three numpy streams ``default_rng([seed, k])`` drive the
batch order, the layer-0/2 window mode and text offsets / redrawn numbers. With
``torch.use_deterministic_algorithms`` (warn-only: cuDNN attention backward warns) and
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, re-running with the same arguments on the same device type, torch and
transformers versions reproduces the weights up to that warning. Data generation is order-stable across worker
counts; ``--data-cache`` stores it (tokenizer + samples) so a GPU call can skip it. ``--train-budget-s`` cuts
``--steps`` at step 150 (inside the warmup) to fit a time budget; the card records the steps run, and
``--steps N`` reproduces them.

Conversion-friendly training (off by default until retrieval trains reliably): on a ``--local-prob`` fraction of
the steps, the attention of layers 0 and 2 (the layers the HyLo student turns into Gated DeltaNet) is limited to
the last ``--local-window`` tokens (deterministic blocked attention), so long-range retrieval has to live in layers
1 and 3 (the layers kept as MLA). The shipped model is a stock Llama with full attention everywhere; the probes
report retrieval in both modes.

Usage (the shipped weights were made on one H200; see the card for the exact command)::

    PYTHONPATH=. python scripts/make_demo_teacher.py --out /tmp/demo_teacher --device cuda --steps 6000 \
        --data-cache .demo_cache/data.npz --train-budget-s 360
    PYTHONPATH=. python scripts/make_demo_teacher.py --eval-only hylo_bench/data/demo_teacher --device cpu
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HAYSTACK_PATH = REPO / "hylo_bench" / "data" / "devils-dictionary.txt"
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
NIAH_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multikey_3", "niah_multiquery", "niah_multivalue")
TASK_WEIGHTS = {t: 1.0 for t in NIAH_TASKS} | {"niah_single_1": 2.0, "niah_single_2": 2.0, "niah_multikey_1": 2.0,
                                               "ruler_vt": 0.5, "ruler_cwe": 0.5, "ruler_fwe": 0.5}
EVAL_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1")
EVAL_SEED = 42
TRAIN_SEED_OFFSET = 1000
LOCAL_LAYERS = (0, 2)
MAX_NEW_TOKENS = {"ruler_vt": 30, "ruler_cwe": 120, "ruler_fwe": 50}
MIN_LEN = {"ruler_vt": 768, "ruler_cwe": 768, "niah_multiquery": 416, "niah_multikey_3": 544}
"""Shortest target lengths whose smallest prompt fits (VT one-shot example, CWE minimum list, 4 query keys, UUID lines)."""
console = Console()


@dataclass(kw_only=True, slots=True)
class Example:
    """One tokenised training text: ``prompt_ids`` (BOS first) then ``answer_ids`` (EOS last); uint16.

    ``value_pos`` [m, 7] holds the positions (in prompt + answer) of every occurrence of a 7-digit gold number and
    ``value_gid`` [m] which gold each row belongs to, so :func:`make_batch` can redraw the numbers.
    """

    prompt_ids: np.ndarray
    answer_ids: np.ndarray
    value_pos: np.ndarray
    value_gid: np.ndarray


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("demo_teacher_out"), help="output folder (HF checkpoint)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="master seed (generator seeds are seed + 1000 and up)")
    p.add_argument("--batch-size", type=int, default=64, help="rows per step (task samples and text chunks)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine to 10 %%)")
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--num-samples", type=int, default=40000, help="distinct generated task samples")
    p.add_argument("--text-frac", type=float, default=0.1, help="fraction of rows that are plain-text chunks")
    p.add_argument("--lm-weight", type=float, default=0.2, help="weight of the LM loss on prompt/text tokens")
    p.add_argument("--min-len", type=int, default=320, help="shortest target length (prompt + 128), tokens")
    p.add_argument("--max-len", type=int, default=1664, help="longest target length (prompt + 128), tokens")
    p.add_argument("--train-budget-s", type=float, default=0, help="cut --steps to fit this many training seconds,\n"
                   "decided from the step time at step 150 (0 = off); the card records the steps run")
    p.add_argument("--local-prob", type=float, default=0.0, help="fraction of steps with windowed layers 0/2")
    p.add_argument("--local-window", type=int, default=64, help="window of layers 0/2 on those steps, tokens")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--resample-values", type=int, default=1, help="1: redraw 7-digit gold numbers every use")
    p.add_argument("--data-cache", type=Path, default=None, help="npz of tokenizer + samples: load if it exists,\n"
                   "else generate and write it (generation is deterministic, so this only saves time)")
    p.add_argument("--eval-tasks", choices=("all", "main"), default="all", help="main: " + ", ".join(EVAL_TASKS))
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes for data generation")
    p.add_argument("--probe-every", type=int, default=250, help="steps between teacher-forced probe evals")
    p.add_argument("--eval-samples", type=int, default=50, help="seed-42 samples per task for the final eval")
    p.add_argument("--eval-length", type=int, default=1024, help="eval target length, tokens")
    p.add_argument("--eval-max-new", type=int, default=0, help="cap on generated tokens (0 = per-task default)")
    p.add_argument("--eval-only", type=Path, default=None, help="only evaluate this checkpoint folder")
    return p.parse_args(argv)




def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with single-digit number tokens; deterministic for a fixed ``texts`` list."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = tok.token_to_id(SPECIALS[0])
    tok.post_processor = processors.TemplateProcessing(single=f"{SPECIALS[0]} $A", pair=f"{SPECIALS[0]} $A $B",
                                                       special_tokens=[(SPECIALS[0], bos)])
    return tok


def wrap_tokenizer(tok):
    """Wrap a ``tokenizers.Tokenizer`` as the HF fast tokenizer that ``AutoTokenizer`` reloads offline."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   pad_token=SPECIALS[2], model_max_length=4096, clean_up_tokenization_spaces=False)


def build_tokenizer(haystack: str, args: argparse.Namespace, workdir: Path):
    """Two rounds: BPE on the dictionary, then BPE on the dictionary plus RULER text drawn with the first one."""
    boot = wrap_tokenizer(train_tokenizer(_paragraphs(haystack), args.vocab_size))
    boot_dir = workdir / "bootstrap_tokenizer"
    boot.save_pretrained(boot_dir)
    specs = [(task, 1024, i, args.seed + TRAIN_SEED_OFFSET + 1) for task in TASK_WEIGHTS for i in range(16)]
    texts = _run_pool(_text_worker, specs, boot_dir, args.workers, "tokenizer text")
    return wrap_tokenizer(train_tokenizer(_paragraphs(haystack) + texts, args.vocab_size))


def _paragraphs(text: str) -> list[str]:
    return [p for p in text.split("\n\n") if p.strip()]


_WORKER: dict = {}


def _worker_init(tok_dir: str) -> None:
    from transformers import AutoTokenizer

    _WORKER["tok"] = AutoTokenizer.from_pretrained(tok_dir)
    _WORKER["haystack"] = HAYSTACK_PATH.read_text(encoding="utf-8")


def _sample(spec: tuple[str, int, int, int]) -> dict:
    """One generator sample; a length too small for this draw grows by 64 tokens until it fits."""
    from hylo_bench.tasks.ruler import generate_sample
    from hylo_bench.tasks.ruler.sampling import PromptTooLongError

    task, length, index, seed = spec
    while True:
        try:
            return generate_sample(task, _WORKER["tok"], length, index, seed, _WORKER["haystack"])
        except PromptTooLongError:
            if length >= 4096:
                raise
            length += 64


def format_answer(task: str, outputs: list[str]) -> str:
    """The continuation after ``gen_prefix``: what a good model says (every gold is a substring of it)."""
    if task in ("ruler_vt", "ruler_fwe"):
        return " " + " ".join(outputs)
    if task == "ruler_cwe":
        return " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(outputs))
    if len(outputs) == 1:
        return f" {outputs[0]}."
    return " " + ", ".join(outputs[:-1]) + f", and {outputs[-1]}."


def _text_worker(spec: tuple[str, int, int, int]) -> str:
    s = _sample(spec)
    return s["prompt"] + format_answer(spec[0], s["outputs"])


def _example_worker(spec: tuple[str, int, int, int]) -> Example:
    s = _sample(spec)
    return to_example(_WORKER["tok"], spec[0], s["prompt"], s["outputs"])


def _eval_worker(spec: tuple[str, int, int, int]) -> dict:
    s = _sample(spec)
    return {"task": spec[0], "prompt": s["prompt"], "outputs": list(s["outputs"])}


def _run_pool(fn, specs: list, tok_dir: Path, workers: int, label: str) -> list:
    """Map ``fn`` over ``specs`` in order (results do not depend on the worker count)."""
    out = []
    ctx = mp.get_context("fork")
    with ctx.Pool(max(1, workers), initializer=_worker_init, initargs=(str(tok_dir),)) as pool, _progress() as bar:
        job = bar.add_task(label, total=len(specs), info="")
        for res in pool.imap(fn, specs, chunksize=max(1, min(64, len(specs) // (4 * max(1, workers))))):
            out.append(res)
            bar.advance(job)
    return out


def train_specs(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """Task, target length, index and generator seed of every training sample (seeds >= 1000, disjoint from 42)."""
    rng = np.random.default_rng(args.seed)
    names = list(TASK_WEIGHTS)
    probs = np.array([TASK_WEIGHTS[t] for t in names]) / sum(TASK_WEIGHTS.values())
    tasks = rng.choice(len(names), size=args.num_samples, p=probs)
    # Lengths on a 32-token grid: the generator caches one haystack-size search per (task, length).
    lengths = rng.integers(args.min_len // 32, args.max_len // 32 + 1, size=args.num_samples) * 32
    lengths[rng.random(args.num_samples) < 0.25] = 1024
    seed = args.seed + TRAIN_SEED_OFFSET
    return [(names[t], int(max(n, MIN_LEN.get(names[t], 0))), i, seed) for i, (t, n) in enumerate(zip(tasks, lengths))]


def text_ids(tokenizer, haystack: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the dictionary split 95 / 5 into train and validation text (no BOS)."""
    ids = np.asarray(tokenizer(haystack, add_special_tokens=False).input_ids, np.int64)
    cut = int(len(ids) * 0.95)
    return ids[:cut], ids[cut:]




def build_model(tokenizer, seed: int, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, initializer_range=0.02, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 128
    return model


class _LocalMode:
    """Switch read by :func:`_local_mix_attention`: window layers 0/2 to the last ``window`` tokens when ``on``."""

    on = False
    window = 64


def window_attention(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTK: torch.Tensor, key_valid_BT: torch.Tensor,
                     window: int, scaling: float) -> torch.Tensor:
    """Causal attention over the last ``window`` positions (self included), in blocks of ``window`` queries.

    Each query block attends to its own and the previous key block ([B, H, n, W, 2W] scores), so memory is
    O(T * W) and only matmuls and a softmax run: deterministic on CUDA, unlike SDPA with a mask. Padding keys
    (``key_valid_BT`` False) are hidden except from themselves, so no row is empty.

    Args:
        q_BHTK, k_BHTK, v_BHTK: [B, H, T, K] (keys/values already expanded to H heads).
        key_valid_BT: [B, T] bool.
        window: W, tokens.
        scaling: softmax scale.

    Returns:
        [B, T, H, K], the layout HF attention functions return.
    """
    B, H, T, K = q_BHTK.shape
    W = window
    n = -(-T // W)
    pad = n * W - T

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, K] -> [B, H, n, W, K]
        return F.pad(x, (0, 0, 0, pad)).view(B, H, n, W, K)

    q = blocks(q_BHTK)
    k, v = blocks(k_BHTK), blocks(v_BHTK)
    k2 = torch.cat([F.pad(k, (0, 0, 0, 0, 1, 0))[:, :, :-1], k], dim=3)  # [B, H, n, 2W, K]: previous | own block
    v2 = torch.cat([F.pad(v, (0, 0, 0, 0, 1, 0))[:, :, :-1], v], dim=3)
    i = torch.arange(W, device=q.device)
    j = torch.arange(2 * W, device=q.device)
    d = W + i[:, None] - j[None, :]  # query pos - key pos
    in_window = (d >= 0) & (d < W)
    first = torch.zeros(n, 1, 2 * W, dtype=torch.bool, device=q.device)
    first[0, :, :W] = True  # the block before block 0 does not exist
    valid = F.pad(key_valid_BT, (0, pad), value=False).view(B, n, W)
    valid2 = torch.cat([F.pad(valid, (0, 0, 1, 0), value=False)[:, :-1], valid], dim=2)  # [B, n, 2W]
    allowed = in_window & ~first & (valid2[:, :, None, :] | (d == 0))  # [B, n, W, 2W]
    scores = torch.matmul(q, k2.transpose(-1, -2)).float() * scaling
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(v2.dtype), v2)  # [B, H, n, W, K]
    return out.view(B, H, n * W, K)[:, :, :T].transpose(1, 2).contiguous()


def _local_mix_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """HF attention function: plain SDPA, except layers 0/2 in local mode (full prefill only, no KV cache)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if not (_LocalMode.on and module.layer_idx in LOCAL_LAYERS):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    assert query.shape[2] == key.shape[2], "local mode runs full sequences only (no KV cache)"
    if attention_mask is None:
        key_valid = torch.ones(query.shape[0], key.shape[2], dtype=torch.bool, device=query.device)
    else:
        assert attention_mask.dtype == torch.bool, attention_mask.dtype
        key_valid = attention_mask[:, 0, -1, :]  # the last query sees every real key
    n_rep = query.shape[1] // key.shape[1]
    out = window_attention(query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), key_valid, _LocalMode.window,
                           scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out, None


def use_local_mix(model, enable: bool) -> None:
    """Route attention through :func:`_local_mix_attention` (training) or back to plain SDPA (shipping)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("demo_local_mix", _local_mix_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("demo_local_mix", sdpa_mask)
    model.config._attn_implementation = "demo_local_mix" if enable else "sdpa"


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                    transient=False)


def batch_schedule(examples: list[Example], args: argparse.Namespace, rng: np.random.Generator) -> list[np.ndarray]:
    """Example indices of every step: shuffled epochs, bucketed by length (16 batches per bucket) to cut padding."""
    rows = args.batch_size - round(args.batch_size * args.text_frac)
    lengths = np.array([len(e.prompt_ids) + len(e.answer_ids) for e in examples])
    steps: list[np.ndarray] = []
    while len(steps) < args.steps:
        perm = rng.permutation(len(examples))
        epoch = []
        for start in range(0, len(perm) - rows + 1, rows * 16):
            group = perm[start:start + rows * 16]
            group = group[np.argsort(lengths[group], kind="stable")]
            epoch += [group[i:i + rows] for i in range(0, len(group) - rows + 1, rows)]
        steps += [epoch[i] for i in rng.permutation(len(epoch))]
    return steps[:args.steps]


def make_batch(examples: list[Example], idx: np.ndarray, text: np.ndarray, num_text: int, chunk: int,
               rng: np.random.Generator, bos: int, pad: int,
               digit_ids: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``ids [B, T]`` and float masks ``ans, ctx [B, T-1]`` over next-token targets.

    With ``digit_ids`` (token ids of "0".."9"), every 7-digit gold number is redrawn (same digits at each of its
    occurrences, needle and answer), so repeated samples never repeat an answer: the model must retrieve it.
    """
    seqs, ans_starts = [], []
    for i in idx:
        e = examples[i]
        seq = np.concatenate([e.prompt_ids, e.answer_ids]).astype(np.int64)
        if digit_ids is not None and len(e.value_gid):
            new = rng.integers(0, 10, size=(int(e.value_gid.max()) + 1, 7))
            new[:, 0] = rng.integers(1, 10, size=len(new))
            seq[e.value_pos] = digit_ids[new[e.value_gid]]
        seqs.append(seq)
        ans_starts.append(len(e.prompt_ids) - 1)
    for off in rng.integers(0, len(text) - chunk, size=num_text) if num_text else ():
        seqs.append(np.concatenate([[bos], text[off:off + chunk]]).astype(np.int64))
        ans_starts.append(None)
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad, np.int64)
    ans = np.zeros((len(seqs), width - 1), np.float32)
    ctx = np.zeros((len(seqs), width - 1), np.float32)
    for r, (s, a) in enumerate(zip(seqs, ans_starts)):
        ids[r, :len(s)] = s
        if a is None:
            ctx[r, :len(s) - 1] = 1
        else:
            ctx[r, :a] = 1
            ans[r, a:len(s) - 1] = 1
    return torch.from_numpy(ids), torch.from_numpy(ans), torch.from_numpy(ctx)


def losses(model, ids: torch.Tensor, ans: torch.Tensor, ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy over answer targets and over context targets (fp32)."""
    logits_BTV = model(input_ids=ids).logits[:, :-1]
    ce_BT = F.cross_entropy(logits_BTV.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none").view_as(ans)
    loss_ans = (ce_BT * ans).sum() / ans.sum().clamp(min=1)
    loss_ctx = (ce_BT * ctx).sum() / ctx.sum().clamp(min=1)
    return loss_ans, loss_ctx


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    t = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(model, examples: list[Example], text: np.ndarray, probes: list[Example], args: argparse.Namespace,
          tokenizer) -> list[dict]:
    """AdamW + cosine schedule; bf16 autocast on CUDA. Returns the log (one record per 50 steps).

    Batch order, window mode and text offsets come from three independent seeded streams, so a run cut short by
    ``--train-budget-s`` (decided at step 150, inside the warmup) equals a run with that ``--steps`` from the start.
    """
    device = torch.device(args.device)
    rng_order, rng_local, rng_text = (np.random.default_rng([args.seed, k]) for k in range(3))
    schedule = batch_schedule(examples, args, rng_order)
    num_text = round(args.batch_size * args.text_frac)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    use_local_mix(model, True)
    _LocalMode.window = args.local_window
    log, t0, sums = [], time.time(), torch.zeros(2, device=device)
    digit_ids = np.asarray([tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])
    model.train()
    with _progress() as bar:
        job = bar.add_task("train", total=args.steps, info="")
        for step, idx in enumerate(schedule):
            batch = make_batch(examples, idx, text, num_text, 1024, rng_text, tokenizer.bos_token_id,
                               tokenizer.pad_token_id, digit_ids if args.resample_values else None)
            _LocalMode.on = bool(rng_local.random() < args.local_prob)
            sums += train_step(model, opt, batch, lr_at(step, args), args.lm_weight, device)
            bar.advance(job)
            if step == 49:
                t50 = time.time()
            if step == 149 and args.train_budget_s > 0:
                fit = int(args.train_budget_s / ((time.time() - t50) / 100))
                if fit < args.steps:
                    console.print(f"step time {(time.time() - t50) / 100 * 1e3:.1f} ms: --train-budget-s "
                                  f"{args.train_budget_s:g} fits {fit} of {args.steps} steps; training {fit}")
                    args.steps = max(fit, args.warmup_steps + 1)
                    bar.update(job, total=args.steps)
            last = step + 1 >= args.steps
            if (step + 1) % 50 == 0 or last:
                n = (step % 50) + 1
                rec = {"step": step + 1, "loss_answer": sums[0].item() / n, "loss_text": sums[1].item() / n,
                       "lr": lr_at(step, args), "elapsed_s": round(time.time() - t0, 1)}
                sums.zero_()
                if (step + 1) % args.probe_every == 0 or last:
                    rec |= probe_accuracy(model, probes, tokenizer, device)
                    model.train()
                log.append(rec)
                bar.update(job, info=f"ans {rec['loss_answer']:.3f} txt {rec['loss_text']:.3f}")
                console.print(json.dumps(rec))
            if last:
                break
    _LocalMode.on = False
    use_local_mix(model, False)
    model.eval()
    return log


def train_step(model, opt, batch, lr: float, lm_weight: float, device: torch.device) -> torch.Tensor:
    """One AdamW step on ``batch`` (ids, ans, ctx); returns the detached [answer, text] losses."""
    ids, ans, ctx = (t.to(device, non_blocking=True) for t in batch)
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss_ans, loss_ctx = losses(model, ids, ans, ctx)
    opt.zero_grad(set_to_none=True)
    (loss_ans + lm_weight * loss_ctx).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return torch.stack([loss_ans.detach(), loss_ctx.detach()])


@torch.no_grad()
def probe_accuracy(model, probes: list[Example], tokenizer, device: torch.device) -> dict:
    """Teacher-forced exact match of whole answers on held-out seed-42 probes, full and windowed layers 0/2."""
    model.eval()
    ids, ans, _ = make_batch(probes, np.arange(len(probes)), np.zeros(0, np.int64), 0, 0, None,
                             tokenizer.bos_token_id, tokenizer.pad_token_id)
    ids, ans = ids.to(device), ans.to(device)
    out = {}
    for name, local in (("probe_em", False), ("probe_em_local", True)):
        _LocalMode.on = local
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
        wrong = ((pred != ids[:, 1:]) & (ans > 0)).any(-1)
        out[name] = round(100 * (1 - wrong.float().mean().item()), 1)
    _LocalMode.on = False
    return out


@torch.no_grad()
def text_loss(model, text: np.ndarray, bos: int, device: torch.device, chunk: int = 1024) -> float:
    """Mean next-token loss (nats) over consecutive BOS-prefixed chunks of ``text``."""
    total, count = 0.0, 0
    for off in range(0, len(text) - 1, chunk):
        ids = torch.from_numpy(np.concatenate([[bos], text[off:off + chunk]]).astype(np.int64))[None].to(device)
        logits = model(input_ids=ids).logits[0, 1:-1].float()
        total += F.cross_entropy(logits, ids[0, 2:], reduction="sum").item()
        count += ids.shape[1] - 2
    return total / max(1, count)


@torch.no_grad()
def greedy_batch(model, tokenizer, prompts: list[str], max_new: int, device: torch.device) -> list[str]:
    """Greedy continuation of left-padded prompts without a cache (fast enough at 1K for a 1M model)."""
    enc = [tokenizer(p).input_ids for p in prompts]
    width = max(len(e) for e in enc)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e)) + e for e in enc], device=device)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc], device=device)
    done = torch.zeros(len(enc), dtype=torch.bool, device=device)
    new = []
    for _ in range(max_new):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
        nxt = torch.where(done, tokenizer.pad_token_id, nxt)
        new.append(nxt)
        done |= nxt == tokenizer.eos_token_id
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, (~done | (nxt == tokenizer.eos_token_id)).long()[:, None]], 1)
        if done.all():
            break
    out = torch.stack(new, 1).tolist()
    return [tokenizer.decode(o, skip_special_tokens=True) for o in out]


def evaluate(model, tokenizer, samples: list[dict], device: torch.device, max_new: int = 0, batch: int = 25) -> dict:
    """RULER score (0-100, the project's scorer) per task, and a few predictions for the card."""
    from hylo_bench.tasks.ruler import score_prediction

    by_task: dict[str, list[dict]] = {}
    for s in samples:
        by_task.setdefault(s["task"], []).append(s)
    result = {}
    for task, group in by_task.items():
        preds = []
        for i in range(0, len(group), batch):
            chunk = group[i:i + batch]
            preds += greedy_batch(model, tokenizer, [s["prompt"] for s in chunk],
                                  max_new or MAX_NEW_TOKENS.get(task, 48), device)
        scores = [score_prediction(task, p, s["outputs"]) for p, s in zip(preds, group)]
        result[task] = {"score": 100 * float(np.mean(scores)), "n": len(group),
                        "example": {"gold": group[0]["outputs"], "pred": preds[0]}}
    return result


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[str], max_new: int, device: torch.device) -> list[str]:
    """Batch-1 ``model.generate`` (greedy, stop at EOS): how the project's RULER runner decodes."""
    preds = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids.to(device)
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        preds.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return preds


def eval_samples(tasks: tuple[str, ...], args: argparse.Namespace, tok_dir: Path) -> list[dict]:
    specs = [(t, args.eval_length, i, EVAL_SEED) for t in tasks for i in range(args.eval_samples)]
    return _run_pool(_eval_worker, specs, tok_dir, args.workers, "eval samples")


def render_card(meta: dict) -> str:
    """The model card (README.md): what the weights are, how they were made, what they score."""
    rows = "\n".join(f"| {t} | {r['score']:.1f} | {r['n']} |" for t, r in meta["eval"].items())
    local = "\n".join(f"| {t} | {r['score']:.1f} | {r['n']} |" for t, r in meta["eval_local"].items()) or "| (not run) | | |"
    last = meta["log"][-1]
    main = [meta["eval"][t]["score"] for t in EVAL_TASKS if t in meta["eval"]]
    status = (f"**Status: meets the bar** (niah_single_1 {meta['eval']['niah_single_1']['score']:.0f} >= 90 at 1K)."
              if meta["eval"].get("niah_single_1", {"score": 0})["score"] >= 90 and min(main) >= 90 else
              "**Status: below the bar.** The issue asks for >= 90 on niah_single_1 at 1K (aim >= 95 on "
              "niah_single_1/2 and niah_multikey_1);\nthis build scores "
              + ", ".join(f"{t} {meta['eval'][t]['score']:.0f}" for t in EVAL_TASKS if t in meta["eval"])
              + ". Use it for plumbing only (loading, upcycling, distillation on the demo text).")
    why_local = ("Why windowed layers 0 and 2 on some steps: the HyLo demo student keeps layers 1 and 3 as MLA and turns 0 "
                 "and 2\ninto Gated DeltaNet, which handles local mixing (short conv, decaying state) but not exact "
                 "long-range lookup.\nTraining so that the lookup also works when layers 0/2 see only "
                 f"{meta['local_window']} tokens keeps the retrieval\ncircuit in layers 1 and 3, where it survives the "
                 "conversion." if meta["local_prob"] > 0 else
                 "Layers 0/2 were not windowed in training (`--local-prob 0`); the probe column 'windowed' shows how "
                 f"much of the\nretrieval still works when layers 0 and 2 see only the last {meta['local_window']} "
                 "tokens, a rough proxy for how\nmuch of the circuit lives in layers 1 and 3 (the layers the HyLo demo "
                 "student keeps as MLA).")
    cut = ""
    if meta["steps"] != meta["steps_requested"]:
        cut = f" (asked {meta['steps_requested']}, cut by --train-budget-s; same as `--steps {meta['steps']}`)"
    log_rows = "\n".join(f"| {r['step']} | {r['loss_answer']:.4f} | {r['loss_text']:.3f} | {r['probe_em']} | "
                         f"{r['probe_em_local']} | {r['elapsed_s']} |" for r in meta["log"] if "probe_em" in r)
    return f"""# hylo-bench demo teacher

A 4-layer Llama (hidden 128, 4 heads x 32, 2 KV heads, SwiGLU 384, untied head, RoPE theta 10000,
{meta['num_params']:,} parameters, fp32) with its own byte-level BPE tokenizer, shipped inside the package as the
default teacher for `hylo-bench upcycle` and `hylo-bench ruler` demos. It is trained from scratch on RULER-style
retrieval over the shipped text (`hylo_bench/data/devils-dictionary.txt`) plus that text itself, to answer
NIAH prompts of about 1K tokens. Not a general language model: it knows only the demo text and the RULER prompts.

{status}

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained("hylo_bench/data/demo_teacher")  # offline, no remote code
model = AutoModelForCausalLM.from_pretrained("hylo_bench/data/demo_teacher")
```

No chat template: prompts are plain RULER text (input + " " + gen_prefix); the model continues with the answer and
EOS. Token ids: `<|bos|>` {meta['bos']}, `<|eos|>` {meta['eos']}, `<|pad|>` {meta['pad']}; `tokenizer(text).input_ids`
starts with BOS (RULER measures lengths this way). Digits are single tokens; vocab {meta['vocab']}.

## How it was made

`scripts/make_demo_teacher.py` (its docstring explains data, seeds and reproducibility). Command:

```
{meta['command']}
```

| item | value |
|---|---|
| device | {meta['device']} |
| torch / transformers | {meta['torch']} / {meta['transformers']} |
| seed | {meta['seed']} (generator seeds {meta['seed'] + TRAIN_SEED_OFFSET} for training; eval uses seed {EVAL_SEED}) |
| training samples | {meta['num_samples']:,} RULER samples, target lengths {meta['min_len']}-{meta['max_len']} tokens (25 % at 1024) |
| task mix | {meta['task_mix']} |
| plain text | {meta['text_frac']:.0%} of rows: 1024-token chunks of the dictionary (first 95 %) |
| steps x batch | {meta['steps']} x {meta['batch_size']} rows{cut}, AdamW lr {meta['lr']}, warmup {meta['warmup_steps']}, cosine to 10 %, bf16 autocast on CUDA |
| layers 0/2 windowed | {meta['local_prob']:.0%} of steps, window {meta['local_window']} tokens |
| wall time | data {meta['data_s']:.0f} s, training {meta['train_s']:.0f} s, eval {meta['eval_s']:.0f} s |
| final loss | answer {last['loss_answer']:.4f}, text {last['loss_text']:.3f} nats/token |
| held-out text loss | {meta['val_loss']:.3f} nats/token (last 5 % of the dictionary) |

Training log (losses: mean over the preceding 50 steps; probe: teacher-forced whole-answer exact match on 25
seed-42 samples each of niah_single_1, niah_single_2, niah_multikey_1, with full / windowed layers 0 and 2):

| step | answer loss | text loss | probe EM full | probe EM windowed | elapsed s |
|---|---|---|---|---|---|
{log_rows}

{why_local}

## Evaluation (RULER at {meta['eval_length']} tokens, seed {EVAL_SEED}, greedy)

On the build device ({meta['device']}), batched greedy decoding, full attention (the shipped model):

| task | score | samples |
|---|---|---|
{rows}

Same, with layers 0/2 limited to a {meta['local_window']}-token window:

| task | score | samples |
|---|---|---|
{local}

<!-- eval-cpu -->
<!-- /eval-cpu -->
"""


def update_card(model_dir: Path, result: dict, args: argparse.Namespace) -> None:
    """Replace the CPU-verification block of ``README.md`` with ``result``."""
    import transformers

    card = (model_dir / "README.md").read_text(encoding="utf-8")
    rows = "\n".join(f"| {t} | {r['score']:.1f} | {r['n']} |" for t, r in result.items())
    block = (f"<!-- eval-cpu -->\nVerified on {args.device} ({platform.processor() or platform.machine()}), torch "
             f"{torch.__version__}, transformers {transformers.__version__}, batch-1 `model.generate` (how the "
             f"project's RULER runner decodes), `python {' '.join(sys.argv)}`:\n\n| task | score | samples |\n"
             f"|---|---|---|\n{rows}\n<!-- /eval-cpu -->")
    head, rest = card.split("<!-- eval-cpu -->", 1)
    (model_dir / "README.md").write_text(head + block + rest.split("<!-- /eval-cpu -->", 1)[1], encoding="utf-8")


def eval_only(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(args.eval_only)
    model = AutoModelForCausalLM.from_pretrained(args.eval_only, dtype=torch.float32).to(device).eval()
    samples = eval_samples(EVAL_TASKS, args, args.eval_only)
    from hylo_bench.tasks.ruler import score_prediction

    result = {}
    for task in EVAL_TASKS:
        group = [s for s in samples if s["task"] == task]
        preds = greedy_generate(model, tokenizer, [s["prompt"] for s in group], 128, device)
        scores = [score_prediction(task, p, s["outputs"]) for p, s in zip(preds, group)]
        result[task] = {"score": 100 * float(np.mean(scores)), "n": len(group)}
        console.print(f"{task}: {result[task]['score']:.1f}  e.g. gold {group[0]['outputs']} pred {preds[0]!r}")
    update_card(args.eval_only, result, args)


def save(model, tokenizer, out: Path, meta: dict | None) -> None:
    """HF checkpoint (fp32 safetensors), tokenizer files and the card."""
    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(out)
    tokenizer.save_pretrained(out)
    specials = {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[2]}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n", encoding="utf-8")
    # The generic class name loads with transformers 4.x (lm-eval) as well as 5.x (where it means TokenizersBackend).
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")
    if meta is not None:
        (out / "README.md").write_text(render_card(meta), encoding="utf-8")


def to_example(tokenizer, task: str, prompt: str, outputs: list[str]) -> Example:
    answer = tokenizer(format_answer(task, outputs), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    seq = np.asarray(tokenizer(prompt).input_ids + answer, np.int64)
    pos, gid = [], []
    if task in NIAH_TASKS:
        windows = np.lib.stride_tricks.sliding_window_view(seq, 7)
        for g, gold in enumerate(outputs):
            if gold.isdigit() and len(gold) == 7:
                pattern = np.asarray(tokenizer(gold, add_special_tokens=False).input_ids)
                for start in np.flatnonzero((windows == pattern).all(1)):
                    pos.append(np.arange(start, start + 7))
                    gid.append(g)
    n_prompt = len(seq) - len(answer)
    return Example(prompt_ids=seq[:n_prompt].astype(np.uint16), answer_ids=seq[n_prompt:].astype(np.uint16),
                   value_pos=np.asarray(pos, np.int32).reshape(-1, 7), value_gid=np.asarray(gid, np.int32))


def make_data(haystack: str, args: argparse.Namespace):
    """Tokenizer, training examples, seed-42 eval samples and the split dictionary ids (from ``--data-cache``
    when it exists)."""
    import tempfile

    if args.data_cache is not None and args.data_cache.exists():
        tokenizer, examples, evals = load_data(args.data_cache)
        console.print(f"loaded {len(examples)} samples from {args.data_cache}")
        return tokenizer, examples, evals, *text_ids(tokenizer, haystack)
    tasks = tuple(TASK_WEIGHTS) if args.eval_tasks == "all" else EVAL_TASKS
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(haystack, args, Path(tmp))
        tok_dir = Path(tmp) / "tokenizer"
        tokenizer.save_pretrained(tok_dir)
        examples = _run_pool(_example_worker, train_specs(args), tok_dir, args.workers, "train samples")
        evals = eval_samples(tasks, args, tok_dir)
    if args.data_cache is not None:
        save_data(args.data_cache, tokenizer, examples, evals)
    return tokenizer, examples, evals, *text_ids(tokenizer, haystack)


def save_data(path: Path, tokenizer, examples: list[Example], evals: list[dict]) -> None:
    """One npz: tokenizer.json text, eval samples (JSON) and the examples as concatenated arrays."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path, tokenizer=np.array(tokenizer.backend_tokenizer.to_str()), evals=np.array(json.dumps(evals)),
        prompt=np.concatenate([e.prompt_ids for e in examples]), answer=np.concatenate([e.answer_ids for e in examples]),
        prompt_len=np.array([len(e.prompt_ids) for e in examples]), answer_len=np.array([len(e.answer_ids) for e in examples]),
        value_pos=np.concatenate([e.value_pos for e in examples]), value_gid=np.concatenate([e.value_gid for e in examples]),
        value_len=np.array([len(e.value_gid) for e in examples]),
    )


def load_data(path: Path):
    from tokenizers import Tokenizer

    z = np.load(path)
    tokenizer = wrap_tokenizer(Tokenizer.from_str(str(z["tokenizer"])))
    cuts = {k: np.cumsum(z[f"{k}_len"])[:-1] for k in ("prompt", "answer", "value")}
    parts = {k: np.split(z[k], cuts[k]) for k in ("prompt", "answer")}
    vpos, vgid = np.split(z["value_pos"], cuts["value"]), np.split(z["value_gid"], cuts["value"])
    examples = [Example(prompt_ids=p, answer_ids=a, value_pos=vp.reshape(-1, 7), value_gid=vg)
                for p, a, vp, vg in zip(parts["prompt"], parts["answer"], vpos, vgid)]
    return tokenizer, examples, json.loads(str(z["evals"]))


def evaluate_both(model, tokenizer, evals: list[dict], args: argparse.Namespace) -> tuple[dict, dict]:
    """Seed-42 scores with full attention (as shipped) and with layers 0/2 windowed."""
    device = torch.device(args.device)
    result = evaluate(model, tokenizer, evals, device, args.eval_max_new)
    if args.local_prob == 0:
        for task in result:
            console.print(f"{task}: {result[task]['score']:.1f}  e.g. {result[task]['example']}")
        return result, {}
    use_local_mix(model, True)
    _LocalMode.window, _LocalMode.on = args.local_window, True
    result_local = evaluate(model, tokenizer, evals, device, args.eval_max_new)
    _LocalMode.on = False
    use_local_mix(model, False)
    for task in result:
        console.print(f"{task}: {result[task]['score']:.1f} (layers 0/2 windowed: {result_local[task]['score']:.1f})"
                      f"  e.g. {result[task]['example']}")
    return result, result_local


def build(args: argparse.Namespace) -> None:
    import transformers

    device = torch.device(args.device)
    haystack = HAYSTACK_PATH.read_text(encoding="utf-8")
    t0 = time.time()
    tokenizer, examples, evals, text_train, text_val = make_data(haystack, args)
    probes = [to_example(tokenizer, s["task"], s["prompt"], s["outputs"])
              for t in EVAL_TASKS for s in [e for e in evals if e["task"] == t][:25]]  # fmt: skip
    data_s = time.time() - t0
    console.print(f"data: {len(examples)} samples, {sum(len(e.prompt_ids) for e in examples):,} prompt tokens, "
                  f"{len(text_train):,} text tokens, {data_s:.0f} s")
    model = build_model(tokenizer, args.seed, args.vocab_size).to(device)
    t1, steps_requested = time.time(), args.steps
    log = train(model, examples, text_train, probes, args, tokenizer)
    train_s = time.time() - t1
    save(model, tokenizer, args.out, None)  # before the eval, so a failing eval keeps the weights
    model.to(device)
    t2 = time.time()
    result, result_local = evaluate_both(model, tokenizer, evals, args)
    val_loss = text_loss(model, text_val, tokenizer.bos_token_id, device)
    eval_s = time.time() - t2
    console.print(f"held-out text loss {val_loss:.3f}; data {data_s:.0f} s, train {train_s:.0f} s, eval {eval_s:.0f} s")
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    meta = {
        "command": "python " + " ".join(sys.argv), "device": f"{device.type}: {dev_name}", "torch": torch.__version__,
        "transformers": transformers.__version__, "num_params": sum(p.numel() for p in model.parameters()),
        "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
        "vocab": len(tokenizer), "task_mix": ", ".join(f"{t} {w:g}" for t, w in TASK_WEIGHTS.items()),
        "data_s": data_s, "train_s": train_s, "eval_s": eval_s, "val_loss": val_loss, "log": log,
        "eval": result, "eval_local": result_local, "steps_requested": steps_requested,
    } | {k: getattr(args, k) for k in ("seed", "num_samples", "min_len", "max_len", "text_frac", "steps",
                                       "batch_size", "lr", "warmup_steps", "local_prob", "local_window", "eval_length")}
    save(model, tokenizer, args.out, meta)
    console.print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.eval_only is not None:
        eval_only(args)
    else:
        build(args)


if __name__ == "__main__":
    main()
