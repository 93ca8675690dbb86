"""The decoder layer's element-wise glue in a multi-token forward (the engine's prefill): RMSNorm, the residual
add fused into the norm that follows it, and SwiGLU, each as torch and as fla 0.6.0's Triton kernels (kernels.md
§3.8).

Why fla here: transformers' ``LlamaRMSNorm`` runs as five or six passes with float32 intermediates (cast, square,
mean, scale, cast back, weight), about 4.8 GB of memory traffic per norm on a 64K-token [T, 2048] bf16 input, and
SwiGLU as two passes; in a 64K prefill of the 7MLA21GDN on the H200 the element-wise kernels were 0.24 of 0.86 s
(``benchmarks/results/prefill_profile_glue.json``). fla's ``rms_norm`` reads the input (and the residual) once and
writes the normalised output (and the sum) once; ``swiglu`` reads gate and up once.

Results differ from the torch path by rounding only: ``LlamaRMSNorm`` rounds the normalised input to the input dtype
before the weight multiply, fla multiplies in float32 and rounds once; with a residual, fla normalises the float32
sum and stores it rounded, torch rounds the sum first.

Back ends (kernel registry choice ``layer_glue``, ``$HYLO_BENCH_LAYER_GLUE_BACKEND``): ``"torch"`` (the modules
themselves: any device, autograd) and ``"fla"`` (CUDA / ROCm, fla installed); ``"auto"`` is
:func:`hylo_bench.kernels.registry.fla_for_inference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylo_bench.kernels.registry import KernelChoice, fla_for_inference, register, select_fla_glue_backend

__all__ = ["CHOICE", "add_rms_norm", "rms_norm", "select_layer_glue_backend", "silu_mul"]

CHOICE = register(KernelChoice("layer_glue", "decoder-layer norm / SwiGLU backend", ("fla", "torch"),
                               fla_for_inference))


def select_layer_glue_backend(backend: str, device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str:
    """The back end for :func:`rms_norm` / :func:`add_rms_norm` / :func:`silu_mul` ("auto" resolved through the
    registry, logged once per distinct choice; :func:`hylo_bench.kernels.registry.select_fla_glue_backend`).

    Raises:
        ValueError: unknown backend, or "fla" off CUDA.
        ImportError: "fla" without flash-linear-attention installed.
    """
    return select_fla_glue_backend(CHOICE, "layer glue", backend, device, dtype, needs_grad)


def rms_norm(x: torch.Tensor, norm: torch.nn.Module, backend: str) -> torch.Tensor:
    """``norm(x)`` for a ``LlamaRMSNorm``-style module (``weight`` [D], ``variance_epsilon``) on a resolved back
    end ("torch" or "fla", :func:`select_layer_glue_backend`). x: [..., D]; returns [..., D] in x's dtype."""
    if backend == "torch":
        return norm(x)
    from fla.modules.norm.layernorm import rms_norm as fla_rms_norm

    return fla_rms_norm(x, norm.weight, None, eps=norm.variance_epsilon)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module,
                 backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: ``h = residual + x`` and ``norm(h)``, returned as ``(norm(h), h)``.

    Args:
        x: [..., D] the sublayer's output. residual: [..., D] the residual stream, x's dtype.
        norm: a ``LlamaRMSNorm``-style module. backend: "torch" or "fla" (resolved).

    Returns:
        (normalised [..., D], new residual [..., D]), both in x's dtype.
    """
    if backend == "torch":
        h = residual + x
        return norm(h), h
    from fla.modules.norm.layernorm import rms_norm as fla_rms_norm

    return fla_rms_norm(x, norm.weight, None, residual=residual, eps=norm.variance_epsilon, prenorm=True)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, backend: str) -> torch.Tensor:
    """SwiGLU's product ``silu(gate) * up`` (gate, up: [..., I], last dim contiguous, e.g. the two halves of a
    merged gate/up projection) on a resolved back end ("torch" or "fla": ``fla.modules.activations.swiglu``, float32
    inside, one rounding)."""
    if backend == "torch":
        return F.silu(gate) * up
    from fla.modules.activations import swiglu

    return swiglu(gate, up)
