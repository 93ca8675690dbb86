"""Fused decode GEMV (hylo_bench.kernels.gemv): the torch reference against the unfused transformers modules it
replaces, and the Triton kernel against the reference (Triton's interpreter on CPU: ``TRITON_INTERPRET=1``;
on CUDA in the GPU tests)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hylo_bench.kernels.gemv import fused_gemv, fused_gemv_reference

_interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                             reason="needs TRITON_INTERPRET=1 and triton installed")


def _modules(K=48, N=40, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    norm = LlamaRMSNorm(K, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(K, generator=gen, dtype=dtype) + 0.5)
    lin = nn.Linear(K, N, bias=False).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=gen, dtype=dtype) / K ** 0.5)
    return norm, lin, gen


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_reference_equals_rmsnorm_then_linear_plus_residual(dtype):
    norm, lin, gen = _modules(dtype=dtype)
    x = torch.randn(3, 1, 48, generator=gen, dtype=torch.float64).to(dtype) * 3
    res = torch.randn(3, 1, 40, generator=gen, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        want = res + lin(norm(x))
        got = fused_gemv_reference(x, lin.weight, norm_weight=norm.weight, eps=norm.variance_epsilon, residual=res)
    assert got.dtype == dtype and got.shape == (3, 1, 40)
    assert torch.equal(got, want)


def test_reference_glu_equals_llama_mlp_down():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=24)).double()
    x = torch.randn(2, 1, 32, dtype=torch.float64)
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
    with torch.no_grad():
        got = fused_gemv_reference(gate_up, mlp.down_proj.weight, glu=True, residual=x)
        want = x + mlp(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_reference_gated_equals_gdn_o_norm_then_o_proj_plus_residual(dtype):
    from hylo_bench.models.gdn import GatedRMSNorm

    gen = torch.Generator().manual_seed(1)
    H, Vd, N = 3, 16, 40
    norm = GatedRMSNorm(Vd, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(Vd, generator=gen) + 0.5)
    w = (torch.randn(N, H * Vd, generator=gen) / (H * Vd) ** 0.5).to(dtype)
    o = (torch.randn(2, 1, H * Vd, generator=gen) * 3).to(dtype)
    gate = torch.randn(2, 1, H * Vd, generator=gen).to(dtype)
    res = torch.randn(2, 1, N, generator=gen).to(dtype)
    with torch.no_grad():
        want = res + torch.nn.functional.linear(norm(o.view(2, 1, H, Vd), gate.view(2, 1, H, Vd)).flatten(-2), w)
        got = fused_gemv(o, w, norm_weight=norm.weight, eps=1e-5, residual=res, gate=gate)
    assert got.dtype == dtype and torch.equal(got, want)


def test_gated_prologue_checks_the_group_and_gate():
    w = torch.zeros(8, 48)
    with pytest.raises(ValueError, match="G dividing K=48"):
        fused_gemv(torch.zeros(1, 48), w, norm_weight=torch.ones(10), gate=torch.zeros(1, 48))
    with pytest.raises(ValueError, match="gate must have x's shape"):
        fused_gemv(torch.zeros(1, 48), w, norm_weight=torch.ones(16), gate=torch.zeros(1, 40))


def test_bad_shapes_name_the_argument():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"x must be \[..., 32\]"):
        fused_gemv(torch.zeros(1, 16), w, glu=True)
    with pytest.raises(ValueError, match=r"norm_weight must be \[K=16\]"):
        fused_gemv(torch.zeros(1, 16), w, norm_weight=torch.ones(8))
    with pytest.raises(ValueError, match="residual must be"):
        fused_gemv(torch.zeros(2, 16), w, residual=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="backend"):
        fused_gemv(torch.zeros(1, 16), w, backend="cuda")


def test_triton_backend_on_cpu_takes_the_reference():
    norm, lin, gen = _modules(dtype=torch.float32)
    x = torch.randn(2, 48, generator=gen)
    got = fused_gemv(x, lin.weight, norm_weight=norm.weight, eps=1e-5, backend="triton")
    want = fused_gemv_reference(x, lin.weight, norm_weight=norm.weight, eps=1e-5)
    assert torch.equal(got, want)


@pytest.fixture
def _stub_autotune(monkeypatch):
    at = pytest.importorskip("triton.runtime.autotuner")
    monkeypatch.setattr(at.Autotuner, "do_bench", lambda self, *a, **k: [0.0, 0.0, 0.0])


@_interp
@pytest.mark.slow
@pytest.mark.usefixtures("_stub_autotune")
@pytest.mark.parametrize("M,N,K", [(1, 40, 48), (3, 130, 304), (5, 17, 1040)])
@pytest.mark.parametrize("mode,dtype", [(m, torch.float32) for m in ("plain", "norm", "norm+res", "glu+res",
                                                                     "gated+res")]
                         + [("plain+res", torch.bfloat16)])
@pytest.mark.parametrize("one_pass,prefetch", [(True, 0), (False, 1), (False, 2)])
def test_triton_kernel_matches_reference(M, N, K, mode, dtype, one_pass, prefetch, monkeypatch):
    """The interpreter's float32 -> bfloat16 cast truncates (the GPU rounds to nearest), so the prologues' bf16
    roundings are checked on CUDA (test_triton_kernel_on_cuda_bf16); here float32, plus a bf16 load/store case.
    Both RMSNorm forms and both loop forms (one config each, small tiles so the loops run several times)."""
    import triton

    from hylo_bench.kernels.gemv import triton_kernel as tk

    monkeypatch.setattr(tk, "ONE_PASS_NORM", one_pass)
    monkeypatch.setattr(tk, "ROWS_KERNEL", "rowblock")  # its multi-row form too (the dot kernel: next test)
    monkeypatch.setattr(tk._fused_gemv_kernel, "configs",
                        [triton.Config({"BLOCK_N": 4, "BLOCK_K": 16 if prefetch else 32, "PREFETCH": prefetch})])
    monkeypatch.setattr(tk._fused_gemv_kernel, "cache", {})  # no best config remembered from another test
    _check_triton(M, N, K, mode, dtype, "cpu")


@_interp
@pytest.mark.slow
@pytest.mark.usefixtures("_stub_autotune")
@pytest.mark.parametrize("M,N,K", [(1, 40, 48), (3, 130, 304)])
@pytest.mark.parametrize("mode", ["norm", "norm+res", "glu+res", "gated+res"])
@pytest.mark.parametrize("kernel", ["persistent", "persistent_tma"])
@pytest.mark.parametrize("grid_mult", [0, 1])
def test_persistent_kernel_matches_reference(M, N, K, mode, kernel, grid_mult, monkeypatch):
    """The persistent kernels (pointer loads and TMA descriptors), one program per tile (GRID_MULT 0) and a grid of
    four programs walking several row blocks each (GRID_MULT 1, four "multiprocessors" on CPU), with ragged N and K
    so the last tiles are masked / zero-filled."""
    import triton

    from hylo_bench.kernels.gemv import triton_kernel as tk

    kern = tk._fused_gemv_tma_kernel if kernel == "persistent_tma" else tk._fused_gemv_persistent_kernel
    monkeypatch.setattr(tk, "KERNEL", kernel)
    monkeypatch.setattr(kern, "configs", [triton.Config({"BLOCK_N": 4, "BLOCK_K": 16, "STAGES": 2,
                                                         "GRID_MULT": grid_mult}, pre_hook=tk._tma_block_hook)])
    monkeypatch.setattr(kern, "cache", {})
    _check_triton(M, N, K, mode, torch.float32, "cpu")


@_interp
@pytest.mark.slow
@pytest.mark.usefixtures("_stub_autotune")
@pytest.mark.parametrize("M,N,K", [(2, 40, 48), (5, 130, 304), (16, 17, 1040)])
@pytest.mark.parametrize("mode", ["plain", "norm", "norm+res", "glu+res", "gated+res"])
@pytest.mark.parametrize("form", ["dot", "dot_fused"])
def test_dot_kernel_matches_reference(M, N, K, mode, form, monkeypatch):
    """The tensor-core kernel for 2-16 rows (float32 here, products in full precision), with ragged N and K so the
    last tiles are masked, and a K loop of several tiles; its prologue in a kernel of its own ("dot") or in every
    program ("dot_fused")."""
    import triton

    from hylo_bench.kernels.gemv import triton_kernel as tk

    monkeypatch.setattr(tk, "ROWS_KERNEL", form)
    monkeypatch.setattr(tk._fused_gemv_dot_kernel, "configs",
                        [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "STAGES": 2})])
    monkeypatch.setattr(tk._fused_gemv_dot_kernel, "cache", {})
    _check_triton(M, N, K, mode, torch.float32, "cpu")


def test_unknown_rows_kernel_is_refused(monkeypatch):
    tk = pytest.importorskip("hylo_bench.kernels.gemv.triton_kernel")
    monkeypatch.setattr(tk, "ROWS_KERNEL", "splitk")
    with pytest.raises(ValueError, match="ROWS_KERNEL='splitk'"):
        tk.fused_gemv_triton(torch.zeros(2, 16), torch.zeros(8, 16), None, 1e-6, False, None)


def test_unknown_triton_kernel_is_refused(monkeypatch):
    tk = pytest.importorskip("hylo_bench.kernels.gemv.triton_kernel")
    monkeypatch.setattr(tk, "KERNEL", "splitk")
    with pytest.raises(ValueError, match="KERNEL='splitk'"):
        tk.fused_gemv_triton(torch.zeros(1, 16), torch.zeros(8, 16), None, 1e-6, False, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["persistent", "persistent_tma"])
@pytest.mark.parametrize("M,N,K,mode", [(1, 9228, 2048, "norm"), (1, 2048, 6144, "glu+res"), (4, 1664, 2048, "norm"),
                                        (1, 2048, 3072, "gated+res")])
def test_persistent_kernel_on_cuda_bf16(kernel, M, N, K, mode, monkeypatch):
    """Three configs of each (one program per tile; one and four programs per multiprocessor), not the whole
    autotune space (its compiles take minutes)."""
    tk = pytest.importorskip("hylo_bench.kernels.gemv.triton_kernel")
    kern = tk._fused_gemv_tma_kernel if kernel == "persistent_tma" else tk._fused_gemv_persistent_kernel
    monkeypatch.setattr(tk, "KERNEL", kernel)
    monkeypatch.setattr(kern, "configs", [c for c in kern.configs if c.kwargs["STAGES"] == 3
                                          and c.kwargs["BLOCK_N"] == 8 and c.kwargs["GRID_MULT"] in (0, 1, 4)])
    monkeypatch.setattr(kern, "cache", {})
    _check_triton(M, N, K, mode, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("copy_weight", [False, True])
def test_pdl_gemv_sees_the_previous_kernels_output_in_a_cuda_graph(copy_weight):
    """With programmatic dependent launch the GEMV starts before the kernel that writes its input has finished; it
    must still read the new x and residual (and, when the weight is a fresh copy, wait before reading it): a CUDA
    graph of 12 (write x, residual; GEMV) pairs, each GEMV checked against the reference on its own inputs."""
    tk = pytest.importorskip("hylo_bench.kernels.gemv.triton_kernel")
    N, K, steps = 9228, 2048, 12
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = torch.randn(steps, 1, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    rs = torch.randn(steps, 1, N, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(torch.bfloat16)
    w_arg = w.t().contiguous().t() if copy_weight else w  # column-major: fused_gemv_triton copies it
    nw = torch.rand(K, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
    xbuf, rbuf = torch.zeros_like(xs[0]), torch.zeros_like(rs[0])
    outs = []

    def run():
        outs.clear()
        for i in range(steps):
            torch.mul(xs[i], 3.0, out=xbuf)
            torch.mul(rs[i], 2.0, out=rbuf)
            outs.append(tk.fused_gemv_triton(xbuf, w_arg, nw, 1e-6, False, rbuf))

    run()  # autotune outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    xbuf.fill_(7.0)
    g.replay()
    torch.cuda.synchronize()
    for i in range(steps):
        want = fused_gemv_reference(xs[i] * 3.0, w, norm_weight=nw, eps=1e-6, residual=rs[i] * 2.0)
        err = ((outs[i].float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, (i, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M,N,K,rows_kernel", [(1, 9228, 2048, "dot"), (1, 2048, 6144, "dot"),
                                                (4, 1664, 2048, "dot"), (16, 130, 300, "dot"), (8, 2048, 6144, "dot"),
                                                (8, 2048, 6144, "dot_fused"), (8, 2048, 6144, "torch"),
                                                (4, 1664, 2048, "rowblock"), (16, 130, 300, "rowblock")])
@pytest.mark.parametrize("mode", ["plain", "norm", "norm+res", "glu+res"])
def test_triton_kernel_on_cuda_bf16(M, N, K, rows_kernel, mode, monkeypatch):
    tk = pytest.importorskip("hylo_bench.kernels.gemv.triton_kernel")
    monkeypatch.setattr(tk, "ROWS_KERNEL", rows_kernel)
    _check_triton(M, N, K, mode, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("M,N,K,block_k", [(1, 9228, 2048, 1024), (1, 2048, 6144, 512), (3, 130, 300, 128)])
@pytest.mark.parametrize("mode", ["norm", "glu+res"])
def test_rowblock_prefetch_levels_on_cuda_bf16(prefetch, M, N, K, block_k, mode, monkeypatch):
    """Each PREFETCH level (tiles loaded ahead; with PDL the first ones before the wait), forced as the only config:
    two and more K tiles per program, and a K that is not a multiple of the tile."""
    triton = pytest.importorskip("triton")
    from hylo_bench.kernels.gemv import triton_kernel as tk

    monkeypatch.setattr(tk, "ROWS_KERNEL", "rowblock")
    monkeypatch.setattr(tk, "USE_TUNED", False)  # the device's tuned table would override the forced config
    monkeypatch.setattr(tk._fused_gemv_kernel, "configs",
                        [triton.Config({"BLOCK_N": 4, "BLOCK_K": block_k, "PREFETCH": prefetch}, num_warps=4)])
    monkeypatch.setattr(tk._fused_gemv_kernel, "cache", {})
    _check_triton(M, N, K, mode, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M,N,K,block_k,form", [(1, 2048, 6144, 1024, "rowblock"), (3, 130, 300, 128, "rowblock"),
                                                 (8, 2048, 2048, 128, "dot"), (5, 130, 300, 256, "dot")])
@pytest.mark.parametrize("mode", ["norm", "glu+res"])
def test_l2_slab_prefetch_on_cuda_bf16(M, N, K, block_k, form, mode, monkeypatch):
    """``L2_PREFETCH`` (the slab requested from L2 before the PDL wait) is a hint: the row-block and tensor-core
    kernels still match the reference, with ragged N and K (the prefetch clamps its pointers into W)."""
    triton = pytest.importorskip("triton")
    from hylo_bench.kernels.gemv import triton_kernel as tk
    from hylo_bench.kernels.pdl import use_pdl

    if not use_pdl(torch.device("cuda")):
        pytest.skip("the prefetch runs only with programmatic dependent launch (compute capability >= 9)")
    monkeypatch.setattr(tk, "L2_PREFETCH", True)
    monkeypatch.setattr(tk, "ROWS_KERNEL", form)
    monkeypatch.setattr(tk, "USE_TUNED", False)
    monkeypatch.setattr(tk._fused_gemv_kernel, "configs",
                        [triton.Config({"BLOCK_N": 4, "BLOCK_K": block_k, "PREFETCH": 1}, num_warps=4)])
    monkeypatch.setattr(tk._fused_gemv_kernel, "cache", {})
    monkeypatch.setattr(tk._fused_gemv_dot_kernel, "configs",
                        [triton.Config({"BLOCK_N": 16, "BLOCK_K": block_k, "STAGES": 3}, num_warps=4)])
    monkeypatch.setattr(tk._fused_gemv_dot_kernel, "cache", {})
    _check_triton(M, N, K, mode, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [0, 2])
def test_tuned_table_entry_is_launched_and_matches_reference(prefetch, tmp_path, monkeypatch):
    """A table for this device (tuned/<device name>.json) with the shape: the kernel runs the table's config, not
    an autotuned one (the autotuner never sees the shape), and matches the reference."""
    pytest.importorskip("triton")
    import json

    from hylo_bench.kernels.gemv import triton_kernel as tk
    from hylo_bench.kernels.gemv import tuned

    entry = {"N": 640, "K": 1040, "M_PAD": 1, "PROLOGUE": 1, "GROUP": 1, "HAS_RES": False, "BLOCK_N": 4,
             "BLOCK_K": 256, "PREFETCH": prefetch, "num_warps": 4}
    tuned.table_path(torch.cuda.get_device_name(), tmp_path).write_text(json.dumps({"rowblock": [entry]}))
    monkeypatch.setattr(tuned, "TABLE_DIR", tmp_path)
    tuned._device_table.cache_clear()
    monkeypatch.setattr(tk, "USE_TUNED", True)
    monkeypatch.setattr(tk._fused_gemv_kernel, "cache", {})
    try:
        _check_triton(1, 640, 1040, "norm", torch.bfloat16, "cuda")
        assert not any(k[:2] == (640, 1040) for k in tk._fused_gemv_kernel.cache)
        _check_triton(1, 640, 1040, "plain", torch.bfloat16, "cuda")  # not in the table: autotuned
        assert any(k[:2] == (640, 1040) for k in tk._fused_gemv_kernel.cache)
    finally:
        tuned._device_table.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 4, 8])
def test_gated_norm_prologue_on_cuda_bf16(M):
    """GDN's o_proj shape (12 heads of 256) with its gated norm, one rounding of the normalised input."""
    pytest.importorskip("triton")
    _check_triton(M, 2048, 3072, "gated+res", torch.bfloat16, "cuda", group=256)


