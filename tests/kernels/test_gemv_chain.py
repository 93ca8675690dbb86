"""The persistent MLP kernel (hylo_bench.kernels.gemv.chain): its torch reference against transformers' LlamaMLP
with the norm before it (CPU), and the kernel against that reference on CUDA (its grid barrier needs every program
resident at once, which Triton's interpreter, running programs one after another, cannot give)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from hylo_bench.kernels.gemv.reference import mlp_chain_reference


def _layer(K, I, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_w = (torch.rand(K, generator=gen, device=device) + 0.5).to(dtype)
    gate_up = (torch.randn(2 * I, K, generator=gen, device=device) / K ** 0.5).to(dtype)
    down = (torch.randn(K, I, generator=gen, device=device) / I ** 0.5).to(dtype)
    x = (torch.randn(1, K, generator=gen, device=device) * 2).to(dtype)
    return x, norm_w, gate_up, down


def test_reference_equals_llama_norm_then_mlp_plus_residual():
    K, I = 40, 56
    x, norm_w, gate_up, down = _layer(K, I, torch.float64)
    norm = LlamaRMSNorm(K, eps=1e-5).double()
    cfg = LlamaConfig(hidden_size=K, intermediate_size=I, num_attention_heads=4, num_key_value_heads=4)
    mlp = LlamaMLP(cfg).double()
    with torch.no_grad():
        norm.weight.copy_(norm_w)
        mlp.gate_proj.weight.copy_(gate_up[:I])
        mlp.up_proj.weight.copy_(gate_up[I:])
        mlp.down_proj.weight.copy_(down)
        want = x + mlp(norm(x))
        got = mlp_chain_reference(x, norm_w, 1e-5, gate_up, down)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("K,I,kw", [(2048, 6144, {}), (2048, 6144, {"pf": 2}), (2048, 6144, {"l2_prefetch": True}),
                                    (2048, 6144, {"programs": 512, "pf": 2, "l2_prefetch": True}),
                                    (200, 1000, {"block_k": 128, "programs": 7}), (96, 130, {"block_n": 4})])
def test_chain_kernel_matches_reference_in_a_cuda_graph(K, I, kw):
    """Eager calls (the first reads the occupancy, later ones the full grid) and 6 layers chained in a CUDA graph,
    replayed twice (the barrier's generation word keeps counting across launches): each equals the reference on
    its own input to bf16 rounding."""
    from hylo_bench.kernels.gemv.chain import mlp_chain_triton

    layers = [_layer(K, I, torch.bfloat16, "cuda", seed=s) for s in range(6)]
    x0, nw0, gu0, dn0 = layers[0]
    for _ in range(2):
        got = mlp_chain_triton(x0, nw0, 1e-6, gu0, dn0, **kw)
        want = mlp_chain_reference(x0, nw0, 1e-6, gu0, dn0)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, err
    xbuf = x0.clone()
    outs = []

    def run():
        outs.clear()
        x = xbuf
        for _, nw, gu, dn in layers:
            x = mlp_chain_triton(x, nw, 1e-6, gu, dn, **kw)
            outs.append(x)

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    for scale in (1.0, -0.5):
        xbuf.copy_(x0 * scale)
        g.replay()
        torch.cuda.synchronize()
        x = xbuf
        for (_, nw, gu, dn), out in zip(layers, outs):
            want = mlp_chain_reference(x, nw, 1e-6, gu, dn)
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, err
            x = out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chain_kernel_refuses_more_than_one_row():
    from hylo_bench.kernels.gemv.chain import mlp_chain_triton

    x, nw, gu, dn = _layer(64, 96, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="one row"):
        mlp_chain_triton(torch.cat([x, x]), nw, 1e-6, gu, dn)
