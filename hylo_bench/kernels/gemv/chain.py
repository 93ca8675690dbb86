"""A decoder layer's MLP at batch 1 as one persistent Triton kernel: ``y = x + down(silu(gate) * up)`` with
``[gate ; up] = gate_up(rmsnorm(x))``, two GEMV phases separated by a grid-wide barrier. CUDA (sm_90) only,
experimental: ``benchmarks/gemv_chain.py`` times it against the engine's two fused GEMV kernels; the engine runs it
only with the ``fused_gemvs`` entry "mlp_chain" (off by default). Contract:
:func:`hylo_bench.kernels.gemv.reference.mlp_chain_reference` (the two fused GEMVs the engine's decode step runs).

Why: a batch-1 decode step is a chain of GEMVs, each reading its weight once. Every kernel boundary costs the tail
of one kernel (its last programs leave most multiprocessors idle) and the ramp of the next (the first loads of every
program wait a full memory latency). Inside one kernel the weights of phase 2 do not depend on phase 1, so each
program loads its first phase-2 tiles (registers, ``PF``) and asks L2 for the rest of its phase-2 slab (``L2PF``)
before it waits at the barrier: HBM stays busy across the boundary.

The barrier is sense-reversing over two int32 words ``[count, generation]`` (:func:`_grid_barrier`), which needs
every program resident at once: :func:`mlp_chain_triton` launches at most ``resident_programs`` programs (the
multiprocessors times the blocks one of them holds, from the compiled kernel's registers, warps and shared memory).
Phase-1 output crosses programs through L2 (``.cg`` loads, after the barrier's acquire).

Off in the engine: its persistent grid keeps fewer weight bytes in flight than the row-block GEMV's thousands of
short programs, which costs more than the boundary it removes (an H100: 38.8 against 30.8 us a layer,
``benchmarks/results/gemv_chain_h100_7cc825e.json``).

Legend: K hidden size (x [K]), I intermediate size (gate_up [2I, K], down [K, I]), BN output rows per tile, BK
input features per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo_bench.kernels.l2_prefetch import line_elements, prefetch_l2
from hylo_bench.kernels.pdl import use_pdl

_BARRIERS: dict[int, torch.Tensor] = {}
_CAPS: dict[tuple, int] = {}  # resident programs per (device, config), read after the first launch


@triton.jit
def _grid_barrier(Bar, nprog):
    """Every program of the grid waits here until all have arrived. Bar: int32 [count, generation]; the last
    arriver resets the count and bumps the generation (release), the others spin on the generation (acquire).
    The CTA barriers around it order the program's other threads' stores before the arrival and its loads after."""
    gen = tl.atomic_add(Bar + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    old = tl.atomic_add(Bar, 1, sem="acq_rel", scope="gpu")
    if old == nprog - 1:
        tl.atomic_xchg(Bar, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(Bar + 1, 1, sem="release", scope="gpu")
    else:
        cur = tl.atomic_add(Bar + 1, 0, sem="acquire", scope="gpu")
        while cur == gen:
            cur = tl.atomic_add(Bar + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _mlp_chain_kernel(X, NW, WGU, WD, Hb, Y, Bar, K, I, eps,
                      BN: tl.constexpr, BK: tl.constexpr, PF: tl.constexpr, L2PF: tl.constexpr, PDL: tl.constexpr):
    """Phase 1: Hb[r] = gate_up[r] . rmsnorm(x) for row blocks pid, pid + nprog, ... of 2I rows (rounded to x's
    dtype). Phase 2: Y[r] = x[r] + down[r] . (silu(gate) * up) for row blocks of K rows. PF (1 or 2): W tiles
    held in registers ahead of the one multiplied; the first PF tiles of phase 2 load before the barrier. L2PF (0:
    off): elements per L2 line; the program's phase-2 slab is requested from L2 before the barrier. PDL: the first
    phase-1 tiles load before waiting for the previous kernel; the next kernel may launch after the barrier."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    N1 = 2 * I
    offs_b = tl.arange(0, BN)
    offs_t = tl.arange(0, BK)
    # phase 1: tiles t = 0 .. my1 * kt1 - 1, row block pid + (t // kt1) * nprog, K block t % kt1
    kt1 = tl.cdiv(K, BK)
    my1 = tl.cdiv(tl.cdiv(N1, BN) - pid, nprog)
    rows = pid * BN + offs_b
    w_a = tl.load(WGU + rows[:, None].to(tl.int64) * K + offs_t[None, :],
                  mask=(rows[:, None] < N1) & (offs_t[None, :] < K), other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    ss = tl.zeros([1], dtype=tl.float32)
    for k0 in range(0, K, BK):
        xv = tl.load(X + k0 + offs_t, mask=k0 + offs_t < K, other=0.0).to(tl.float32)
        ss += tl.sum(xv * xv, 0)
    rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for t in range(0, my1 * kt1):
        j = t // kt1
        kk = t - j * kt1
        w = w_a.to(tl.float32)
        tn = t + 1  # the next tile, into registers while this one is multiplied
        rn = (pid + (tn // kt1) * nprog) * BN + offs_b
        kn = (tn % kt1) * BK + offs_t
        w_a = tl.load(WGU + rn[:, None].to(tl.int64) * K + kn[None, :],
                      mask=(tn < my1 * kt1) & (rn[:, None] < N1) & (kn[None, :] < K), other=0.0)
        offs_k = kk * BK + offs_t
        mask_k = offs_k < K
        xv = tl.load(X + offs_k, mask=mask_k, other=0.0)
        nw = tl.load(NW + offs_k, mask=mask_k, other=0.0)
        xn = (xv.to(tl.float32) * rstd).to(xv.dtype)  # LlamaRMSNorm's rounding (fused_gemv_reference)
        xn = (nw.to(tl.float32) * xn.to(tl.float32)).to(xv.dtype)
        acc += w * xn.to(tl.float32)[None, :]
        if kk == kt1 - 1:
            r = (pid + j * nprog) * BN + offs_b
            tl.store(Hb + r, tl.sum(acc, 1).to(Hb.dtype.element_ty), mask=r < N1)
            acc = tl.zeros([BN, BK], dtype=tl.float32)
    # phase 2's first tiles and slab: they do not depend on phase 1
    kt2 = tl.cdiv(I, BK)
    my2 = tl.cdiv(tl.cdiv(K, BN) - pid, nprog)
    rows2 = pid * BN + offs_b
    m2 = (my2 > 0) & (rows2[:, None] < K)
    w_b = tl.load(WD + rows2[:, None].to(tl.int64) * I + offs_t[None, :], mask=m2 & (offs_t[None, :] < I),
                  other=0.0)
    if PF == 2:  # tile 1: the same row block's second K block, or the next row block's first
        r1 = (pid + (1 // kt2) * nprog) * BN + offs_b
        k1 = (1 % kt2) * BK + offs_t
        w_c = tl.load(WD + r1[:, None].to(tl.int64) * I + k1[None, :],
                      mask=(my2 * kt2 > 1) & (r1[:, None] < K) & (k1[None, :] < I), other=0.0)
    if L2PF > 0:
        offs_l = tl.arange(0, 16) * L2PF
        for jj in range(0, my2):
            rr = tl.minimum((pid + jj * nprog) * BN + offs_b, K - 1)
            base = WD + rr[:, None].to(tl.int64) * I
            for e0 in range(0, I, 16 * L2PF):
                prefetch_l2(base + tl.minimum(e0 + offs_l, I - 1)[None, :])
    _grid_barrier(Bar, nprog)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for t in range(0, my2 * kt2):
        j = t // kt2
        kk = t - j * kt2
        w = w_b.to(tl.float32)
        tn = t + PF
        rn = (pid + (tn // kt2) * nprog) * BN + offs_b
        kn = (tn % kt2) * BK + offs_t
        w_n = tl.load(WD + rn[:, None].to(tl.int64) * I + kn[None, :],
                      mask=(tn < my2 * kt2) & (rn[:, None] < K) & (kn[None, :] < I), other=0.0)
        if PF == 2:
            w_b = w_c
            w_c = w_n
        else:
            w_b = w_n
        offs_k = kk * BK + offs_t
        mask_k = offs_k < I
        g = tl.load(Hb + offs_k, mask=mask_k, other=0.0, cache_modifier=".cg")
        u = tl.load(Hb + I + offs_k, mask=mask_k, other=0.0, cache_modifier=".cg")
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # LlamaMLP: act_fn(gate) * up, each rounded
        hv = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
        acc += w * hv.to(tl.float32)[None, :]
        if kk == kt2 - 1:
            r = (pid + j * nprog) * BN + offs_b
            y = tl.sum(acc, 1).to(Y.dtype.element_ty)
            res = tl.load(X + r, mask=r < K, other=0.0)
            tl.store(Y + r, (y.to(tl.float32) + res.to(tl.float32)).to(Y.dtype.element_ty), mask=r < K)
            acc = tl.zeros([BN, BK], dtype=tl.float32)


def _barrier(device: torch.device) -> torch.Tensor:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _BARRIERS:
        _BARRIERS[idx] = torch.zeros(2, dtype=torch.int32, device=device)
    return _BARRIERS[idx]


def resident_programs(kernel, device: torch.device, num_warps: int) -> int:
    """How many programs of the compiled ``kernel`` (the ``CompiledKernel`` a launch returns) fit on ``device`` at
    once: the multiprocessors times the blocks one multiprocessor holds by registers (64K per SM), warps (64 per
    SM, 32 blocks at most) and shared memory (the device's per-SM limit)."""
    props = torch.cuda.get_device_properties(device)
    if getattr(kernel, "n_regs", None) is None or not hasattr(kernel, "metadata"):
        return props.multi_processor_count  # unknown occupancy: one program per multiprocessor always fits
    regs = max(1, kernel.n_regs) * 32 * num_warps
    by_regs = 65536 // regs
    by_warps = min(32, 64 // num_warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    by_smem = smem // max(1, kernel.metadata.shared + 1024) if kernel.metadata.shared else by_warps
    return props.multi_processor_count * max(0, min(by_regs, by_warps, by_smem))


def mlp_chain_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
                     down: torch.Tensor, *, block_n: int = 2, block_k: int = 1024, num_warps: int = 4,
                     programs_per_sm: int = 4, programs: int | None = None, pf: int = 1,
                     l2_prefetch: bool = False) -> torch.Tensor:
    """:func:`hylo_bench.kernels.gemv.reference.mlp_chain_reference` for one row (x [1, K] or [K]) in one
    persistent kernel (module docstring).

    Args:
        programs_per_sm: the grid is this times the multiprocessors, capped by the row blocks of phase 1 and by
            :func:`resident_programs` (the barrier needs every program resident). programs: the grid itself
            (same caps) instead.
        pf: 1 or 2 W tiles in registers ahead. l2_prefetch: ask L2 for the phase-2 slab before the barrier.

    Returns:
        [..., K] in x's dtype.

    Raises:
        ValueError: more than one row, wrong shapes or dtypes, ``pf`` not 1 or 2, or a device where fewer than
            one program per multiprocessor is resident.
    """
    K = x.shape[-1]
    if x.numel() != K:
        raise ValueError(f"mlp_chain_triton serves one row; got x of shape {tuple(x.shape)}")
    I2, Kg = gate_up.shape
    if Kg != K or I2 % 2 or down.shape != (K, I2 // 2) or norm_weight.shape != (K,):
        raise ValueError(f"expected gate_up [2I, {K}], down [{K}, I], norm_weight [{K}]; got "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}, {tuple(norm_weight.shape)}")
    if any(t.dtype != x.dtype for t in (norm_weight, gate_up, down)):
        raise ValueError("x, norm_weight, gate_up and down must share one dtype")
    if pf not in (1, 2):
        raise ValueError(f"pf must be 1 or 2; got {pf}")
    dev = x.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    n_sm = torch.cuda.get_device_properties(idx).multi_processor_count
    I = I2 // 2
    xf = x.reshape(K).contiguous()
    h = torch.empty(I2, dtype=x.dtype, device=dev)
    y = torch.empty(K, dtype=x.dtype, device=dev)
    pdl = use_pdl(dev)
    l2 = line_elements(x.element_size()) if l2_prefetch else 0
    grid = min(programs or n_sm * programs_per_sm, triton.cdiv(I2, block_n))
    meta = dict(BN=block_n, BK=block_k, PF=pf, L2PF=l2, PDL=pdl, num_warps=num_warps)
    args = (xf, norm_weight, gate_up, down, h, y, _barrier(dev), K, I, float(eps))
    key = (idx, block_n, block_k, pf, l2, pdl, num_warps, x.dtype)
    if key not in _CAPS:  # first call: one program per multiprocessor (always resident), then read the occupancy
        compiled = _mlp_chain_kernel[(n_sm,)](*args, **meta, launch_pdl=pdl)
        _CAPS[key] = resident_programs(compiled, dev, num_warps)
        if _CAPS[key] < n_sm:
            raise ValueError(f"mlp_chain_triton: only {_CAPS[key]} programs fit at once on "
                             f"{torch.cuda.get_device_name(idx)} (block_n={block_n}, block_k={block_k}, "
                             f"num_warps={num_warps})")
        return y.view(x.shape)
    _mlp_chain_kernel[(min(grid, _CAPS[key]),)](*args, **meta, launch_pdl=pdl)
    return y.view(x.shape)
