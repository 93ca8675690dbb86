"""The distillation memory model (``hylo_bench.upcycle.train.memory``): parameter counts equal the built models',
sharded components divide by the GPU count, activation components grow linearly with the sequence length."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.upcycle.train.memory import TransformerDims, kd_memory_budget
from tests.conftest import tiny_hybrid_config

SMALL = dict(vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen3", False)])
def test_teacher_param_count_equals_the_built_model(arch, tied):
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    cfg = cfg_cls(**SMALL, tie_word_embeddings=tied)
    model = model_cls(cfg)
    dims = TransformerDims.from_config(cfg)
    assert dims.params() == sum(p.numel() for p in model.parameters())
    assert dims.layer_params() == sum(p.numel() for p in model.model.layers[0].parameters())


@pytest.mark.parametrize("linear_type", ["gdn", "mamba"])
def test_budget_counts_and_scaling(linear_type):
    cfg = tiny_hybrid_config(linear_type=linear_type)
    teacher = TransformerDims.from_config(LlamaConfig(**SMALL))
    n_student = sum(p.numel() for p in HyLoForCausalLM(cfg).parameters())
    one = kd_memory_budget(cfg, teacher, 4096, 1)
    assert one["student_params"] == n_student and one["teacher_params"] == teacher.params()
    c1 = one["components_bytes"]
    assert (c1["student_weights"], c1["student_grads"], c1["optimizer_states"]) == (4 * n_student, 4 * n_student,
                                                                                  8 * n_student)
    assert c1["teacher_weights"] == 2 * teacher.params()
    four = kd_memory_budget(cfg, teacher, 4096, 4)["components_bytes"]
    for k in ("student_weights", "student_grads", "optimizer_states", "teacher_weights"):
        assert four[k] == c1[k] // 4, k
    for k in ("unsharded_params", "checkpointed_activations", "kl_buffers", "layer_backward"):
        assert four[k] == c1[k], k  # not sharded
    double = kd_memory_budget(cfg, teacher, 8192, 1)["components_bytes"]
    D = cfg.hidden_size
    assert double["checkpointed_activations"] == 2 * c1["checkpointed_activations"]
    assert c1["checkpointed_activations"] == 4096 * 2 * (cfg.n_layer * D + D + teacher.hidden)
    assert double["teacher_layer_forward"] == 2 * c1["teacher_layer_forward"]
    assert one["peak_bytes"] == one["persistent_bytes"] + one["transient_bytes"]
    with pytest.raises(ValueError, match="seq_len, n_gpus and kl_chunk_size must be >= 1"):
        kd_memory_budget(cfg, teacher, 0)
