"""Triton version of :func:`hylo_bench.kernels.gated_delta.decode_prestep.gdn_decode_prestep_reference`: one
launch per GDN layer and decode token. CUDA only; imported lazily.

Grid (channel blocks + 1, B); W = 4 taps. A channel program loads its channels' 3 cached taps and the new input,
writes the shifted cache (each thread reads all of its channel's taps before writing them, so the in-place shift is
safe), sums the taps in float32, rounds to the model dtype, applies SiLU and stores the activation. The extra program
computes the H gates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo_bench.kernels.pdl import use_pdl

BLOCK_C = 256


@triton.jit
def _gdn_decode_prestep_kernel(P, CQ, CK, CV, CW, ALOG, DTB, ACT, G, BETA,
                               stride_pb, stride_qb, stride_qc, stride_kb, stride_kc, stride_vb, stride_vc,
                               stride_ab, stride_gb, Ck, Cv, H,
                               BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """PDL (programmatic dependent launch): the constant conv weights / A_log / dt_bias are read before waiting for
    the previous kernel (the GEMV that writes P)."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    C = 2 * Ck + Cv
    n_blocks = tl.cdiv(C, BLOCK_C)
    if pid < n_blocks:
        c = pid * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = c < C
        in_q = c < Ck
        in_k = (c >= Ck) & (c < 2 * Ck)
        ptr = tl.where(in_q, CQ + b * stride_qb + c * stride_qc,
                       tl.where(in_k, CK + b * stride_kb + (c - Ck) * stride_kc,
                                CV + b * stride_vb + (c - 2 * Ck) * stride_vc))
        wrow = CW + c * 4
        w0 = tl.load(wrow, mask=mask, other=0.0).to(tl.float32)
        w1 = tl.load(wrow + 1, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(wrow + 2, mask=mask, other=0.0).to(tl.float32)
        w3 = tl.load(wrow + 3, mask=mask, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        x_new = tl.load(P + b * stride_pb + c, mask=mask, other=0.0)
        c0 = tl.load(ptr, mask=mask, other=0.0)  # the three cached taps, oldest first (all read before any write)
        c1 = tl.load(ptr + 1, mask=mask, other=0.0)
        c2 = tl.load(ptr + 2, mask=mask, other=0.0)
        acc = c0.to(tl.float32) * w0
        acc += c1.to(tl.float32) * w1
        acc += c2.to(tl.float32) * w2
        acc += x_new.to(tl.float32) * w3
        tl.store(ptr, c1, mask=mask)
        tl.store(ptr + 1, c2, mask=mask)
        tl.store(ptr + 2, x_new.to(c0.dtype), mask=mask)
        y = acc.to(x_new.dtype).to(tl.float32)
        tl.store(ACT + b * stride_ab + c, (y / (1.0 + tl.exp(-y))).to(x_new.dtype), mask=mask)
    else:
        h = tl.arange(0, BLOCK_H)
        mh = h < H
        dtb = tl.load(DTB + h, mask=mh, other=0.0).to(tl.float32)
        a_log = tl.load(ALOG + h, mask=mh, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        a = tl.load(P + b * stride_pb + C + h, mask=mh, other=0.0).to(tl.float32)
        bb = tl.load(P + b * stride_pb + C + H + h, mask=mh, other=0.0).to(tl.float32)
        z = a + dtb
        softplus = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))  # torch's threshold 20
        g = -tl.exp(a_log) * softplus
        tl.store(G + b * stride_gb + h, g, mask=mh)
        tl.store(BETA + b * stride_gb + h, 1.0 / (1.0 + tl.exp(-bb)), mask=mh)


def check_conv_step_inputs(proj: torch.Tensor, conv_caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                           conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                           what: str) -> torch.Tensor:
    """Validate a GDN decode token's inputs for a Triton kernel (``what`` names it in the messages) and return
    proj as [B, >= C + 2H] with a unit last stride.

    Raises:
        ValueError: float64 proj (the kernels sum in float32; use the reference), caches that are not
            [B, Ck | Ck | Cv, 3] with a unit tap stride, a conv weight that is not [C, 4], a proj narrower than
            C + 2H or a dt_bias that is not [H] (H = A_log's length).
    """
    B, H = proj.shape[0], A_log.shape[0]
    cq, ck, cv = conv_caches
    Ck, Cv = cq.shape[1], cv.shape[1]
    C = 2 * Ck + Cv
    if proj.dtype == torch.float64:
        raise ValueError(f"the Triton GDN {what} sums in float32; float64 inputs take the reference")
    p2 = proj.reshape(B, -1)
    if p2.stride(-1) != 1:
        p2 = p2.contiguous()
    if any(t.dim() != 3 or t.shape[2] != 3 or t.stride(-1) != 1 or t.shape[0] != B for t in conv_caches) \
            or ck.shape[1] != Ck:
        raise ValueError(f"the Triton GDN {what} serves 4-tap convs with caches [B={B}, Ck | Ck | Cv, 3] of unit "
                         f"tap stride; got caches {[tuple(t.shape) for t in conv_caches]}, strides "
                         f"{[t.stride() for t in conv_caches]} (use the reference)")
    if tuple(conv_weight.shape) != (C, 4):
        raise ValueError(f"conv_weight must be [C={C}, 4] (q, k, v conv weights stacked); "
                         f"got {tuple(conv_weight.shape)}")
    if p2.shape[1] < C + 2 * H or dt_bias.shape != (H,):
        raise ValueError(f"proj must be [B, 1, >= C + 2H = {C + 2 * H}] and dt_bias [H={H}]; got proj "
                         f"{tuple(proj.shape)}, dt_bias {tuple(dt_bias.shape)}")
    return p2


def gdn_decode_prestep_triton(proj: torch.Tensor, conv_caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                              conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same arguments and results as the reference (float32 gates; float32 and bfloat16 / float16 inputs).

    Raises:
        ValueError: float64 inputs (the kernel sums in float32; use the reference), not a 4-tap conv (W = 4 is
            every released layout), caches that are not [B, Ck | Ck | Cv, 3] with a unit tap stride, a conv weight
            that is not [C, 4], or a proj narrower than C + 2H.
    """
    cq, ck, cv = conv_caches
    p2 = check_conv_step_inputs(proj, conv_caches, conv_weight, A_log, dt_bias, "pre-step")
    B, Ck, Cv, H = p2.shape[0], cq.shape[1], cv.shape[1], A_log.shape[0]
    C = 2 * Ck + Cv
    act = torch.empty(B, C, dtype=proj.dtype, device=proj.device)
    g = torch.empty(B, H, dtype=torch.float32, device=proj.device)
    beta = torch.empty_like(g)
    cw = conv_weight.contiguous()
    a_log, dtb = A_log.contiguous(), dt_bias.contiguous()
    # PDL reads cw / a_log / dtb before the previous kernel ends: not when that kernel made them (a contiguous copy)
    pdl = use_pdl(proj.device) and all(t is u for t, u in ((cw, conv_weight), (a_log, A_log), (dtb, dt_bias)))
    _gdn_decode_prestep_kernel[(triton.cdiv(C, BLOCK_C) + 1, B)](
        p2, cq, ck, cv, cw, a_log, dtb, act, g, beta,
        p2.stride(0), cq.stride(0), cq.stride(1), ck.stride(0), ck.stride(1), cv.stride(0), cv.stride(1),
        act.stride(0), g.stride(0), Ck, Cv, H,
        BLOCK_C=BLOCK_C, BLOCK_H=max(16, triton.next_power_of_2(H)), PDL=pdl, num_warps=4, launch_pdl=pdl)
    return act, g, beta
