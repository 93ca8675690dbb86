"""A whole GDN decode token in one Triton launch: the pre-step (:mod:`.decode_prestep`: three 4-tap short
convolutions with their caches shifted in place, SiLU, decay / write gates) and the gated delta rule's recurrent
step (q / k L2-normalised, fla's ``fused_recurrent_gated_delta_rule`` maths, the state updated in place). CUDA only;
imported lazily. Torch reference: :func:`hylo_bench.kernels.gated_delta.decode_prestep.gdn_decode_token_reference`
(the pre-step reference, then :func:`hylo_bench.kernels.gated_delta.gated_delta_rule_step`).

Why one kernel: on the H200 a decode token's GDN part was three launches (pre-step, a bf16 copy of beta, fla's
recurrent kernel) of about 5 + 1 + 4.4 us for 3 MB of state (6 MB read + written: 1.4 us at copy bandwidth); each
launch is mostly latency. Measured in the engine (Qwen3-1.7B-shaped 7MLA21GDN, 64K, batch 1): even with that path
on its own (56.2 vs 56.4 % of the bandwidth bound, ``benchmarks/results/decode_profile_token.json``), 58.5 vs 56.0 %
once the MLA glue kernels went in (``decode_profile_fused.json``). Needs no fla. Also more exact: beta stays
float32 (fla's path rounds it to the model dtype).

The earlier tokens' data (conv taps, the state block, the gate constants) is read before the PDL wait, so it loads
while the projection GEMV before this kernel finishes.

Grid (Vd / BV, B * H): program (j, b * H + h) owns the [K, BV] block j of head h's state and the BV value channels
of that block. Every program of a head recomputes the head's K query and K key channels (their convolutions, SiLU,
L2 norms: 2K elements from L2, next to the K * BV * 8 state bytes it streams), so no program waits for another.
The query / key conv caches are read by all Vd / BV programs of a head and must be shifted once, after every one
of them has read its taps: each program bumps a per-(sequence, head) counter (``tl.atomic_add``, acquire-release)
after its reads, and the last to arrive writes the shifted taps and resets the counter to zero for the next token.
The value caches are disjoint per program and shifted by their owner.

Legend: B batch, H heads, K key head dim, Vd value head dim, Ck = H K, Cv = H Vd, C = 2 Ck + Cv.
References: arXiv 2412.06464 eq. 10; fla 0.6.0 ``fla/ops/gated_delta_rule/fused_recurrent.py`` (l2norm eps 1e-6,
scale K^-0.5); ``ShortConvolution`` step (fla 0.6.0 ``fla/modules/convolution.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo_bench.kernels.gated_delta.decode_prestep_triton import check_conv_step_inputs
from hylo_bench.kernels.pdl import use_pdl
from hylo_bench.kernels.tuning import fastest

L2NORM_EPS = 1e-6
# (BV, num_warps) candidates; the first call per shape times each on scratch copies of the state and caches (Triton's
# autotuner would time the restores of its restore_value copies too, 3 MB of state per run, and pick at random)
CONFIGS = ((8, 1), (8, 2), (16, 2), (16, 4), (32, 4), (32, 8))
_BEST: dict[tuple, tuple[int, int]] = {}


@triton.jit
def _taps(cache, CW, ch, mask):
    """The conv weights [4] and the three cached taps (oldest first) of channels ``ch``: state of earlier tokens,
    read before the PDL wait."""
    w0 = tl.load(CW + ch * 4, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(CW + ch * 4 + 1, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(CW + ch * 4 + 2, mask=mask, other=0.0).to(tl.float32)
    w3 = tl.load(CW + ch * 4 + 3, mask=mask, other=0.0).to(tl.float32)
    c0 = tl.load(cache, mask=mask, other=0.0)
    c1 = tl.load(cache + 1, mask=mask, other=0.0)
    c2 = tl.load(cache + 2, mask=mask, other=0.0)
    part = c0.to(tl.float32) * w0 + c1.to(tl.float32) * w1 + c2.to(tl.float32) * w2
    return part, w3, c1, c2


@triton.jit
def _silu_conv(part, w3, x):
    """silu(round(part + w3 x)) in float32, rounded to x's dtype and back (the pre-step's roundings)."""
    y = (part + x.to(tl.float32) * w3).to(x.dtype).to(tl.float32)
    return (y / (1.0 + tl.exp(-y))).to(x.dtype).to(tl.float32)


@triton.jit
def _gdn_decode_token_kernel(P, CQ, CK, CV, CW, ALOG, DTB, S, O, CNT,
                             stride_pb, stride_qb, stride_qc, stride_kb, stride_kc, stride_vb, stride_vc,
                             stride_sb, stride_sh, stride_ob, H, scale, eps,
                             K: tl.constexpr, Vd: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr,
                             BV: tl.constexpr):
    """See the module docstring. PDL: the conv weights and taps, the state block and the gate constants are
    earlier tokens' data, read before waiting for the previous kernel (the projection GEMV writing P)."""
    j = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    Ck = H * K
    C = 2 * Ck + H * Vd
    NV = tl.cdiv(Vd, BV)
    offs_k = tl.arange(0, BK)
    mk = offs_k < K
    offs_v = j * BV + tl.arange(0, BV)
    mv = offs_v < Vd
    qch = h * K + offs_k  # head h's query / key channels, this program's value channels
    vch = h * Vd + offs_v
    qcache = CQ + b * stride_qb + qch * stride_qc
    kcache = CK + b * stride_kb + qch * stride_kc
    vcache = CV + b * stride_vb + vch * stride_vc
    qp, qw3, q1, q2 = _taps(qcache, CW, qch, mk)
    kp, kw3, k1, k2 = _taps(kcache, CW, Ck + qch, mk)
    vp, vw3, v1, v2 = _taps(vcache, CW, 2 * Ck + vch, mv)
    sp = S + b * stride_sb + h * stride_sh + offs_k[:, None] * Vd + offs_v[None, :]
    ms = mk[:, None] & mv[None, :]
    st = tl.load(sp, mask=ms, other=0.0)
    dtb = tl.load(DTB + h).to(tl.float32)
    a_coef = tl.exp(tl.load(ALOG + h).to(tl.float32))
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    prow = P + b * stride_pb
    xq = tl.load(prow + qch, mask=mk, other=0.0)
    xk = tl.load(prow + Ck + qch, mask=mk, other=0.0)
    xv = tl.load(prow + 2 * Ck + vch, mask=mv, other=0.0)
    q = _silu_conv(qp, qw3, xq)
    k = _silu_conv(kp, kw3, xk)
    v = _silu_conv(vp, vw3, xv)
    q = q / tl.sqrt(tl.sum(q * q, 0) + eps) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + eps)
    # gates of head h (float32): g = -exp(A_log) softplus(a + dt_bias) (torch's softplus threshold 20), sigmoid(b)
    a = tl.load(prow + C + h).to(tl.float32) + dtb
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
    decay = tl.exp(-a_coef * softplus)
    beta = 1.0 / (1.0 + tl.exp(-tl.load(prow + C + H + h).to(tl.float32)))
    # recurrent step on the [K, BV] state block: S <- decay S; v' = beta (v - S^T k); S <- S + k v'^T; o = S^T q
    st = st * decay
    vn = beta * (v - tl.sum(st * k[:, None], 0))
    st += k[:, None] * vn[None, :]
    o = tl.sum(st * q[:, None], 0)
    tl.store(sp, st, mask=ms)
    tl.store(O + b * stride_ob + h * Vd + offs_v, o.to(O.dtype.element_ty), mask=mv)
    # value caches: this program's channels alone
    tl.store(vcache, v1, mask=mv)
    tl.store(vcache + 1, v2, mask=mv)
    tl.store(vcache + 2, xv, mask=mv)
    # query / key caches, shared by the head's NV programs: the last to arrive shifts them. The L2-norm reductions
    # above consumed every thread's taps (a CTA-wide exchange), so this program's cache reads are complete before
    # its acquire-release increment.
    arrived = tl.atomic_add(CNT + bh, 1, sem="acq_rel")
    last = arrived == NV - 1
    ml = mk & ((offs_k * 0 + arrived) == NV - 1)  # broadcast explicitly (Triton's interpreter wants a bool vector)
    tl.store(qcache, q1, mask=ml)
    tl.store(qcache + 1, q2, mask=ml)
    tl.store(qcache + 2, xq, mask=ml)
    tl.store(kcache, k1, mask=ml)
    tl.store(kcache + 1, k2, mask=ml)
    tl.store(kcache + 2, xk, mask=ml)
    tl.atomic_xchg(CNT + bh, 0, mask=last)