def _check_triton(M, N, K, mode, dtype, device, group=16):
    """mode: prologue (plain / norm / glu / gated: GDN's gated norm over groups of ``group``) + "+res"."""
    from hylo_bench.kernels.gemv.triton_kernel import fused_gemv_triton

    gen = torch.Generator().manual_seed(M * N + K)
    glu, gated = mode.startswith("glu"), mode.startswith("gated")
    x = (torch.randn(M, 2 * K if glu else K, generator=gen) * 2).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
    nw = (torch.rand(group if gated else K, generator=gen) + 0.5).to(dtype) \
        if mode.startswith(("norm", "gated")) else None
    res = torch.randn(M, N, generator=gen).to(dtype) if mode.endswith("res") else None
    # the gate as the engine passes it: a strided column slice of a wider projection output
    gate = torch.randn(M, K + 8, generator=gen).to(dtype)[:, 8:] if gated else None
    x, w, nw, res, gate = (t.to(device) if t is not None else None for t in (x, w, nw, res, gate))
    got = fused_gemv_triton(x, w, nw, 1e-6, glu, res, gate)
    want = fused_gemv_reference(x, w, norm_weight=nw, eps=1e-6, glu=glu, residual=res, gate=gate)
    assert got.shape == want.shape and got.dtype == dtype
    # fp32: summation order only. bf16: one rounding of the output (the float32 accumulators agree to ~1e-6).
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < tol


