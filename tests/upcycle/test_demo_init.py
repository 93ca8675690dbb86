"""The init carries the base model's knowledge: on held-out demo data the upcycled (untrained) student is at
least 10x closer to the demo teacher (forward KL) than the same hybrid with random weights."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.models.loading import demo_teacher_dir
from hylo_bench.upcycle.data import build_windows
from hylo_bench.upcycle.losses import eval_kl
from hylo_bench.upcycle.transfer import hybrid_config_for, init_student


def test_upcycled_init_is_10x_closer_to_teacher_than_random_init():
    d = demo_teacher_dir()
    teacher = AutoModelForCausalLM.from_pretrained(d).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(d)
    cfg = hybrid_config_for(teacher.config, [1, 3])
    student = init_student(teacher, cfg).eval()
    torch.manual_seed(0)
    random_student = HyLoForCausalLM(cfg).eval()
    held_out = build_windows("demo", tok, 512, 4, seed=123_457)  # seeds disjoint from the upcycle run's
    kl_init = eval_kl(student, teacher, held_out)
    kl_random = eval_kl(random_student, teacher, held_out)
    assert kl_random >= 10 * kl_init, (kl_init, kl_random)
