"""The decoder layer's prefill glue (hylo_bench/kernels/layer_glue.py): back-end selection, the engine's wiring of
the fla path (checked on CPU with float64 stand-ins for fla's kernels), and on CUDA fla's kernels against the
modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hylo_bench.decode import engine as engine_mod
from hylo_bench.decode.engine import Engine
from hylo_bench.kernels import layer_glue, registry
from hylo_bench.kernels.layer_glue import add_rms_norm, rms_norm, select_layer_glue_backend, silu_mul
from hylo_bench.models.hybrid import HyLoForCausalLM
from tests.conftest import tiny_hybrid_config


def test_auto_is_torch_off_cuda_and_fla_is_refused_there(monkeypatch):
    monkeypatch.delenv(layer_glue.CHOICE.env, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert select_layer_glue_backend("auto", cpu, torch.bfloat16, False) == "torch"
    assert layer_glue.CHOICE.select(cuda, torch.bfloat16, True)[0] == "torch"  # training keeps the modules
    monkeypatch.setattr(registry, "fla_installed", lambda: True)
    assert layer_glue.CHOICE.select(cuda, torch.bfloat16, False) == ("fla", "CUDA inference, fla installed")
    with pytest.raises(ValueError, match="layer glue backend 'fla' needs CUDA / ROCm tensors; got cpu"):
        select_layer_glue_backend("fla", cpu, torch.float32, False)
    with pytest.raises(ValueError, match="expected one of"):
        select_layer_glue_backend("triton", cpu, torch.float32, False)


def test_the_engine_refuses_a_glue_backend_it_cannot_run():
    model = HyLoForCausalLM(tiny_hybrid_config()).eval()
    with pytest.raises(ValueError, match="layer glue backend 'fla' needs CUDA"):
        Engine(model, 1, 16, 4, layer_glue_backend="fla")
    with pytest.raises(ValueError, match="expected one of"):
        Engine(model, 1, 16, 4, layer_glue_backend="liger")


def _fla_like_rms(x, weight, eps):
    """fla's RMSNorm arithmetic: normalise and weight in float64 here, one rounding to x's dtype."""
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)


@pytest.mark.parametrize("merge", [True, False])
def test_engine_prefill_on_the_fla_path_equals_the_model_forward_in_float64(monkeypatch, merge, rms_float64):
    """The engine's fla branch (norm, fused residual add + norm, SwiGLU product, merged or separate gate/up) with
    float64 stand-ins for fla's kernels: prefill logits equal the model's forward."""
    calls: dict[str, int] = {"rms": 0, "add": 0, "silu": 0}

    def fake_rms(x, norm, backend):
        assert backend == "fla"
        calls["rms"] += 1
        return _fla_like_rms(x, norm.weight, norm.variance_epsilon)

    def fake_add(x, residual, norm, backend):
        calls["add"] += 1
        h = residual + x
        return _fla_like_rms(h, norm.weight, norm.variance_epsilon), h

    def fake_silu(gate, up, backend):
        calls["silu"] += 1
        return F.silu(gate) * up

    monkeypatch.setattr(engine_mod, "rms_norm", fake_rms)
    monkeypatch.setattr(engine_mod, "add_rms_norm", fake_add)
    monkeypatch.setattr(engine_mod, "silu_mul", fake_silu)
    monkeypatch.setattr(engine_mod, "select_layer_glue_backend", lambda *a: "fla")
    torch.manual_seed(0)
    model = HyLoForCausalLM(tiny_hybrid_config(use_qk_norm=True)).double().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.uniform_(0.5, 1.5)
    ids = torch.randint(3, 97, (2, 11))
    want = model(ids).logits[:, -1]
    eng = Engine(model, max_batch=2, max_context=16, prefill_chunk=4, merge_projections=merge)
    assert eng.layer_glue_backend == "auto"
    got = eng.prefill(ids)
    n_layers = len(model.model.layers)
    assert calls == {"rms": 3 * n_layers, "add": 3 * n_layers, "silu": 3 * n_layers}  # 3 chunks of 4, 4, 3
    assert torch.allclose(got, want, rtol=0, atol=1e-10 * want.abs().max().item())


def test_torch_back_end_is_the_modules_exactly():
    torch.manual_seed(1)
    norm = LlamaRMSNorm(32, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, r = torch.randn(2, 5, 32, dtype=torch.bfloat16), torch.randn(2, 5, 32, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(x, norm, "torch"), norm(x))
    y, h = add_rms_norm(x, r, norm, "torch")
    assert torch.equal(h, r + x) and torch.equal(y, norm(r + x))
    g, u = torch.randn(2, 5, 32, dtype=torch.bfloat16), torch.randn(2, 5, 32, dtype=torch.bfloat16)
    assert torch.equal(silu_mul(g, u, "torch"), F.silu(g) * u)


_CUDA_FLA = pytest.mark.skipif(not torch.cuda.is_available() or not registry.fla_installed(),
                               reason="needs CUDA + fla")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@_CUDA_FLA
def test_fla_glue_matches_float64_on_cuda():
    """fla's norm, fused add + norm and SwiGLU product on bf16 [2, 1000, 2048] against float64 arithmetic (and the
    modules' bf16 result, within the same distance)."""
    torch.manual_seed(2)
    dev = torch.device("cuda")
    norm = LlamaRMSNorm(2048, eps=1e-6).to(dev, torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 1000, 2048, device=dev, dtype=torch.bfloat16)
    r = torch.randn(2, 1000, 2048, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = _fla_like_rms(x, norm.weight, 1e-6).double()
        assert _rel(rms_norm(x, norm, "fla"), ref) < 4e-3
        y, h = add_rms_norm(x, r, norm, "fla")
        s = (r + x).float()
        assert (h.float() - s).abs().max() <= 2**-7 * s.abs().max()  # the bf16 sum, within one rounding
        h64 = r.double() + x.double()
        y64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
        assert _rel(y, y64) < 4e-3 and _rel(norm(r + x), y64) < 4e-3
        gu = torch.randn(2, 1000, 2 * 768, device=dev, dtype=torch.bfloat16)
        g, u = gu.split(768, dim=-1)  # row-strided halves of a merged gate/up output
        z64 = F.silu(g.double()) * u.double()
        assert _rel(silu_mul(g, u, "fla"), z64) < 4e-3


@pytest.mark.gpu
@_CUDA_FLA
def test_engine_prefill_with_fla_glue_matches_the_modules_on_cuda(monkeypatch):
    backends: list[str] = []
    real = engine_mod.rms_norm
    monkeypatch.setattr(engine_mod, "rms_norm", lambda x, norm, backend: backends.append(backend) or real(x, norm,
                                                                                                        backend))
    torch.manual_seed(3)
    model = HyLoForCausalLM(tiny_hybrid_config(use_qk_norm=True)).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, 97, (2, 300), device="cuda")
    fla = Engine(model, 2, 320, 128, layer_glue_backend="fla").prefill(ids)
    n = len(backends)
    ref = Engine(model, 2, 320, 128, layer_glue_backend="torch").prefill(ids)
    assert backends[:n] == ["fla"] * n and backends[n:] == ["torch"] * n and n == 3 * len(model.model.layers)
    assert _rel(fla, ref) < 2e-2  # bf16 rounding apart (the modules round twice per norm, fla once)
