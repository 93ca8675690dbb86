"""Analytic memory model of a HyLo hybrid and its backbone: KV cache per token, recurrent state per sequence,
weights, the largest context that fits a GPU, and vLLM's hybrid page / capacity arithmetic.

Pure arithmetic over a ``HyLoConfig`` (no torch, no vLLM); shared by ``hylo-bench info`` and ``hylo-bench kv``.
Sources: checkpoint-format.md §4.4-4.5 (state shapes), §6 (MLA latent cache, KV-cache %); vllm.md §6
(page alignment, grouping, capacity); paper App. A.2.1 (KV-cache % definition).

Conventions (bytes): the KV cache is bf16 (2 bytes/element) as in the paper and vLLM. The native recurrent
state defaults to fp32 (fla and ``hylo_bench.models.gdn.GDNState`` keep it in fp32) and the conv state to bf16
with kernel - 1 columns; vLLM's arithmetic defaults to bf16 for both (``--mamba-ssm-cache-dtype`` decides there).
"""

from __future__ import annotations

import math
from typing import Any

BF16_BYTES = 2
FP32_BYTES = 4
VLLM_MLA_ALIGNMENT_TOKENS = 128  # vllm.md §6.1 step 3: block alignment with MLA is at least 128


def mla_latent_width(cfg) -> int:
    """Elements cached per token per MLA layer: r_kv + d_R (checkpoint-format.md §6)."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def kv_cache_bytes_per_token(cfg, dtype_bytes: int = BF16_BYTES) -> int:
    """Hybrid KV cache, bytes per token over the whole model: #MLA x (r_kv + d_R) x dtype (§6); summed per layer
    when a legacy ``layer_rank_list`` gives the MLA layers different r_kv."""
    if getattr(cfg, "layer_rank_list", None):
        return sum(cfg.mla_ranks(i)[1] + cfg.qk_rope_head_dim for i in cfg.mla_layers) * dtype_bytes
    return len(cfg.mla_layers) * mla_latent_width(cfg) * dtype_bytes


def backbone_kv_cache_bytes_per_token(cfg, dtype_bytes: int = BF16_BYTES) -> int:
    """Backbone (GQA transformer) KV cache, bytes per token: L x 2 x n_kv x d_h x dtype (paper App. A.2.1)."""
    return cfg.n_layer * 2 * cfg.base_num_key_value_heads * cfg.base_head_dim * dtype_bytes


def kv_cache_pct_of_base(cfg) -> float:
    """Hybrid KV cache as a percentage of the backbone's (paper Tables 2-4: 3.9, 7.8, 2.0, 4.7, 3.9, 7.8)."""
    return 100.0 * kv_cache_bytes_per_token(cfg) / backbone_kv_cache_bytes_per_token(cfg)


def mamba2_dims(cfg) -> dict[str, int]:
    """Mamba-2 sizes from ``d_inner``, ``d_xb`` and ``ssm_cfg`` (checkpoint-format.md §3.1, §4.5).

    headdim = d_state (Zebra-Llama), nheads = d_inner / headdim, ngroups = ``ssm_cfg["ngroups"]``,
    conv_dim = d_inner + 2 d_xb, conv width ``ssm_cfg.get("d_conv", 4)``.

    Raises:
        ValueError: when ``d_inner`` / ``d_xb`` / ``ssm_cfg.d_state`` are missing.
    """
    ssm = cfg.ssm_cfg or {}
    if not cfg.d_inner or not cfg.d_xb or "d_state" not in ssm:
        raise ValueError("a Mamba-2 hybrid needs hybrid config keys d_inner, d_xb and ssm_cfg.d_state "
                         f"(got d_inner={cfg.d_inner}, d_xb={cfg.d_xb}, ssm_cfg={ssm})")
    d_state = int(ssm["d_state"])
    headdim = int(ssm.get("headdim", d_state))
    nheads = cfg.d_inner // headdim
    return dict(d_inner=cfg.d_inner, d_xb=cfg.d_xb, d_state=d_state, headdim=headdim, nheads=nheads,
                ngroups=int(ssm.get("ngroups", nheads)), conv_dim=cfg.d_inner + 2 * cfg.d_xb,
                conv_width=int(ssm.get("d_conv", 4)))


