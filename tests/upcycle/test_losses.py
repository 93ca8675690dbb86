"""Stage losses: Enhanced-ILD terms and optimisation, chunked KD equals the full-logit KL of the models."""

from __future__ import annotations

import torch

from hylo_bench.config.student import hybrid_config_for
from hylo_bench.kernels.kl import kl_div_reference
from hylo_bench.upcycle.train.losses import ild_loss, kd_loss, teacher_layer_io
from hylo_bench.upcycle.transfer import init_student
from tests.conftest import make_base


def _pair():
    base = make_base("llama", vocab_size=200).requires_grad_(False)
    return base, init_student(base, hybrid_config_for(base.config, [1, 3], kv_lora_rank=64, q_lora_rank=64))


def test_teacher_layer_io_matches_hidden_states():
    base, _ = _pair()
    x = torch.randint(0, 200, (2, 16))
    ins, outs, mix = teacher_layer_io(base, x)
    hs = base(x, output_hidden_states=True).hidden_states
    for i in range(4):
        assert torch.equal(ins[i], hs[i])
    assert torch.allclose(outs[2], hs[3])
    layer = base.model.layers[0]
    assert torch.allclose(outs[0] - ins[0] - mix[0],
                          layer.mlp(layer.post_attention_layernorm(ins[0] + mix[0])), atol=1e-6)


def test_ild_loss_is_sum_of_per_layer_l2_and_decreases():
    base, student = _pair()
    x = torch.randint(0, 200, (2, 32))
    loss, logs = ild_loss(student, base, x)
    assert torch.isclose(loss, torch.tensor(logs["ild_hidden"] + logs["ild_mixer"]), rtol=1e-6)
    params = [p for n, p in student.named_parameters() if "embed" not in n and "lm_head" not in n]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    first = loss.item()
    for _ in range(40):
        loss, _ = ild_loss(student, base, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first
    assert student.lm_head.weight.grad is None  # teacher forcing: no gradient reaches the head


def test_kd_loss_equals_full_logit_kl():
    base, student = _pair()
    student.double(), base.double()
    x = torch.randint(0, 200, (2, 12))
    loss, _ = kd_loss(student, base, x, chunk_size=5)
    ref = kl_div_reference(student(x).logits.flatten(0, 1), base(x).logits.flatten(0, 1))
    assert torch.allclose(loss, ref, rtol=1e-10)
