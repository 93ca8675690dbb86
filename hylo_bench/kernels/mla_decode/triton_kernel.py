"""Triton split-KV ("flash-decoding") kernel for absorbed-weight MLA decode over the latent cache. CUDA only;
imported lazily by :func:`hylo_bench.kernels.mla_decode.mla_decode`. Contract: ``mla_decode_reference``.

All H query heads share one latent row per token (MQA over the latent), so one program handles every head of
one sequence for one split of the cache: scores ``[H, BLOCK_N] = q_lat @ c^T + q_rope @ kr^T`` with fp32
accumulation, an online softmax, and ``acc [H, R] += p @ c``. Splits are combined in torch (log-sum-exp merge).
The number of splits depends only on the cache's capacity T and the batch, and the valid length is read from a
device tensor, so the launch is CUDA-graph safe.

Legend: B batch, T cache slots, S splits, H heads, G key-scale groups, R kv_lora_rank, P qk_rope_head_dim.
Adapted from the split-KV decode design of FlashDecoding / vLLM ``triton_decode_attention`` (own code).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo_bench.kernels.l2_prefetch import line_elements, prefetch_l2
from hylo_bench.kernels.pdl import use_pdl
from hylo_bench.kernels.tuning import fastest

# split granularity in tokens; the kernel's own tile (tuned, SPLIT_CONFIGS) may be larger, masks cover the rest
BLOCK_N = 32
TARGET_PROGRAMS = 264  # about two waves on an H200 (132 SMs)


# (BLOCK_N, num_warps, num_stages) candidates of the split kernel. The first call per shape times each with every
# sequence at full cache length (:func:`hylo_bench.kernels.tuning.fastest`): Triton's autotuner timed whatever
# lengths the first call had, so an engine sized for 64K but first run at 8K kept a config that read the 64K cache at
# 18 -> 25 us per layer
# (H200: 58.4 % of the bandwidth bound at 64K instead of 60.1 %; benchmarks/results/decode_profile_glue.json and
# decode_profile_64k_tuned_at_64k.json).
# True: with PDL the split kernel asks L2 for its share of the cache rows before waiting for the prep kernel
# (hylo_bench.kernels.l2_prefetch). Off: see gemv.triton_kernel.L2_PREFETCH.
L2_PREFETCH = False
SPLIT_CONFIGS = ((32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2), (128, 8, 3))
_BEST_SPLIT: dict[tuple, tuple[int, int, int]] = {}


@triton.jit
def _mla_decode_split_kernel(
    Q_lat, Q_rope, Cache, KScale, Lengths, Acc, M, L,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_cb, stride_ct, stride_kb, stride_kt,
    stride_ab, stride_as, stride_ah, stride_mb, stride_ms,
    sm_scale, tokens_per_split, capacity,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr, REP: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    PDL: tl.constexpr, L2_PF: tl.constexpr,
):
    """One (sequence b, split) program (module docstring). PDL: launched with programmatic dependent launch; the
    queries, lengths and the new token's row are the previous kernel's (the prep kernel's) output, read after
    ``gdc_wait``. L2_PF (with PDL; 0: off): cache elements per L2 line; before the wait the program asks L2 for its
    split's rows up to the length it reads without waiting (this step's or the last one's, or stale memory: only a
    hint, clamped to the cache's ``capacity`` rows)."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    start = split * tokens_per_split
    if PDL:
        if L2_PF > 0:
            # .cg: no L1 copy to go stale. Clamped to [0, capacity] before scaling: stale memory can hold any int64
            hint = tl.maximum(tl.load(Lengths + b, cache_modifier=".cg").to(tl.int64), 0)
            stop = tl.minimum(tl.minimum(start + tokens_per_split, capacity).to(tl.int64), hint) * stride_ct
            first = start.to(tl.int64) * stride_ct
            offs_l = tl.arange(0, 256) * L2_PF
            base = Cache + b.to(tl.int64) * stride_cb
            for e0 in range(first, stop, 256 * L2_PF):
                prefetch_l2(base + tl.minimum(e0 + offs_l, stop - 1))
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    length = tl.load(Lengths + b).to(tl.int32)
    end = tl.minimum(start + tokens_per_split, length)

    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    mask_h = offs_h < H
    q_lat = tl.load(Q_lat + b * stride_qlb + offs_h[:, None] * stride_qlh + offs_r[None, :],
                    mask=mask_h[:, None] & (offs_r[None, :] < R), other=0.0)
    q_rope = tl.load(Q_rope + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_p[None, :],
                     mask=mask_h[:, None] & (offs_p[None, :] < P), other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    cache_b = Cache + b.to(tl.int64) * stride_cb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        rows = offs_n.to(tl.int64)[:, None] * stride_ct
        c = tl.load(cache_b + rows + offs_r[None, :], mask=mask_n[:, None] & (offs_r[None, :] < R), other=0.0)
        kr = tl.load(cache_b + rows + R + offs_p[None, :], mask=mask_n[:, None] & (offs_p[None, :] < P),
                     other=0.0)
        s = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_rope, tl.trans(kr))  # [BLOCK_H, BLOCK_N] fp32
        if HAS_SCALE:
            ks = tl.load(KScale + b.to(tl.int64) * stride_kb + offs_n.to(tl.int64)[None, :] * stride_kt
                         + (offs_h // REP)[:, None], mask=mask_h[:, None] & mask_n[None, :], other=0.0)
            s = s * ks.to(tl.float32)
        s = s * sm_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new

    base = b * stride_ab + split * stride_as
    tl.store(Acc + base + offs_h[:, None] * stride_ah + offs_r[None, :], acc,
             mask=mask_h[:, None] & (offs_r[None, :] < R))
    tl.store(M + b * stride_mb + split * stride_ms + offs_h, m_i, mask=mask_h)
    tl.store(L + b * stride_mb + split * stride_ms + offs_h, l_i, mask=mask_h)


@triton.jit
def _mla_decode_combine_kernel(Acc, M, L, Out, n_splits, stride_ab, stride_as, stride_ah, stride_mb, stride_ms,
                               stride_ob, stride_oh, R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
                               PDL: tl.constexpr):
    """Log-sum-exp merge of all splits of one (sequence, head, BLOCK_R slice of R), vectorised over the splits:
    out = sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s) (0 for empty splits, m = -inf).
    PDL: launched with programmatic dependent launch (everything it reads is the split kernel's output)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < n_splits
    m = tl.load(M + b * stride_mb + offs_s * stride_ms + h, mask=mask_s, other=float("-inf"))
    lsum = tl.load(L + b * stride_mb + offs_s * stride_ms + h, mask=mask_s, other=0.0)
    w = tl.exp(m - tl.max(m, 0))  # split 0 always holds >= 1 token, so the max is finite
    den = tl.sum(w * lsum, 0)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.load(Acc + b * stride_ab + offs_s[:, None] * stride_as + h * stride_ah + offs_r[None, :],
                  mask=mask_s[:, None] & mask_r[None, :], other=0.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_r, tl.sum(acc * w[:, None], 0) / den, mask=mask_r)


def num_splits_for(batch: int, capacity: int) -> tuple[int, int]:
    """(splits, tokens per split) for a cache of ``capacity`` slots: about TARGET_PROGRAMS programs in all,
    each split a multiple of BLOCK_N tokens."""
    blocks = triton.cdiv(capacity, BLOCK_N)
    splits = max(1, min(blocks, triton.cdiv(TARGET_PROGRAMS, batch)))
    per = triton.cdiv(blocks, splits) * BLOCK_N
    return triton.cdiv(capacity, per), per


def mla_decode_triton(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor,
                      scale: float, key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`hylo_bench.kernels.mla_decode.reference.mla_decode_reference` (same arguments).

    q_lat / q_rope are cast to the cache dtype (bf16 / fp16 / fp32 dot inputs, fp32 accumulation).

    Returns:
        [B, H, R] float32 latent outputs.
    """
    B, H, R = q_lat.shape
    P = q_rope.shape[-1]
    T = cache.shape[1]
    if cache.stride(-1) != 1:
        cache = cache.contiguous()
    q_lat = q_lat.to(cache.dtype).contiguous()
    q_rope = q_rope.to(cache.dtype).contiguous()
    splits, per = num_splits_for(B, T)
    acc = torch.empty(B, splits, H, R, dtype=torch.float32, device=cache.device)
    m = torch.empty(B, splits, H, dtype=torch.float32, device=cache.device)
    lsum = torch.empty_like(m)
    ks = key_scale if key_scale is not None else cache  # dummy pointer when unused
    if key_scale is not None and key_scale.stride(-1) != 1:
        ks = key_scale = key_scale.contiguous()
    rep = H // key_scale.shape[-1] if key_scale is not None else 1
    pdl = use_pdl(cache.device)
    l2_pf = line_elements(cache.element_size()) if pdl and L2_PREFETCH else 0

    def launch(cfg, lengths, acc, m, lsum):
        bn, warps, stages = cfg
        _mla_decode_split_kernel[(B, splits)](
            q_lat, q_rope, cache, ks, lengths, acc, m, lsum,
            q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0), cache.stride(1),
            ks.stride(0), ks.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
            float(scale), per, T,
            H=H, R=R, P=P, REP=rep, HAS_SCALE=key_scale is not None,
            BLOCK_H=max(16, triton.next_power_of_2(H)), BLOCK_R=max(16, triton.next_power_of_2(R)),
            BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_N=bn, PDL=pdl, L2_PF=l2_pf, num_warps=warps,
            num_stages=stages, launch_pdl=pdl,
        )

    key = (B, T, H, R, P, key_scale is not None, cache.dtype)
    if key not in _BEST_SPLIT:  # every sequence at the full cache length T (the case that bounds a step), into scratch
        full = torch.full((B,), T, dtype=torch.int64, device=cache.device)
        scratch = (torch.empty_like(acc), torch.empty_like(m), torch.empty_like(lsum))
        _BEST_SPLIT[key] = fastest(SPLIT_CONFIGS, lambda cfg: launch(cfg, full, *scratch))
    launch(_BEST_SPLIT[key], lengths, acc, m, lsum)
    out = torch.empty(B, H, R, dtype=torch.float32, device=cache.device)
    block_r = 16
    _mla_decode_combine_kernel[(B, H, triton.cdiv(R, block_r))](
        acc, m, lsum, out, splits, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        out.stride(0), out.stride(1), R=R, BLOCK_S=max(16, triton.next_power_of_2(splits)), BLOCK_R=block_r,
        PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out