def linear_layer_state_bytes(cfg, ssm_dtype_bytes: int = FP32_BYTES, conv_dtype_bytes: int = BF16_BYTES,
                             vllm_layout: bool = False) -> dict[str, int]:
    """Recurrent + conv state of one linear layer for one sequence, bytes (independent of length).

    GDN (§4.4): recurrent h x K x Vd; conv (2 h K + h Vd) x (W - 1). Mamba-2 (§4.5): ssm nheads x headdim x
    d_state; conv (d_inner + 2 d_xb) x (W - 1), or with ``vllm_layout`` x/B expanded to ``ngroups`` groups
    (d_inner + 2 ngroups d_state, vllm.md §4).

    Returns:
        ``{"recurrent": bytes, "conv": bytes}``; zeros for a model without linear layers.
    """
    if len(cfg.mla_layers) == cfg.n_layer:
        return {"recurrent": 0, "conv": 0}
    if cfg.linear_type == "gdn":
        h, k, vd, w = cfg.gdn_num_heads, cfg.gdn_head_dim, cfg.gdn_value_head_dim, cfg.gdn_conv_size
        return {"recurrent": h * k * vd * ssm_dtype_bytes, "conv": (2 * h * k + h * vd) * (w - 1) * conv_dtype_bytes}
    m = mamba2_dims(cfg)
    conv_ch = m["d_inner"] + 2 * m["ngroups"] * m["d_state"] if vllm_layout else m["conv_dim"]
    return {"recurrent": m["nheads"] * m["headdim"] * m["d_state"] * ssm_dtype_bytes,
            "conv": conv_ch * (m["conv_width"] - 1) * conv_dtype_bytes}


def state_bytes_per_sequence(cfg, ssm_dtype_bytes: int = FP32_BYTES, conv_dtype_bytes: int = BF16_BYTES) -> int:
    """Recurrent + conv state of all linear layers for one sequence, bytes (native layout)."""
    per = linear_layer_state_bytes(cfg, ssm_dtype_bytes, conv_dtype_bytes)
    return (cfg.n_layer - len(cfg.mla_layers)) * (per["recurrent"] + per["conv"])


def native_extra_bytes_per_token(cfg) -> int:
    """Bookkeeping the native cache (``hylo_bench.models.cache.MLALayerCache``) adds per token per MLA layer:
    a 1-byte padding mask, plus an int64 position when Qwen3 q/k norms force pre-RoPE keys."""
    return len(cfg.mla_layers) * (1 + (8 if cfg.use_qk_norm else 0))


def backbone_param_count(cfg) -> int:
    """Parameters of the backbone transformer (Llama / Qwen3 with GQA, SwiGLU), from the base dims.

    Counts q/k/v/o (+ Qwen3 q_norm/k_norm of d_h each), the MLP, two norms per layer, the final norm, the
    embedding, and a separate head unless the base config ties it (Llama-3.2 and Qwen3-1.7B tie).
    """
    base = cfg.base_config or {}
    H, d_h, n_h, n_kv = cfg.hidden_size, cfg.base_head_dim, cfg.num_attention_heads, cfg.base_num_key_value_heads
    attn = H * n_h * d_h * 2 + H * n_kv * d_h * 2
    if base.get("attention_bias"):
        attn += n_h * d_h + 2 * n_kv * d_h + H
    if cfg.base_model_type == "qwen3":
        attn += 2 * d_h
    layer = attn + 3 * H * cfg.intermediate_size + 2 * H
    tied = bool(base.get("tie_word_embeddings", True))
    return cfg.n_layer * layer + H + cfg.vocab_size * H * (1 if tied else 2)