@_interp
@pytest.mark.slow
@pytest.mark.usefixtures("_stub_autotune")
def test_engine_on_triton_gemv_equals_torch_engine(monkeypatch):
    """The serving engine with gemv_backend="triton" and the GDN pre-step kernel running the real kernels
    (interpreter, float32) gives the unfused engine's greedy tokens."""
    from hylo_bench.decode.engine import FUSED_GEMVS, Engine
    from hylo_bench.kernels.gemv import ops
    from hylo_bench.kernels.gemv.triton_kernel import fused_gemv_triton
    from hylo_bench.models.hybrid import HyLoForCausalLM
    from tests.conftest import tiny_hybrid_config

    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3)
    ids = torch.randint(3, 97, (2, 13))
    want, _ = Engine(model, 2, 32, 5, gemv_backend="torch").generate(ids, 6)
    calls = []
    monkeypatch.setattr(ops, "_impl_gemv", lambda *a: calls.append(1) or fused_gemv_triton(*a))
    engine = Engine(model, 2, 32, 5, gemv_backend="triton", fused_gemvs=FUSED_GEMVS)
    for srv in engine.mixers:  # the GDN pre-step kernel too (the constructor refuses "triton" off CUDA)
        if getattr(srv, "kind", None) == "gdn":
            srv.prestep_backend = "triton"
    got, _ = engine.generate(ids, 6)
    assert torch.equal(got, want)
    assert len(calls) == 5 * (2 * 4 + 8) + 6  # 5 decode steps x 16 GEMVs, lm_head 6 times


