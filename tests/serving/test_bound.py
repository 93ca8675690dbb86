"""Decode bandwidth bound: the bytes of a step equal a hand count for tiny configs (hybrid GDN / Mamba-2 / q/k
norms, transformer, tied head) and the engines' own cache sizes; the H200 entry; fraction_of_bound."""

from __future__ import annotations

import pytest
import torch

from hylo_bench.decode.engine import Engine, TransformerEngine
from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.serving import bound as Bd
from tests.conftest import make_base, tiny_hybrid_config


def _weights_minus_embedding(model, batch: int) -> int:
    """fp32 parameters minus the untied embedding table, plus the B rows looked up (hidden 64)."""
    n = sum(p.numel() for p in model.parameters())
    return 4 * (n - model.config.vocab_size * 64 + batch * 64)


@pytest.mark.parametrize("kw,per_token", [
    ({}, 2 * (32 + 8) * 4),  # 2 MLA layers x (kv_lora_rank 32 + rope 8) fp32
    ({"use_qk_norm": True}, 2 * (32 + 8 + 2) * 4),  # + the engine's 2 key scales (KV heads) per token
    ({"linear_type": "mamba"}, 2 * (32 + 8) * 4),
])
def test_hybrid_step_bytes_equal_a_hand_count(kw, per_token):
    model = HyLoForCausalLM(tiny_hybrid_config(**kw))
    B, T = 3, 10
    # per linear layer and sequence: GDN 2 heads x K 16 x Vd 32 fp32 state + (q 32 + k 32 + v 64) conv channels x
    # 3 taps fp32 = 4096 + 1536; Mamba-2 4 heads x P 16 x N 16 fp32 + (E 64 + 2 X 32) channels x 3 taps x 4 = same
    state = 2 * (4096 + 1536)
    got = Bd.decode_step_bytes(model, B, T)
    assert got["cache"] == B * T * per_token
    assert got["state"] == B * 2 * state  # read and written
    assert got["weights"] == _weights_minus_embedding(model, B)
    assert got["total"] == got["weights"] + got["cache"] + got["state"]
    cache = Engine(model, B, T).cache_bytes()  # the engine allocates exactly what the bound counts
    assert cache["mla_latent"] + cache["mla_key_scale"] == got["cache"] and 2 * cache["linear_state"] == got["state"]


def test_transformer_step_bytes_and_tied_head():
    model = make_base("qwen3")
    got = Bd.decode_step_bytes(model, 2, 7)
    assert got["cache"] == 2 * 7 * 4 * 2 * 2 * 16 * 4 == TransformerEngine(model, 2, 7).cache_bytes()["kv"]
    assert got["state"] == 0 and got["weights"] == 4 * (sum(p.numel() for p in model.parameters()) - 400 * 64 + 2 * 64)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: the head reads the whole matrix once
    n = sum(p.numel() for p in model.parameters())  # counts the shared matrix once
    assert Bd.decode_step_bytes(model, 2, 7)["weights"] == 4 * n


def test_bound_fields_use_the_table_or_a_given_bandwidth(monkeypatch):
    model = HyLoForCausalLM(tiny_hybrid_config())
    rec = Bd.bound_fields(model, 1, 100, 2e-6, "cpu", bandwidth=(1e12, "given"))
    total = Bd.decode_step_bytes(model, 1, 100)["total"]
    assert rec["bound_tpot_s"] == pytest.approx(total / 1e12) and rec["bandwidth_source"] == "given"
    assert rec["fraction_of_bound"] == pytest.approx(total / 1e12 / 2e-6)
    assert Bd.bound_fields(model, 1, 100, None, "cpu", bandwidth=(1e12, "given"))["fraction_of_bound"] is None
    Bd.copy_bandwidth.cache_clear()
    monkeypatch.setattr(Bd, "device_name", lambda device: "NVIDIA H200")
    assert Bd.copy_bandwidth("cuda:0") == (4.30e12, "table:H200")
    Bd.copy_bandwidth.cache_clear()
    with pytest.raises(ValueError, match="no decode bound"):
        Bd.decode_step_bytes(torch.nn.Sequential(torch.nn.Embedding(4, 4)), 1, 1)
