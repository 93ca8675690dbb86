"""Per-layer torch.compile for training: the compiled student and teacher give the eager KD loss and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.upcycle.train.compile import compile_decoder_layers
from hylo_bench.upcycle.train.losses import kd_loss
from tests.conftest import make_base, tiny_hybrid_config


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_give_eager_loss_and_grads(checkpointing):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    teacher = make_base("qwen3", vocab_size=97)
    torch.manual_seed(0)
    student = HyLoForCausalLM(tiny_hybrid_config(use_qk_norm=True)).train()
    student.model.gradient_checkpointing = checkpointing
    twin_s, twin_t = copy.deepcopy(student), copy.deepcopy(teacher)
    ids = torch.randint(3, 97, (2, 24))
    want, _ = kd_loss(student, teacher, ids, chunk_size=16)
    want.backward()
    assert compile_decoder_layers(twin_s, twin_t, backend="aot_eager") == 8
    got, _ = kd_loss(twin_s, twin_t, ids, chunk_size=16)
    got.backward()
    assert torch.allclose(got, want, rtol=1e-5, atol=0) and want > 0
    for (name, p), q in zip(student.named_parameters(), twin_s.parameters()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-4, atol=1e-7), name
    assert all(layer._compiled_call_impl is not None for layer in twin_s.model.layers)
    # really compiled (suppress_errors would fall back to eager silently): one graph or more per layer kind
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 3


def test_compile_rejects_a_model_without_layers():
    with pytest.raises(ValueError, match="no .model.layers"):
        compile_decoder_layers(torch.nn.Linear(2, 2))
