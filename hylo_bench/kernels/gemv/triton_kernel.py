"""Triton decode GEMV with an RMSNorm or SwiGLU prologue and a residual epilogue. CUDA only; imported lazily by
:func:`hylo_bench.kernels.gemv.fused_gemv`. Contract: :func:`fused_gemv_reference`.

Each program owns BLOCK_N output features of every row (M <= 16 sequences): it streams its [BLOCK_N, K] slab of W
in [BLOCK_N, BLOCK_K] tiles (rows contiguous in K, so each tile is BLOCK_N coalesced runs) and multiplies it with
the matching slice of every input row, accumulating in float32. Inputs are tiny next to W (K elements per row,
L2-resident), so each program recomputes the prologue itself: the RMSNorm statistics in a first pass over x
(or, with ``ONE_PASS_NORM``, in the main loop: the result then differs from LlamaRMSNorm's by its two bf16 roundings
of the normalised input), or ``silu(gate) * up`` tile by tile. No split over K, so no second reduction kernel: a
decode step's shapes (N >= 1536) give hundreds of programs at BLOCK_N <= 8.

Second kernel, ``KERNEL = "persistent"``: a grid of GRID_MULT programs per multiprocessor (or one program per
tile with GRID_MULT 0), each walking its [BLOCK_N, BLOCK_K] tiles of W (tile t of the flattened (row block, K
block) order, row blocks strided by the grid) in one software-pipelined loop (``tl.range(num_stages=STAGES)``):
STAGES - 1 tiles are in flight while one is multiplied, through shared memory (``cp.async``) or, with ``USE_TMA``,
the tensor-memory copy engine (a host :class:`~triton.tools.tensor_descriptor.TensorDescriptor`). The RMSNorm
statistics are computed once per program, not once per row block.

For 2 to 16 rows (batched decode) a third kernel: the same program layout as the row-block kernel, but each
[M_PAD, BLOCK_K] x [BLOCK_K, BLOCK_N] tile product runs on the tensor cores (``tl.dot``, rows padded to 16, float32
accumulation) in a software-pipelined loop over K (``tl.range(num_stages=STAGES)``). The row-block kernel's
multi-row form multiplies on the CUDA cores and reduces every tile across threads, which costs more than the tile's
loads once several rows share it. ``ROWS_KERNEL`` picks the form: "dot" (default: the prologue once per row in a
small kernel of its own, then the tensor-core product), "dot_fused" (the prologue in every program: at 8 rows it
costs as much as the product, SwiGLU's most: ``down_proj`` of Qwen3-1.7B in 72 us instead of 12 us on the H200),
"torch" (the reference, cuBLAS) or "rowblock". Timing the forms on the first call (do_bench, one launch at a time)
favoured the one-launch forms, which lose inside a CUDA graph.

Legend: M rows, K input features, N output features.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hylo_bench.kernels.gemv.tuned import tuned_config
from hylo_bench.kernels.l2_prefetch import line_elements, prefetch_l2
from hylo_bench.kernels.pdl import use_pdl

MAX_ROWS = 16  # larger batches take the torch path (the GEMV is then a small GEMM that cuBLAS handles well)
# RMSNorm statistics in the main loop, 1/rms applied to the sums (see the kernel). Off: on the H200 both forms read
# the decode shapes equally fast (benchmarks/results/decode_profile.json, triton vs triton_twopass), and the two-pass
# form rounds the normalised input exactly as LlamaRMSNorm does.
ONE_PASS_NORM = False
_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "PREFETCH": pf}, num_warps=w)
            for bn, bk, w in ((2, 1024, 4), (4, 512, 4), (4, 1024, 8), (4, 2048, 8), (8, 256, 4), (8, 512, 4),
                              (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 128, 4))
            for pf in (0, 1, 2)]
KERNEL = "rowblock"  # or "persistent" / "persistent_tma": the second kernel (module docstring)
# True: with PDL, the row-block and tensor-core kernels ask L2 for the rest of their W slab before waiting for the
# previous kernel (hylo_bench.kernels.l2_prefetch). Off: with it (and the MLA split kernel's) on, the 64K batch-1
# decode step was slower on an H100 (benchmarks/results/decode_l2_prefetch_h100.json).
L2_PREFETCH = False

KERNELS = ("rowblock", "persistent", "persistent_tma")
ROWS_KERNEL = "dot"  # 2..MAX_ROWS rows (module docstring); "rowblock": KERNEL's form for every M
ROWS_KERNELS = ("dot", "dot_fused", "torch", "rowblock")
_DOT_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "STAGES": st}, num_warps=w)
                for bn, bk, w in ((16, 128, 4), (16, 256, 4), (16, 512, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4),
                                  (64, 256, 8))
                for st in (3, 5)]


def _tma_block_hook(nargs):
    """Autotune pre-hook: the host tensor descriptor's box is the config's tile."""
    if isinstance(nargs.get("WD"), TensorDescriptor):
        nargs["WD"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


def _persistent_configs(tma: bool) -> list:
    out = []
    tiles = ((2, 256), (4, 256), (8, 256), (16, 256), (16, 128), (32, 128)) if tma else \
        ((1, 2048), (2, 1024), (4, 512), (4, 1024), (8, 256), (8, 512), (16, 256))
    for bn, bk in tiles:
        for stages in (3, 5):
            for mult in ((0, 1, 2, 4) if not tma else (2, 4, 8)):
                w = 4 if bn * bk <= 2048 else 8
                out.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "STAGES": stages, "GRID_MULT": mult},
                                         num_warps=w, pre_hook=_tma_block_hook if tma else None))
    return out


@triton.jit
def _rms_rstd(x_rows, mask_m, K, eps, M_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) per row [M_PAD], float32 (LlamaRMSNorm's statistics), in a pass over x."""
    ss = tl.zeros([M_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
        xv = xv.to(tl.float32)
        ss += tl.sum(xv * xv, 1)
    return 1.0 / tl.sqrt(ss / K + eps)


def _prune_for_group(configs, named_args, **kwargs):
    """PROLOGUE 3 (grouped gated RMSNorm) needs whole groups in a K tile: BLOCK_K >= GROUP."""
    group = kwargs.get("GROUP", named_args.get("GROUP", 1))
    kept = [c for c in configs if c.kwargs["BLOCK_K"] >= group]
    return kept or configs[:0]


@triton.autotune(configs=_CONFIGS, key=["N", "K", "M_PAD", "PROLOGUE", "GROUP", "HAS_RES", "ONE_PASS", "PDL", "L2_PF"],
                 prune_configs_by={"early_config_prune": _prune_for_group})
@triton.jit
def _fused_gemv_kernel(X, W, NW, G, R, Y, M, N, K, stride_xm, stride_wn, stride_gm, stride_rm, stride_ym, eps,
                       PROLOGUE: tl.constexpr, GROUP: tl.constexpr, HAS_RES: tl.constexpr, M_PAD: tl.constexpr,
                       ONE_PASS: tl.constexpr, PDL: tl.constexpr, L2_PF: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """PROLOGUE 0: none, 1: RMSNorm (weight NW), 2: SwiGLU over X = [gate ; up] (row width 2K), 3: GDN's output
    norm: RMSNorm over each group of GROUP features (weight NW [GROUP]) times silu(gate) (G, row stride
    stride_gm), in float32, rounded once (``GatedRMSNorm``).

    ONE_PASS (RMSNorm): sum(x^2) accumulates in the main loop and the products use w_norm * x unrounded; the
    1/rms scale multiplies the sums at the end (exact in real arithmetic; saves the dependent first pass over x,
    and skips the two bf16 roundings LlamaRMSNorm applies to the normalised input). PREFETCH: how many W tiles
    ahead of the one being multiplied are loaded (0, 1 or 2). PDL (launched with programmatic dependent launch,
    Hopper+): the first max(1, PREFETCH) W tiles are loaded before waiting for the previous kernel (W does not
    depend on it; x and the residual do), and the next kernel may launch once every program has started.
    L2_PF (with PDL; 0: off): W's elements per L2 line; the rest of the program's slab is requested from L2 before
    the wait (:func:`_prefetch_slab`)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, M_PAD)
    mask_m = offs_m < M
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    g_rows = G + offs_m[:, None].to(tl.int64) * stride_gm
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    if PREFETCH > 0 or PDL:
        offs_k0 = tl.arange(0, BLOCK_K)
        w_next = tl.load(w_rows + offs_k0[None, :], mask=mask_n[:, None] & (offs_k0[None, :] < K), other=0.0)
    if PREFETCH == 2:
        offs_k1 = BLOCK_K + tl.arange(0, BLOCK_K)
        w_next2 = tl.load(w_rows + offs_k1[None, :], mask=mask_n[:, None] & (offs_k1[None, :] < K), other=0.0)
    if PDL:  # everything below reads the previous kernel's output (x, residual) or writes ours
        if L2_PF > 0:
            _prefetch_slab(W, offs_n, N, K, stride_wn, BLOCK_K, L2_PF)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ss = tl.zeros([M_PAD], dtype=tl.float32)
    rstd = ss
    if PROLOGUE == 1 and not ONE_PASS:
        rstd = _rms_rstd(x_rows, mask_m, K, eps, M_PAD, BLOCK_K)
    # one row (batch-1 decode): accumulate [BLOCK_N, BLOCK_K] products element-wise and reduce once at the end,
    # so the loop body is loads and FMAs only; several rows: reduce each tile ([M_PAD, BLOCK_N, BLOCK_K] -> sum K)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask_x = mask_m[:, None] & mask_k[None, :]
        if PREFETCH == 2:
            w = w_next.to(tl.float32)
            w_next = w_next2
            offs_kn = offs_k + 2 * BLOCK_K
            w_next2 = tl.load(w_rows + offs_kn[None, :], mask=mask_n[:, None] & (offs_kn[None, :] < K), other=0.0)
        elif PREFETCH > 0 or PDL:
            w = w_next.to(tl.float32)
            offs_kn = offs_k + BLOCK_K
            w_next = tl.load(w_rows + offs_kn[None, :], mask=mask_n[:, None] & (offs_kn[None, :] < K), other=0.0)
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        if PROLOGUE == 1 and ONE_PASS:  # w_norm * x in float32; 1/rms applied to the sums below
            xf = tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
            ss += tl.sum(xf * xf, 1)
            xv = tl.load(NW + offs_k, mask=mask_k, other=0.0).to(tl.float32)[None, :] * xf
        else:
            xv = _prologue_x(NW, x_rows, g_rows, offs_k, mask_m, K, rstd, eps, PROLOGUE, GROUP, M_PAD, BLOCK_K)
        if M_PAD == 1:
            acc1 += w * xv.to(tl.float32)
        else:
            acc += tl.sum(w[None, :, :] * xv.to(tl.float32)[:, None, :], axis=2)
    if M_PAD == 1:
        acc = tl.sum(acc1, 1)[None, :]
    if PROLOGUE == 1 and ONE_PASS:
        acc = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    _store_rows(Y, R, acc, offs_m, offs_n, mask_m, mask_n, stride_rm, stride_ym, HAS_RES)


@triton.jit
def _prefetch_slab(W, offs_n, N, K, stride_wn, k_start, LINE: tl.constexpr):
    """Ask L2 for rows offs_n (clamped to N - 1) of W [N, K], columns k_start..K - 1, one request per LINE
    elements, 16 lines of each row per iteration (:func:`hylo_bench.kernels.l2_prefetch.prefetch_l2`)."""
    rows = W + tl.minimum(offs_n, N - 1)[:, None].to(tl.int64) * stride_wn
    offs_l = tl.arange(0, 16) * LINE
    for k0 in range(k_start, K, 16 * LINE):
        prefetch_l2(rows + tl.minimum(k0 + offs_l, K - 1)[None, :])


@triton.jit
def _store_rows(Y, R, acc, offs_m, offs_n, mask_m, mask_n, stride_rm, stride_ym, HAS_RES: tl.constexpr):
    """The epilogue of every GEMV form: Y[offs_m, offs_n] = acc [M_PAD, BLOCK_N] (float32) in Y's dtype, plus the
    residual R rounded once after the add when HAS_RES (``residual + linear(x)`` in the model dtype)."""
    mask_y = mask_m[:, None] & mask_n[None, :]
    y = acc.to(Y.dtype.element_ty)
    if HAS_RES:
        r = tl.load(R + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=mask_y, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], y, mask=mask_y)


@triton.jit
def _prologue_x(NW, x_rows, g_rows, offs_k, mask_m, K, rstd, eps, PROLOGUE: tl.constexpr, GROUP: tl.constexpr,
                M_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """The input slice [M_PAD, BLOCK_K] (columns offs_k) after the prologue, in x's dtype, rounded as the unfused
    modules round (:func:`hylo_bench.kernels.gemv.reference.fused_gemv_reference`). rstd [M_PAD]: PROLOGUE 1's
    1/rms. PROLOGUE 3 needs offs_k to start on a group boundary and BLOCK_K % GROUP == 0."""
    mask_k = offs_k < K
    mask_x = mask_m[:, None] & mask_k[None, :]
    xv = tl.load(x_rows + offs_k[None, :], mask=mask_x, other=0.0)
    if PROLOGUE == 1:  # w_norm * round(x * rstd), rounded: LlamaRMSNorm in the model dtype
        nw = tl.load(NW + offs_k, mask=mask_k, other=0.0)
        xn = (xv.to(tl.float32) * rstd[:, None]).to(xv.dtype)
        xv = (nw[None, :].to(tl.float32) * xn.to(tl.float32)).to(xv.dtype)
    elif PROLOGUE == 2:  # round(silu(gate)) * up, rounded: LlamaMLP's act_fn(gate) * up
        up = tl.load(x_rows + K + offs_k[None, :], mask=mask_x, other=0.0)
        gf = xv.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(xv.dtype)
        xv = (act.to(tl.float32) * up.to(tl.float32)).to(xv.dtype)
    elif PROLOGUE == 3:  # rmsnorm per group * w_norm * silu(gate) in float32, rounded once: GatedRMSNorm
        x3 = tl.reshape(xv.to(tl.float32), [M_PAD, BLOCK_K // GROUP, GROUP])
        r3 = 1.0 / tl.sqrt(tl.sum(x3 * x3, 2) / GROUP + eps)
        xn = tl.reshape(x3 * r3[:, :, None], [M_PAD, BLOCK_K])
        nw = tl.load(NW + offs_k % GROUP, mask=mask_k, other=0.0).to(tl.float32)
        gt = tl.load(g_rows + offs_k[None, :], mask=mask_x, other=0.0).to(tl.float32)
        xv = (xn * nw[None, :] * (gt / (1.0 + tl.exp(-gt)))).to(xv.dtype)
    return xv


@triton.autotune(configs=_DOT_CONFIGS, key=["N", "K", "M_PAD", "PROLOGUE", "GROUP", "HAS_RES", "PDL", "L2_PF"],
                 prune_configs_by={"early_config_prune": _prune_for_group})
@triton.jit
def _fused_gemv_dot_kernel(X, W, NW, G, R, Y, M, N, K, stride_xm, stride_wn, stride_gm, stride_rm, stride_ym, eps,
                           PROLOGUE: tl.constexpr, GROUP: tl.constexpr, HAS_RES: tl.constexpr, M_PAD: tl.constexpr,
                           PDL: tl.constexpr, L2_PF: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Tensor-core form (module docstring): program p owns output features [p BLOCK_N, (p + 1) BLOCK_N) of every
    row; PROLOGUE / GROUP / HAS_RES as in the row-block kernel, M_PAD >= 16 (tl.dot's smallest M). The prologue's
    input tile is rounded to W's dtype before the product, as the row-block kernel's is (exact products in
    float32). IEEE: float32 products in full precision (float32 weights: tests), not TF32. L2_PF as in the row-block
    kernel (the whole slab)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, M_PAD)
    mask_m = offs_m < M
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    g_rows = G + offs_m[:, None].to(tl.int64) * stride_gm
    w_rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    if PDL:  # x and the residual are the previous kernel's output
        if L2_PF > 0:
            _prefetch_slab(W, offs_n, N, K, stride_wn, 0, L2_PF)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rstd = tl.zeros([M_PAD], dtype=tl.float32)
    if PROLOGUE == 1:
        rstd = _rms_rstd(x_rows, mask_m, K, eps, M_PAD, BLOCK_K)
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & (offs_k[None, :] < K), other=0.0)
        xv = _prologue_x(NW, x_rows, g_rows, offs_k, mask_m, K, rstd, eps, PROLOGUE, GROUP, M_PAD, BLOCK_K)
        if IEEE:
            acc = tl.dot(xv.to(w.dtype), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv.to(w.dtype), tl.trans(w), acc)
    _store_rows(Y, R, acc, offs_m, offs_n, mask_m, mask_n, stride_rm, stride_ym, HAS_RES)


@triton.jit
def _prologue_rows_kernel(X, NW, G, Y, M, K, stride_xm, stride_gm, stride_ym, eps, PROLOGUE: tl.constexpr,
                          GROUP: tl.constexpr, PDL: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[m, k-block] = prologue(X)[m, k-block] in X's dtype (PROLOGUE 1-3 as in the row-block kernel, rounded as
    :func:`_prologue_x` rounds). Grid (M, cdiv(K, BLOCK_K)); BLOCK_K a multiple of GROUP."""
    m = tl.program_id(0)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = tl.full([1], m, dtype=tl.int64)
    mask_m = rows < M
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_rows = X + rows[:, None] * stride_xm
    rstd = tl.zeros([1], dtype=tl.float32)
    if PROLOGUE == 1:
        rstd = _rms_rstd(x_rows, mask_m, K, eps, 1, BLOCK_K)
    xv = _prologue_x(NW, x_rows, G + rows[:, None] * stride_gm, offs_k, mask_m, K, rstd, eps, PROLOGUE, GROUP, 1,
                     BLOCK_K)
    tl.store(Y + rows[:, None] * stride_ym + offs_k[None, :], xv, mask=mask_m[:, None] & (offs_k[None, :] < K))


def _l2_line(weight: torch.Tensor, pdl: bool) -> int:
    """The kernels' L2_PF: W's elements per L2 line when the slab prefetch runs (PDL and ``L2_PREFETCH``), else 0."""
    return line_elements(weight.element_size()) if pdl and L2_PREFETCH else 0


def _launch_dot(x2, weight, nw, g2, r2, y, M, N, K, eps, prologue, group, has_res, pdl):
    _fused_gemv_dot_kernel[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]),)](
        x2, weight, nw, g2, r2, y, M, N, K, x2.stride(0), weight.stride(0), g2.stride(0), r2.stride(0),
        y.stride(0), float(eps), PROLOGUE=prologue, GROUP=group, HAS_RES=has_res,
        M_PAD=max(16, triton.next_power_of_2(M)), PDL=pdl, L2_PF=_l2_line(weight, pdl),
        IEEE=weight.dtype == torch.float32, launch_pdl=pdl)