def analytic_mixer_params(cfg, kind: str) -> dict[str, int]:
    """Parameter count per tensor of one mixer of ``kind`` (``"mla"``, ``"gdn"``, ``"mamba"``), from the
    shape tables of checkpoint-format.md §4.2, §4.4, §4.5. Used when a mixer class is not in this build."""
    H = cfg.hidden_size
    if kind == "mla":
        n_h, d_qk, rq, rkv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        out = {"mla.q_a_proj.weight": rq * H, "mla.q_b_proj.weight": n_h * d_qk * rq,
               "mla.kv_a_proj_with_mqa.weight": (rkv + cfg.qk_rope_head_dim) * H,
               "mla.kv_b_proj.weight": cfg.num_key_value_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * rkv,
               "mla.out_proj.weight": H * n_h * cfg.v_head_dim}
        if cfg.use_qk_norm:
            out.update({"mla.q_norm.weight": d_qk, "mla.k_norm.weight": d_qk})
        return out
    if kind == "gdn":
        h, k, vd, w = cfg.gdn_num_heads, cfg.gdn_head_dim, cfg.gdn_value_head_dim, cfg.gdn_conv_size
        return {"gdn.q_proj.weight": h * k * H, "gdn.k_proj.weight": h * k * H, "gdn.v_proj.weight": h * vd * H,
                "gdn.a_proj.weight": h * H, "gdn.b_proj.weight": h * H, "gdn.A_log": h, "gdn.dt_bias": h,
                "gdn.q_conv1d.weight": h * k * w, "gdn.k_conv1d.weight": h * k * w, "gdn.v_conv1d.weight": h * vd * w,
                "gdn.g_proj.weight": h * vd * H, "gdn.o_norm.weight": vd, "gdn.o_proj.weight": H * h * vd}
    m = mamba2_dims(cfg)
    return {"mamba.in_proj.weight": (2 * m["d_inner"] + 2 * m["d_xb"] + m["nheads"]) * H,
            "mamba.conv1d.weight": m["conv_dim"] * m["conv_width"], "mamba.conv1d.bias": m["conv_dim"],
            "mamba.dt_bias": m["nheads"], "mamba.A_log": m["nheads"], "mamba.D": m["nheads"],
            "mamba.norm.weight": m["d_inner"], "mamba.out_proj.weight": H * m["d_inner"]}


