"""The per-token work of an MLA decode step between its projections and the attention kernel, in one Triton
launch: the query's q-norm, RoPE and weight absorption (``q_lat = W_UK'[g]^T q_nope``), and the new cache row
(optional ``kv_a_layernorm``, the key scales of q/k-norm models, the rotated rope key) written at each sequence's
position. CUDA only; imported lazily. Torch reference: :meth:`hylo_bench.decode.mla_layer.MLAServing.prep_torch`
(the engine's unfused path), which it matches up to summation order (same roundings to the model dtype).

On the H200 this replaced about nine launches per MLA layer (cuBLAS for ``kv_b`` and the absorbed einsum, Inductor
kernels for the norms, RoPE and cache writes), each mostly launch latency: a decode step is a chain of small kernels.

Grid (H + G, B): programs 0..H-1 are query heads, programs H..H+G-1 key groups (group g computes the key scale of
group g; group 0 also writes the latent row). Legend: B batch, H query heads, G KV groups, N = qk_nope_head_dim,
P = qk_rope_head_dim, V = v_head_dim, R = kv_lora_rank, QK = N + P. Maths: checkpoint-format.md §5.2 (interleaved
RoPE, YaRN mscale), §6 (absorption); :mod:`hylo_bench.decode.mla_layer` (key scales of q/k-norm models).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo_bench.kernels.pdl import use_pdl


@triton.jit
def _mla_decode_prep_kernel(Q, LAT, POS, CACHE, KS, WUK, KVB, QNW, KNW, KVAW, INVF,
                            stride_qb, stride_lb, stride_cb, stride_ct, stride_kb, stride_kt,
                            mscale, q_eps, k_eps, kva_eps, QL, QPE, LEN,
                            H: tl.constexpr, G: tl.constexpr, N: tl.constexpr, P: tl.constexpr, V: tl.constexpr,
                            R: tl.constexpr, NKEY: tl.constexpr, QK_NORM: tl.constexpr, KVA_NORM: tl.constexpr,
                            BN: tl.constexpr,
                            BP2: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_n = tl.arange(0, BN)
    mn = offs_n < N
    offs_p = tl.arange(0, BP2)
    mp = offs_p < P // 2
    inv_freq = tl.load(INVF + offs_p, mask=mp, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pos = tl.load(POS + b)
    f = pos.to(tl.float32) * inv_freq
    cos = tl.cos(f) * mscale
    sin = tl.sin(f) * mscale
    if pid < H:  # query head h
        h = pid
        qrow = Q + b * stride_qb + h * (N + P)
        qn = tl.load(qrow + offs_n, mask=mn, other=0.0)
        dt = qn.dtype
        qn = qn.to(tl.float32)
        q0 = tl.load(qrow + N + 2 * offs_p, mask=mp, other=0.0).to(tl.float32)
        q1 = tl.load(qrow + N + 2 * offs_p + 1, mask=mp, other=0.0).to(tl.float32)
        if QK_NORM:  # LlamaRMSNorm over the head's N + P: w * round(x * rstd), rounded
            rstd = 1.0 / tl.sqrt((tl.sum(qn * qn, 0) + tl.sum(q0 * q0, 0) + tl.sum(q1 * q1, 0)) / (N + P) + q_eps)
            wn = tl.load(QNW + offs_n, mask=mn, other=0.0).to(tl.float32)
            w0 = tl.load(QNW + N + 2 * offs_p, mask=mp, other=0.0).to(tl.float32)
            w1 = tl.load(QNW + N + 2 * offs_p + 1, mask=mp, other=0.0).to(tl.float32)
            qn = (wn * (qn * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            q0 = (w0 * (q0 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            q1 = (w1 * (q1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        pe = QPE + (b * H + h) * P + 2 * offs_p
        tl.store(pe, (q0 * cos - q1 * sin).to(dt), mask=mp)
        tl.store(pe + 1, (q0 * sin + q1 * cos).to(dt), mask=mp)
        g = h // (H // G)
        for r0 in range(0, R, BLOCK_R):  # q_lat = W_UK'[g]^T q_nope, float32 sums, rounded
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mr = offs_r < R
            w = tl.load(WUK + (g * N + offs_n[:, None]) * R + offs_r[None, :], mask=mn[:, None] & mr[None, :],
                        other=0.0).to(tl.float32)
            tl.store(QL + (b * H + h) * R + offs_r, tl.sum(w * qn[:, None], 0).to(dt), mask=mr)
    else:  # key group g: its key scale; group 0 also writes the cache row and the attention length pos + 1
        g = pid - H
        if g == 0:
            tl.store(LEN + b, pos + 1)
        if g < NKEY:
            lrow = LAT + b * stride_lb
            dt = LAT.dtype.element_ty
            crow = CACHE + b * stride_cb + pos * stride_ct
            rstd_c = 0.0
            if KVA_NORM:
                ss = 0.0
                for r0 in range(0, R, BLOCK_R):
                    offs_r = r0 + tl.arange(0, BLOCK_R)
                    cc = tl.load(lrow + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
                    ss += tl.sum(cc * cc, 0)
                rstd_c = 1.0 / tl.sqrt(ss / R + kva_eps)
            kn = tl.zeros([BN], dtype=tl.float32)
            for r0 in range(0, R, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                mr = offs_r < R
                cc = tl.load(lrow + offs_r, mask=mr, other=0.0).to(tl.float32)
                if KVA_NORM:
                    wc = tl.load(KVAW + offs_r, mask=mr, other=0.0).to(tl.float32)
                    cc = (wc * (cc * rstd_c).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                if g == 0:
                    tl.store(crow + offs_r, cc.to(dt), mask=mr)
                if QK_NORM:  # k_nope of group g = kv_b[g, :N] c, rounded as F.linear rounds
                    w = tl.load(KVB + (g * (N + V) + offs_n[:, None]) * R + offs_r[None, :],
                                mask=mn[:, None] & mr[None, :], other=0.0).to(tl.float32)
                    kn += tl.sum(w * cc[None, :], 1)
            k0 = tl.load(lrow + R + 2 * offs_p, mask=mp, other=0.0).to(tl.float32)
            k1 = tl.load(lrow + R + 2 * offs_p + 1, mask=mp, other=0.0).to(tl.float32)
            if QK_NORM:  # key scale 1 / rms([k_nope ; k_pe]) of group g, then k_pe times the norm's rope weight
                kn = kn.to(dt).to(tl.float32)
                ks = 1.0 / tl.sqrt((tl.sum(kn * kn, 0) + tl.sum(k0 * k0, 0) + tl.sum(k1 * k1, 0)) / (N + P) + k_eps)
                tl.store(KS + b * stride_kb + pos * stride_kt + g, ks.to(dt))
                k0 = (k0 * tl.load(KNW + N + 2 * offs_p, mask=mp, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
                k1 = (k1 * tl.load(KNW + N + 2 * offs_p + 1, mask=mp, other=0.0).to(tl.float32)).to(dt).to(
                    tl.float32)
            if g == 0:
                tl.store(crow + R + 2 * offs_p, (k0 * cos - k1 * sin).to(dt), mask=mp)
                tl.store(crow + R + 2 * offs_p + 1, (k0 * sin + k1 * cos).to(dt), mask=mp)


def mla_decode_prep_triton(q: torch.Tensor, lat: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
                           key_scale: torch.Tensor | None, w_uk: torch.Tensor, kv_b_weight: torch.Tensor,
                           inv_freq: torch.Tensor, mscale: float, *, num_heads: int, nope_dim: int, rope_dim: int,
                           v_dim: int, q_norm_weight: torch.Tensor | None = None, q_eps: float = 1e-6,
                           k_norm_weight: torch.Tensor | None = None, k_eps: float = 1e-6,
                           kv_a_norm_weight: torch.Tensor | None = None, kv_a_eps: float = 1e-6
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token per sequence: absorbed queries and the new cache rows (module docstring).

    Args:
        q: [B, H * (N + P)] queries (``q_b_proj`` / ``q_proj`` output), model dtype.
        lat: [B, R + P] ``kv_a_proj_with_mqa`` output (unit last stride).
        positions: [B] int64, each sequence's position (the cache row written).
        cache: [B', Tm, R + P] latent cache (B' >= B), row ``positions[b]`` written with ``[c ; RoPE(k_pe)]``.
        key_scale: [B', Tm, G] key scales (q/k-norm models: with ``q_norm_weight`` / ``k_norm_weight``), else None.
        w_uk: [G, N, R] absorbed key weight (times the key norm's nope weight for q/k-norm models), model dtype.
        kv_b_weight: [G * (N + V), R] (read for the key scales only).
        inv_freq: [P / 2] float32 rotary inverse frequencies; mscale: YaRN attention factor (cos / sin times it).
        q_norm_weight, k_norm_weight: [N + P] LlamaRMSNorm weights (both or neither); kv_a_norm_weight: [R].

    Returns:
        (q_lat [B, H, R], q_pe [B, H, P]) in q's dtype, and lengths [B] = positions + 1 (int64: the rows the
        attention reads; saves the step an element-wise kernel).

    Raises:
        ValueError: float64, a mismatched shape, or only one of the q / k norm weights.
    """
    B = q.shape[0]
    H, N, P, V = num_heads, nope_dim, rope_dim, v_dim
    G, _, R = w_uk.shape
    if q.dtype == torch.float64:
        raise ValueError("the Triton MLA decode prep computes in float32; float64 takes the torch path")
    if (q_norm_weight is None) != (k_norm_weight is None) or (q_norm_weight is None) != (key_scale is None):
        raise ValueError("q_norm_weight, k_norm_weight and key_scale come together (q/k-norm models) or not at all")
    q2, l2 = q.reshape(B, -1), lat.reshape(B, -1)
    if q2.shape[1] != H * (N + P) or l2.shape[1] != R + P or tuple(kv_b_weight.shape) != (G * (N + V), R) \
            or tuple(w_uk.shape) != (G, N, R) or cache.shape[-1] != R + P or H % G or P % 2:
        raise ValueError(f"MLA prep shapes: q {tuple(q.shape)} (want [B, H*(N+P) = {H * (N + P)}]), lat "
                         f"{tuple(lat.shape)} (want [B, R+P = {R + P}]), w_uk {tuple(w_uk.shape)}, kv_b "
                         f"{tuple(kv_b_weight.shape)} (want [{G * (N + V)}, {R}]), cache {tuple(cache.shape)}")
    q2, l2 = q2.contiguous(), l2.contiguous()
    if cache.stride(-1) != 1 or (key_scale is not None and key_scale.stride(-1) != 1):
        raise ValueError("the latent cache and key scales need a unit last stride (they are written in place)")
    q_lat = torch.empty(B, H, R, dtype=q.dtype, device=q.device)
    q_pe = torch.empty(B, H, P, dtype=q.dtype, device=q.device)
    lengths = torch.empty(B, dtype=torch.int64, device=q.device)
    ks = key_scale if key_scale is not None else cache
    dummy = inv_freq
    pdl = use_pdl(q.device)
    _mla_decode_prep_kernel[(H + G, B)](
        q2, l2, positions, cache, ks, w_uk.contiguous(), kv_b_weight.contiguous(),
        q_norm_weight if q_norm_weight is not None else dummy, k_norm_weight if k_norm_weight is not None else dummy,
        kv_a_norm_weight if kv_a_norm_weight is not None else dummy, inv_freq,
        q2.stride(0), l2.stride(0), cache.stride(0), cache.stride(1), ks.stride(0), ks.stride(1),
        float(mscale), float(q_eps), float(k_eps), float(kv_a_eps), q_lat, q_pe, lengths,
        H=H, G=G, N=N, P=P, V=V, R=R, NKEY=G if q_norm_weight is not None else 1, QK_NORM=q_norm_weight is not None,
        KVA_NORM=kv_a_norm_weight is not None,
        BN=max(16, triton.next_power_of_2(N)), BP2=max(16, triton.next_power_of_2(P // 2)),
        BLOCK_R=min(64, max(16, triton.next_power_of_2(R))), PDL=pdl, num_warps=4, launch_pdl=pdl)
    return q_lat, q_pe, lengths


@triton.jit
def _mla_value_up_kernel(OL, WUV, Out, stride_wg, stride_wv, stride_ob, H: tl.constexpr, G: tl.constexpr,
                         V: tl.constexpr, R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (b * H + h, v block): out[b, h*V + v] = sum_r W_UV[g(h), v, r] round(o_lat[b, h, r])."""
    bh = tl.program_id(0)
    h = bh % H
    g = h // (H // G)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mv = offs_v < V
    offs_r = tl.arange(0, BLOCK_R)
    mr = offs_r < R
    w = tl.load(WUV + g * stride_wg + offs_v[:, None] * stride_wv + offs_r[None, :], mask=mv[:, None] & mr[None, :],
                other=0.0)
    if PDL:  # W_UV is a constant: loaded while the attention's combine kernel finishes
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ol = tl.load(OL + bh.to(tl.int64) * R + offs_r, mask=mr, other=0.0)
    ol = ol.to(Out.dtype.element_ty).to(tl.float32)  # the model rounds o_lat to its dtype first
    o = tl.sum(w.to(tl.float32) * ol[None, :], 1)
    tl.store(Out + (bh // H).to(tl.int64) * stride_ob + h * V + offs_v, o.to(Out.dtype.element_ty), mask=mv)


def mla_value_up_triton(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Values from the latent attention output: ``o[b, h] = W_UV[g(h)] round(o_lat[b, h])`` (checkpoint-format.md
    §6 step 5), one launch instead of a dtype cast plus a batched GEMM.

    Args:
        o_lat: [B, H, R] float32 latent outputs (:func:`hylo_bench.kernels.mla_decode.mla_decode`).
        w_uv: [G, V, R] value up-projection (``kv_b_proj`` rows of each group), model dtype; H % G == 0.

    Returns:
        [B, H * V] in w_uv's dtype (float32 sums, one rounding), as
        ``einsum("bgrc,gvc->bgrv", o_lat.to(dtype), w_uv)`` flattened.

    Raises:
        ValueError: float64, mismatched shapes.
    """
    B, H, R = o_lat.shape
    G, V, R2 = w_uv.shape
    if w_uv.dtype == torch.float64 or R2 != R or H % G:
        raise ValueError(f"mla_value_up: o_lat {tuple(o_lat.shape)}, w_uv {tuple(w_uv.shape)} {w_uv.dtype} (want "
                         f"[B, H, R] and [G, V, R] with H % G == 0, not float64)")
    o_lat = o_lat.contiguous()
    w = w_uv if w_uv.stride(-1) == 1 else w_uv.contiguous()  # kv_b_proj's row views: strided groups are fine
    out = torch.empty(B, H * V, dtype=w_uv.dtype, device=o_lat.device)
    pdl = use_pdl(o_lat.device) and w is w_uv
    block_v = 16
    _mla_value_up_kernel[(B * H, triton.cdiv(V, block_v))](
        o_lat, w, out, w.stride(0), w.stride(1), out.stride(0), H=H, G=G, V=V, R=R, BLOCK_V=block_v,
        BLOCK_R=max(16, triton.next_power_of_2(R)), PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out