def test_triton_serves_only_cuda_non_float64_one_to_16_rows():
    """The Triton kernel accumulates in float32 (a float64 input would lose the reference's precision: ~1e-6
    absolute error on unit-size data in the interpreter) and needs at least one row (tl.arange(0, 0) fails)."""
    from hylo_bench.kernels.gemv import triton_serves

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_serves(cuda, torch.bfloat16, 1) and triton_serves(cuda, torch.float32, 16)
    assert not triton_serves(cuda, torch.float64, 1)
    assert not triton_serves(cuda, torch.bfloat16, 0) and not triton_serves(cuda, torch.bfloat16, 17)
    assert not triton_serves(cpu, torch.bfloat16, 1)


def test_mismatched_dtypes_name_the_argument():
    """The result is in x's dtype on every back end: a residual / norm weight / weight of another dtype is refused
    (the reference would otherwise promote to float64 or fail inside F.linear with a bare dtype message)."""
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="residual must have x's dtype torch.float32; got torch.float64"):
        fused_gemv(torch.zeros(2, 16), w, residual=torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="norm_weight must have x's dtype torch.bfloat16"):
        fused_gemv(torch.zeros(2, 16, dtype=torch.bfloat16), w.bfloat16(), norm_weight=torch.ones(16))
    with pytest.raises(ValueError, match="weight must have x's dtype"):
        fused_gemv(torch.zeros(2, 16, dtype=torch.bfloat16), w)


@_interp
@pytest.mark.usefixtures("_stub_autotune")
def test_triton_kernel_strided_norm_weight(monkeypatch):
    """A norm weight that is a strided view (stride 2) is read element by element, not as if contiguous."""
    import triton

    from hylo_bench.kernels.gemv import triton_kernel as tk

    monkeypatch.setattr(tk._fused_gemv_kernel, "configs",
                        [triton.Config({"BLOCK_N": 4, "BLOCK_K": 16, "PREFETCH": False})])
    monkeypatch.setattr(tk._fused_gemv_kernel, "cache", {})
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=gen), torch.randn(10, 40, generator=gen)
    nw = (torch.rand(80, generator=gen) + 0.5)[::2]
    got = tk.fused_gemv_triton(x, w, nw, 1e-6, False, None)
    want = fused_gemv_reference(x, w, norm_weight=nw, eps=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