def max_context_tokens(budget_bytes: int, fixed_bytes: int, bytes_per_token: int) -> int | None:
    """Largest context (tokens, batch 1) with ``fixed_bytes + tokens * bytes_per_token <= budget_bytes``;
    0 when even the fixed part does not fit, None when nothing grows with length (no attention layer)."""
    if bytes_per_token <= 0:
        return None
    return max(0, (budget_bytes - fixed_bytes) // bytes_per_token)


def vllm_page_layout(cfg, ssm_dtype_bytes: int = BF16_BYTES, conv_dtype_bytes: int = BF16_BYTES,
                     kv_dtype_bytes: int = BF16_BYTES, alignment: int = VLLM_MLA_ALIGNMENT_TOKENS) -> dict[str, Any]:
    """vLLM's unified page for the layout (vllm.md §6.1-6.2; prefix caching off).

    a = (r_kv + d_R) x dtype bytes per token per MLA layer; S = one linear layer's state page;
    block_size = alignment x ceil(S / (alignment x a)); page = block_size x a; group size g = the smaller
    layer bucket's count, or the larger if max < 1.5 min; each bucket is cut into ceil(n / g) groups.

    Returns:
        dict with ``attn_bytes_per_token_per_layer``, ``state_page_bytes``, ``block_size_tokens``,
        ``page_bytes``, ``padding_pct``, ``group_size``, ``mla_groups``, ``linear_groups``,
        ``padding_layers``, ``block_bytes`` (= g x page).
    """
    n_mla, n_lin = len(cfg.mla_layers), cfg.n_layer - len(cfg.mla_layers)
    a = mla_latent_width(cfg) * kv_dtype_bytes
    st = linear_layer_state_bytes(cfg, ssm_dtype_bytes, conv_dtype_bytes, vllm_layout=True)
    S = st["recurrent"] + st["conv"]
    if n_mla and n_lin:
        block = alignment * math.ceil(S / (alignment * a))
    else:
        block = alignment
    page = block * a if n_mla else S
    counts = [c for c in (n_mla, n_lin) if c]
    lo, hi = min(counts), max(counts)
    g = hi if hi < 1.5 * lo else lo
    mla_groups, lin_groups = math.ceil(n_mla / g), math.ceil(n_lin / g)
    return dict(attn_bytes_per_token_per_layer=a, state_page_bytes=S, block_size_tokens=block, page_bytes=page,
                padding_pct=round(100.0 * (page - S) / S, 2) if n_mla and n_lin else 0.0, group_size=g,
                mla_groups=mla_groups, linear_groups=lin_groups,
                padding_layers=mla_groups * g - n_mla + lin_groups * g - n_lin, block_bytes=g * page)


def vllm_capacity(layout: dict[str, Any], available_bytes: int, max_model_len: int) -> dict[str, Any]:
    """vLLM's block count and reported capacity for ``available_bytes`` of KV-cache memory (vllm.md §6.2).

    num_blocks = available // (g x page); blocks per request = mla_groups x ceil(L / block_size) +
    linear_groups (one state block each, prefix caching off); concurrency = num_blocks / blocks per request;
    ``kv_cache_size_tokens`` = int(concurrency x L); ``max_model_len_tokens``: the largest L one request fits.
    """
    num_blocks = available_bytes // layout["block_bytes"] if available_bytes > 0 else 0
    bs, mg, lg = layout["block_size_tokens"], layout["mla_groups"], layout["linear_groups"]
    per_request = mg * math.ceil(max_model_len / bs) + lg
    concurrency = num_blocks / per_request
    fit = (num_blocks - lg) // mg * bs if mg else None
    return dict(available_bytes=int(available_bytes), num_blocks=int(num_blocks), max_model_len=max_model_len,
                blocks_per_request=per_request, max_concurrency=concurrency,
                kv_cache_size_tokens=int(concurrency * max_model_len),
                max_model_len_tokens=max(0, fit) if fit is not None else None)


def estimate(cfg, *, weight_params: int, fp32_params: int = 0, gpu_mem_bytes: int | None = None,
             gpu_util: float = 0.92, reserve_bytes: int = 0, max_model_len: int | None = None,
             ssm_dtype_bytes: int = FP32_BYTES, conv_dtype_bytes: int = BF16_BYTES,
             vllm_ssm_dtype_bytes: int = BF16_BYTES) -> dict[str, Any]:
    """The ``hylo-bench kv`` memory model for one hybrid config.

    Args:
        cfg: ``HyLoConfig``.
        weight_params: hybrid parameter count (weights in bf16, 2 bytes each) ...
        fp32_params: ... of which these stay fp32 (GDN ``A_log`` / ``dt_bias``).
        gpu_mem_bytes: GPU memory; when given, the largest batch-1 context of hybrid and backbone is predicted
            with budget = gpu_mem x gpu_util - reserve_bytes - weights - state.
        gpu_util: usable fraction of GPU memory (vLLM's ``gpu_memory_utilization`` default 0.92).
        reserve_bytes: activations / workspace held back (bytes).
        max_model_len: request length for the vLLM capacity numbers (tokens).
        ssm_dtype_bytes, conv_dtype_bytes: native recurrent / conv state element sizes.
        vllm_ssm_dtype_bytes: vLLM's recurrent state element size (``--mamba-ssm-cache-dtype``).

    Returns:
        JSON-ready dict: ``kv_cache_bytes_per_token``, ``state_bytes_per_sequence``, ``weight_bytes``,
        backbone figures, ``kv_cache_pct_of_base``, ``vllm`` page layout, and with ``gpu_mem_bytes``
        ``max_context_tokens`` ``{"hybrid", "backbone"}`` and vLLM capacity.

    Raises:
        ValueError: ``gpu_util`` outside (0, 1] (a fraction, as vLLM's ``gpu_memory_utilization``), negative
            ``reserve_bytes``, or a non-positive ``gpu_mem_bytes`` / ``max_model_len``.
    """
    if isinstance(gpu_util, bool) or not isinstance(gpu_util, (int, float)) or not 0.0 < gpu_util <= 1.0:
        raise ValueError(f"--gpu-util {gpu_util!r}: expected a fraction of GPU memory in (0, 1], e.g. 0.92")
    if reserve_bytes < 0:
        raise ValueError(f"--reserve {reserve_bytes} bytes: expected >= 0")
    if gpu_mem_bytes is not None and gpu_mem_bytes <= 0:
        raise ValueError(f"--gpu-mem {gpu_mem_bytes} bytes: expected > 0")
    if max_model_len is not None and max_model_len <= 0:
        raise ValueError(f"--max-model-len {max_model_len}: expected a positive number of tokens")
    kv = kv_cache_bytes_per_token(cfg)
    base_kv = backbone_kv_cache_bytes_per_token(cfg)
    state = state_bytes_per_sequence(cfg, ssm_dtype_bytes, conv_dtype_bytes)
    weights = weight_params * BF16_BYTES + fp32_params * (FP32_BYTES - BF16_BYTES)
    base_params = backbone_param_count(cfg)
    base_weights = base_params * BF16_BYTES
    layout = vllm_page_layout(cfg, ssm_dtype_bytes=vllm_ssm_dtype_bytes)
    out: dict[str, Any] = dict(
        kv_cache_bytes_per_token=kv, state_bytes_per_sequence=state, weight_bytes=weights,
        params=weight_params, kv_cache_pct_of_base=round(100.0 * kv / base_kv, 4),
        native_extra_bytes_per_token=native_extra_bytes_per_token(cfg),
        state_dtype={"recurrent": {4: "float32", 2: "bfloat16"}.get(ssm_dtype_bytes, f"{ssm_dtype_bytes} B"),
                     "conv": {4: "float32", 2: "bfloat16"}.get(conv_dtype_bytes, f"{conv_dtype_bytes} B")},
        backbone={"params": base_params, "weight_bytes": base_weights, "kv_cache_bytes_per_token": base_kv},
        vllm={"page": layout})
    if max_model_len:
        blocks = layout["mla_groups"] * math.ceil(max_model_len / layout["block_size_tokens"])
        out["vllm"]["blocks_per_request"] = blocks + layout["linear_groups"]
        out["vllm"]["max_model_len"] = max_model_len
    if gpu_mem_bytes is not None:
        budget = int(gpu_mem_bytes * gpu_util) - reserve_bytes
        out["gpu"] = {"gpu_mem_bytes": gpu_mem_bytes, "gpu_util": gpu_util, "reserve_bytes": reserve_bytes,
                      "budget_bytes": budget}
        out["max_context_tokens"] = {"hybrid": max_context_tokens(budget, weights + state, kv),
                                     "backbone": max_context_tokens(budget, base_weights, base_kv)}
        if max_model_len:
            out["vllm"]["capacity"] = vllm_capacity(layout, budget - weights, max_model_len)
    return out


def engine_extra_bytes_per_token(cfg, dtype_bytes: int = BF16_BYTES) -> int:
    """Bytes per token the native serving engine caches beyond the latent (``hylo_bench.decode.mla_layer``):
    with Qwen3 q/k norms, one key scale per KV group per MLA layer (#MLA x n_kvm x dtype), else 0."""
    return len(cfg.mla_layers) * cfg.num_key_value_heads * dtype_bytes if cfg.use_qk_norm else 0


def serving_peak_bytes(*, weight_bytes: int, batch: int, tokens: int, kv_bytes_per_token: int,
                       state_bytes_per_sequence: int = 0) -> int:
    """Memory-model prediction of decode-time memory: weights + batch x (state + tokens x KV bytes per token).
    Activations and workspace are left out (small at decode; prefill transients are reported separately)."""
    return weight_bytes + batch * (state_bytes_per_sequence + tokens * kv_bytes_per_token)
