"""The analytic memory model against vllm.md §6 (page alignment, grouping, capacity) and the spec's state sizes."""

from __future__ import annotations

import pytest

from hylo_bench.config import units as U
from hylo_bench.config.recipes import load_recipe, recipe_hybrid_config
from hylo_bench.models import memory as M
from tests.conftest import tiny_hybrid_config

GIB = 2 ** 30

# vllm.md §6.3 (bf16 conv and recurrent state, alignment 128, prefix caching off):
# layout -> (a, S, block_size, padding %, g, MLA groups, linear groups, pad layers, blocks/request 8K, 64K,
#            concurrency @ 8 GiB 8K, 64K)
VLLM_TABLE = {
    "HyLo-Llama-4MLA12GDN": (320, 1_609_728, 5120, 1.78, 4, 1, 3, 0, 5, 16, 262, 81.9),
    "HyLo-Llama-8MLA8GDN": (320, 1_609_728, 5120, 1.78, 8, 1, 1, 0, 3, 14, 218.3, 46.8),
    "HyLo-Llama-6MLA22GDN": (384, 2_414_592, 6400, 1.78, 6, 1, 4, 2, 6, 15, 97, 38.8),
    "HyLo-Llama-14MLA14GDN": (384, 2_414_592, 6400, 1.78, 14, 1, 1, 0, 3, 12, 83, 20.8),
    "HyLo-Qwen-7MLA21GDN": (640, 1_609_728, 2560, 1.78, 7, 1, 3, 0, 7, 29, 106.9, 25.8),
    "HyLo-Qwen-14MLA14GDN": (640, 1_609_728, 2560, 1.78, 14, 1, 1, 0, 5, 27, 74.8, 13.9),
    "HyLo-Qwen-14MLA14M2": (640, 561_152, 896, 2.19, 14, 1, 1, 0, 11, 75, 97.2, 14.3),
}


def _cfg(name):
    return recipe_hybrid_config(load_recipe(name))


@pytest.mark.parametrize("layout", sorted(VLLM_TABLE))
def test_vllm_page_arithmetic_reproduces_the_released_layout_table(layout):
    a, S, block, pad, g, mg, lg, pad_layers, b8, b64, c8, c64 = VLLM_TABLE[layout]
    p = M.vllm_page_layout(_cfg(f"{layout}-8K-SFT"))
    assert (p["attn_bytes_per_token_per_layer"], p["state_page_bytes"], p["block_size_tokens"]) == (a, S, block)
    assert (p["padding_pct"], p["group_size"], p["mla_groups"], p["linear_groups"], p["padding_layers"]) == \
        (pad, g, mg, lg, pad_layers)
    for length, blocks, conc in ((8192, b8, c8), (65536, b64, c64)):
        cap = M.vllm_capacity(p, 8 * GIB, length)
        assert cap["blocks_per_request"] == blocks
        assert round(cap["max_concurrency"], 1) == pytest.approx(conc, abs=0.05)


@pytest.mark.parametrize("layout, S, block", [("HyLo-Llama-6MLA22GDN", 4_773_888, 12_544),
                                              ("HyLo-Llama-4MLA12GDN", 3_182_592, 9_984),
                                              ("HyLo-Qwen-7MLA21GDN", 3_182_592, 4_992)])
def test_vllm_fp32_recurrent_state_doubles_the_page(layout, S, block):
    p = M.vllm_page_layout(_cfg(f"{layout}-64K-SFT"), ssm_dtype_bytes=4)  # vllm.md §6.3 note
    assert (p["state_page_bytes"], p["block_size_tokens"]) == (S, block)


def test_vllm_capacity_reproduces_the_cpu_toy_check():
    # vllm.md §6.2: 3 GDN + 1 MLA (r_kv 512 + rope 64), bf16 state, 256 MiB -> 1820 blocks of 128 tokens.
    cfg = tiny_hybrid_config(mla_layers=[3], kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64,
                             q_lora_rank=64, gdn_num_heads=1, gdn_head_dim=128, gdn_expand_v=1)
    p = M.vllm_page_layout(cfg)
    assert (p["block_size_tokens"], p["group_size"], p["mla_groups"], p["linear_groups"]) == (128, 1, 1, 3)
    for length, conc, tokens in ((1024, 165.45, 169_425), (16384, 13.89, 227_625), (65536, 3.53, 231_602)):
        cap = M.vllm_capacity(p, 256 * 2 ** 20, length)
        assert cap["num_blocks"] == 1820
        assert round(cap["max_concurrency"], 2) == conc and cap["kv_cache_size_tokens"] == tokens


def test_kv_percentages_and_state_sizes():
    cfg = _cfg("HyLo-Llama-6MLA22GDN-8K-SFT")
    assert M.kv_cache_bytes_per_token(cfg) == 2304 and M.backbone_kv_cache_bytes_per_token(cfg) == 114_688
    assert round(M.kv_cache_pct_of_base(cfg), 1) == 2.0
    st = M.linear_layer_state_bytes(cfg)  # 9 heads x 256 x 512 fp32; (2 x 2304 + 4608) x 3 bf16
    assert st == {"recurrent": 9 * 256 * 512 * 4, "conv": 9216 * 3 * 2}
    m2 = M.linear_layer_state_bytes(_cfg("HyLo-Qwen-14MLA14M2-8K-SFT"))  # §4.5 decode state, native layout
    assert m2 == {"recurrent": 16 * 128 * 128 * 4, "conv": 4096 * 3 * 2}


def test_backbone_param_counts_are_the_public_model_sizes():
    # tied embeddings: Llama-3.2-1B 1,235,814,400 and Llama-3.2-3B 3,212,749,824 (public sizes); Qwen3-1.7B
    # 28 x 50,336,000 + 151,936 x 2048 + 2048 (its card: 1.4B non-embedding parameters)
    assert M.backbone_param_count(_cfg("HyLo-Llama-4MLA12GDN-8K-SFT")) == 1_235_814_400
    assert M.backbone_param_count(_cfg("HyLo-Llama-6MLA22GDN-8K-SFT")) == 3_212_749_824
    assert M.backbone_param_count(_cfg("HyLo-Qwen-7MLA21GDN-8K-SFT")) == 1_720_574_976


def test_max_context_and_parse_bytes():
    assert U.parse_bytes("141GiB") == 141 * GIB and U.parse_bytes("80GB") == 80 * 10 ** 9
    assert U.parse_bytes("1024B") == 1024 and U.parse_bytes("1.5 KiB") == 1536 and U.parse_bytes("0") == 0
    with pytest.raises(ValueError, match="141GiB"):
        U.parse_bytes("12 parsecs")
    assert M.max_context_tokens(1000, 200, 8) == 100 and M.max_context_tokens(100, 200, 8) == 0
    assert M.max_context_tokens(100, 0, 0) is None