def _rows_gemv(form, x2, weight, nw, g2, r2, y, M, N, K, eps, prologue, group, has_res, pdl, glu, norm_weight,
               residual, gate):
    """y [M, N] = residual + prologue(x2) @ weight.T by one multi-row form ("dot", "dot_fused", "torch")."""
    if form == "torch":
        from hylo_bench.kernels.gemv.reference import fused_gemv_reference

        y.copy_(fused_gemv_reference(x2, weight, norm_weight=norm_weight, eps=eps, glu=glu,
                                     residual=residual.reshape(M, N) if residual is not None else None,
                                     gate=g2 if gate is not None else None))
    elif form == "dot_fused" or prologue == 0:
        _launch_dot(x2, weight, nw, g2, r2, y, M, N, K, eps, prologue, group, has_res, pdl)
    else:
        xp = torch.empty(M, K, dtype=x2.dtype, device=x2.device)
        block_k = max(1024, group)
        _prologue_rows_kernel[(M, triton.cdiv(K, block_k))](
            x2, nw, g2, xp, M, K, x2.stride(0), g2.stride(0), xp.stride(0), float(eps), PROLOGUE=prologue,
            GROUP=group, PDL=pdl, BLOCK_K=block_k, launch_pdl=pdl, num_warps=4)
        _launch_dot(xp, weight, nw, g2, r2, y, M, N, K, eps, 0, group, has_res, pdl)