def gdn_decode_token_triton(proj: torch.Tensor, conv_caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                            conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                            state: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One GDN decode token: arguments and result as
    :func:`hylo_bench.kernels.gated_delta.decode_prestep.gdn_decode_token_reference`, plus ``counters``.

    Args:
        counters: int32 [>= B * H], zero before the first call; the kernel leaves it zero (module docstring).

    Raises:
        ValueError: float64 inputs (use the reference), caches / conv weight / state / counters of the wrong shape,
            dtype or strides (the messages name the tensor and what was expected).
    """
    cq, ck, cv = conv_caches
    p2 = check_conv_step_inputs(proj, conv_caches, conv_weight, A_log, dt_bias, "decode token")
    B, H, Ck, Cv = p2.shape[0], A_log.shape[0], cq.shape[1], cv.shape[1]
    if Ck % H or Cv % H:
        raise ValueError(f"q / k / v conv widths {Ck} / {Ck} / {Cv} must be multiples of H={H} (A_log [H])")
    K, Vd = Ck // H, Cv // H
    if tuple(state.shape) != (B, H, K, Vd) or state.dtype != torch.float32 or state.stride(3) != 1 \
            or state.stride(2) != Vd:
        raise ValueError(f"state must be float32 [B={B}, H={H}, K={K}, Vd={Vd}] with contiguous [K, Vd] heads; got "
                         f"{state.dtype} {tuple(state.shape)} strides {state.stride()}")
    if counters.dtype != torch.int32 or counters.numel() < B * H or not counters.is_contiguous():
        raise ValueError(f"counters must be a contiguous int32 tensor of >= B*H = {B * H} zeros; got "
                         f"{counters.dtype} {tuple(counters.shape)}")
    o = torch.empty(B, Cv, dtype=proj.dtype, device=proj.device)
    cw, a_log, dtb = conv_weight.contiguous(), A_log.contiguous(), dt_bias.contiguous()
    # PDL reads cw / a_log / dtb before the previous kernel ends: not when that kernel made them (a contiguous copy)
    pdl = use_pdl(proj.device) and all(t is u for t, u in ((cw, conv_weight), (a_log, A_log), (dtb, dt_bias)))

    def launch(cfg, cq, ck, cv, state, counters):
        bv, warps = cfg
        _gdn_decode_token_kernel[(triton.cdiv(Vd, bv), B * H)](
            p2, cq, ck, cv, cw, a_log, dtb, state, o, counters,
            p2.stride(0), cq.stride(0), cq.stride(1), ck.stride(0), ck.stride(1), cv.stride(0), cv.stride(1),
            state.stride(0), state.stride(1), o.stride(0), H, K ** -0.5, L2NORM_EPS,
            K=K, Vd=Vd, BK=triton.next_power_of_2(K), PDL=pdl, BV=bv, num_warps=warps, launch_pdl=pdl)

    key = (B, H, K, Vd, proj.dtype, pdl)
    if key not in _BEST:  # timed on scratch copies: the real caches and state see one token
        scratch = [t.clone() for t in (cq, ck, cv, state)] + [torch.zeros_like(counters)]
        _BEST[key] = fastest(CONFIGS, lambda cfg: launch(cfg, *scratch))
    launch(_BEST[key], cq, ck, cv, state, counters)
    return o
