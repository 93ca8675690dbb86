"""The init carries the base model's knowledge, measured as forward KL to the demo teacher on held-out data.

Measured (CPU, this test's data, the shipped retrieval-trained teacher), KL in nats/token, init vs random:

| student | held-out text | held-out demo windows |
|---|---|---|
| all MLA (SVD init) | 2.96 vs 5.58 (1.9x) | 2.87 vs 6.55 (2.3x) |
| 2MLA2GDN (the demo layout) | 3.56 vs 5.57 (1.6x) | 3.59 vs 6.53 (1.8x) |

The issue asks for 10x. The reference init (checkpoint-format.md section 7.2, Zebra-Llama's SVD) keeps the content
part of the attention logits but not their positional part: the first d_N dims lose RoPE, the last d_R dims are
rotated in adjacent pairs (HF rotates halves) and k_pe is averaged over the KV heads. This teacher's attention is
strongly positional (it was trained for needle retrieval with 64-token windows in layers 0/2), so the init keeps
less of it than it did for an earlier build that had learned only the text (all-MLA 0.18 vs 3.0, 16x). ILD then
restores it: the demo upcycle ends at 0.14 nats/token (27x below its init) and the student retrieves like the
teacher (tests/test_demo_teacher.py and the README quick start).

Where the init KL comes from (``benchmarks/init_kl_decomposition.py``, results/init_kl_decomposition.json, demo
windows): the MLA init alone in layers 1 and 3 (the retrieval layers) costs 2.45, the GDN init alone in layers 0 and
2 costs 1.01. In the teacher's own layer-1 / layer-3 attention, averaging only the rotated key dims over the 2 KV
heads (what MLA's one shared ``k_pe`` imposes), with RoPE otherwise exact, already costs 0.76 / 0.85; so does RoPE
on half the pairs left unrotated (0.81 / 0.53 for the even pairs). Any MLA with one rope key therefore stays far
above 0.65 nats/token (10x below 6.53) on this teacher at init.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hylo_bench.config.student import hybrid_config_for
from hylo_bench.models.checkpoint import demo_teacher_dir
from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.upcycle.data import build_windows, text_windows
from hylo_bench.upcycle.documents import shipped_text, split_documents
from hylo_bench.upcycle.train.losses import eval_kl
from hylo_bench.upcycle.transfer import init_student


@pytest.fixture(scope="module")
def teacher_and_tok():
    d = demo_teacher_dir()
    return AutoModelForCausalLM.from_pretrained(d).eval().requires_grad_(False), AutoTokenizer.from_pretrained(d)


def _kl_pair(teacher, mla_layers, windows):
    cfg = hybrid_config_for(teacher.config, mla_layers)
    torch.manual_seed(0)
    student = init_student(teacher, cfg).eval()
    torch.manual_seed(0)
    random_student = HyLoForCausalLM(cfg).eval()
    return eval_kl(student, teacher, windows), eval_kl(random_student, teacher, windows)


def test_all_mla_init_is_closer_than_random_on_held_out_text(teacher_and_tok):
    teacher, tok = teacher_and_tok
    held_out = text_windows(split_documents(shipped_text())[-200:], tok, 512)[:4]  # the last 5 % of the text
    kl_init, kl_random = _kl_pair(teacher, [0, 1, 2, 3], held_out)
    assert kl_random >= 1.7 * kl_init, (kl_init, kl_random)  # measured 2.96 vs 5.58


def test_default_hybrid_init_is_closer_than_random(teacher_and_tok):
    teacher, tok = teacher_and_tok
    held_out = build_windows("demo", tok, 512, 4, seed=123_457)  # seeds disjoint from the upcycle run's
    kl_init, kl_random = _kl_pair(teacher, [1, 3], held_out)
    assert kl_random >= 1.6 * kl_init, (kl_init, kl_random)  # measured 3.59 vs 6.53