def _persistent_grid(n_sm: int):
    def grid(meta):
        tiles = triton.cdiv(meta["N"], meta["BLOCK_N"])
        return (tiles if meta["GRID_MULT"] == 0 else min(tiles, n_sm * meta["GRID_MULT"]),)
    return grid


def _make_persistent(tma: bool):
    @triton.autotune(configs=_persistent_configs(tma), key=["N", "K", "M_PAD", "PROLOGUE", "GROUP", "HAS_RES"],
                     prune_configs_by={"early_config_prune": _prune_for_group})
    @triton.jit
    def kernel(X, W, WD, NW, G, R, Y, M, N, K, stride_xm, stride_wn, stride_gm, stride_rm, stride_ym, eps,
               PROLOGUE: tl.constexpr, GROUP: tl.constexpr, HAS_RES: tl.constexpr, M_PAD: tl.constexpr,
               USE_TMA: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, GRID_MULT: tl.constexpr):
        """Persistent form (module docstring). PROLOGUE / HAS_RES / M_PAD as in the row-block kernel; WD: W's
        tensor descriptor when USE_TMA (W is then unused)."""
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        n_tiles = tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        my_tiles = tl.cdiv(n_tiles - pid, nprog)
        offs_m = tl.arange(0, M_PAD)
        mask_m = offs_m < M
        x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
        g_rows = G + offs_m[:, None].to(tl.int64) * stride_gm
        rstd = tl.zeros([M_PAD], dtype=tl.float32)
        if PROLOGUE == 1:
            rstd = _rms_rstd(x_rows, mask_m, K, eps, M_PAD, BLOCK_K)
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for it in tl.range(0, my_tiles * k_tiles, num_stages=STAGES):
            j = it // k_tiles
            kk = it - j * k_tiles
            n0 = (pid + j * nprog) * BLOCK_N
            offs_n = n0 + tl.arange(0, BLOCK_N)
            offs_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
            if USE_TMA:
                w = WD.load([n0, kk * BLOCK_K]).to(tl.float32)
            else:
                w = tl.load(W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                            mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            xv = _prologue_x(NW, x_rows, g_rows, offs_k, mask_m, K, rstd, eps, PROLOGUE, GROUP, M_PAD,
                             BLOCK_K).to(tl.float32)
            if M_PAD == 1:
                acc1 += w * xv
            else:
                acc += tl.sum(w[None, :, :] * xv[:, None, :], axis=2)
            if kk == k_tiles - 1:
                if M_PAD == 1:
                    acc = tl.sum(acc1, 1)[None, :]
                _store_rows(Y, R, acc, offs_m, offs_n, mask_m, offs_n < N, stride_rm, stride_ym, HAS_RES)
                acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
                acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return kernel


_fused_gemv_persistent_kernel = _make_persistent(False)
_fused_gemv_tma_kernel = _make_persistent(True)
_N_SM: dict[int, int] = {}


def fused_gemv_triton(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, glu: bool,
                      residual: torch.Tensor | None, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`hylo_bench.kernels.gemv.reference.fused_gemv_reference` (same arguments, checked
    by the caller; with ``gate`` the group size ``norm_weight.numel()`` must be a power of two <= 1024). x: [..., K]
    or [..., 2K] with at most ``MAX_ROWS`` rows; returns [..., N] in x's dtype."""
    N, K = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    weight_is_input = weight.stride(-1) == 1
    if not weight_is_input:
        weight = weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    r2 = residual.reshape(M, N) if residual is not None else y
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    nw = norm_weight.contiguous() if norm_weight is not None else weight  # dummy pointer when unused
    g2 = gate.reshape(M, K) if gate is not None else x2  # dummy pointer when unused
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    group = norm_weight.numel() if gate is not None else 1
    prologue = 3 if gate is not None else 1 if norm_weight is not None else 2 if glu else 0
    if KERNEL not in KERNELS:
        raise ValueError(f"triton_kernel.KERNEL={KERNEL!r}; expected one of {KERNELS}")
    if ROWS_KERNEL not in ROWS_KERNELS:
        raise ValueError(f"triton_kernel.ROWS_KERNEL={ROWS_KERNEL!r}; expected one of {ROWS_KERNELS}")
    if M > 1 and ROWS_KERNEL != "rowblock":
        pdl = use_pdl(x.device) and weight_is_input
        args = (x2, weight, nw, g2, r2, y, M, N, K, eps, prologue, group, residual is not None, pdl, glu, norm_weight,
                residual, gate)
        _rows_gemv(ROWS_KERNEL, *args)
        return y.view(*lead, N)
    if KERNEL != "rowblock":
        dev = (x.device.index if x.device.index is not None else torch.cuda.current_device()) \
            if x.device.type == "cuda" else -1
        if dev not in _N_SM:  # -1: Triton's interpreter on CPU (tests), four "multiprocessors"
            _N_SM[dev] = torch.cuda.get_device_properties(dev).multi_processor_count if dev >= 0 else 4
        tma = KERNEL == "persistent_tma"
        wd = TensorDescriptor.from_tensor(weight, [1, 16]) if tma else weight  # box set per config (_tma_block_hook)
        kern = _fused_gemv_tma_kernel if tma else _fused_gemv_persistent_kernel
        kern[_persistent_grid(_N_SM[dev])](
            x2, weight, wd, nw, g2, r2, y, M, N, K, x2.stride(0), weight.stride(0), g2.stride(0), r2.stride(0),
            y.stride(0), float(eps), PROLOGUE=prologue, GROUP=group, HAS_RES=residual is not None,
            M_PAD=triton.next_power_of_2(M),
            USE_TMA=tma)
        return y.view(*lead, N)
    # with PDL the kernel reads W before the previous kernel has finished: not when that kernel wrote W (the copy)
    pdl = use_pdl(x.device) and weight_is_input
    m_pad = triton.next_power_of_2(M)
    args = (x2, weight, nw, g2, r2, y, M, N, K, x2.stride(0), weight.stride(0), g2.stride(0), r2.stride(0),
            y.stride(0), float(eps))
    meta = {"PROLOGUE": prologue, "GROUP": group, "HAS_RES": residual is not None, "M_PAD": m_pad,
            "ONE_PASS": ONE_PASS_NORM, "PDL": pdl, "L2_PF": _l2_line(weight, pdl), "launch_pdl": pdl}
    cfg = _tuned(x.device, (N, K, m_pad, prologue, group, residual is not None)) if not ONE_PASS_NORM else None
    if cfg is not None:  # tuned in the decode step (hylo_bench.kernels.gemv.tuned): launch it, no autotuning
        _fused_gemv_kernel.fn[(triton.cdiv(N, cfg["BLOCK_N"]),)](
            *args, **meta, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PREFETCH=cfg["PREFETCH"],
            num_warps=cfg["num_warps"])
    else:
        _fused_gemv_kernel[lambda m: (triton.cdiv(N, m["BLOCK_N"]),)](*args, **meta)
    return y.view(*lead, N)


USE_TUNED = True  # False: autotune every shape (benchmarks/gemv_step_tune.py compares)
_DEVICE_NAMES: dict[int, str] = {}


def _tuned(device: torch.device, key: tuple) -> dict | None:
    """The device's tuned row-block config for ``key`` (:func:`hylo_bench.kernels.gemv.tuned.tuned_config`), or
    None (no table entry, ``USE_TUNED`` off, or not CUDA: the interpreter's tests)."""
    if not USE_TUNED or device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE_NAMES:
        _DEVICE_NAMES[idx] = torch.cuda.get_device_name(idx)
    return tuned_config(_DEVICE_NAMES[idx], key)
