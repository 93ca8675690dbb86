"""The GDN mixer's multi-token glue around the recurrence: the causal short convolution + SiLU (continuing from
cached inputs) and the gated RMSNorm, each as a torch reference and fla 0.6.0's Triton kernel (kernels.md §3.7).

Why fla here: in torch the convolution runs as a transposed ``cat`` of cache and inputs, cuDNN's generic depthwise
kernel, a SiLU pass and a copy back to [B, T, C] (about 220 ms of a 1.12 s 64K prefill of the 7MLA21GDN on the
H200, ``benchmarks/results/prefill_profile.json``), and the norm as six float32 passes; fla does each in one pass
over [B, T, C].

Back ends (kernel registry choice ``gdn_glue``, ``$HYLO_BENCH_GDN_GLUE_BACKEND``): ``"torch"`` (any device,
autograd) and ``"fla"`` (CUDA / ROCm, fla installed). ``"auto"`` picks fla on CUDA for float32 / bfloat16 / float16
inputs when no gradient is needed (prefill and evaluation), torch otherwise: the training paths' GPU checks and
measured runs use the torch ops, so switching them is a separate, measured change.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylo_bench.kernels.registry import KernelChoice, fla_for_inference, register, select_fla_glue_backend

__all__ = ["gated_rms_norm", "gated_rms_norm_torch", "select_glue_backend", "short_conv", "short_conv_torch"]

CHOICE = register(KernelChoice("gdn_glue", "GDN conv / gated-norm backend", ("fla", "torch"), fla_for_inference))


def select_glue_backend(backend: str, device: torch.device, dtype: torch.dtype, needs_grad: bool) -> str:
    """The back end for :func:`short_conv` / :func:`gated_rms_norm` ("auto" resolved through the registry;
    :func:`hylo_bench.kernels.registry.select_fla_glue_backend`).

    Raises:
        ValueError: unknown backend, or "fla" off CUDA.
        ImportError: "fla" without flash-linear-attention installed.
    """
    return select_fla_glue_backend(CHOICE, "GDN glue", backend, device, dtype, needs_grad)


def _needs_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def short_conv_torch(x_BTC: torch.Tensor, weight_CW: torch.Tensor,
                     cache_BCW: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution + SiLU continuing from cached inputs, in plain torch (the reference).

    Args:
        x_BTC: [B, T, C] pre-convolution inputs of this call.
        weight_CW: [C, W] taps; output t is ``sum_j w[:, j] * x[t - W + 1 + j]``.
        cache_BCW: [B, C, W - 1] inputs of the W - 1 tokens before this call, or None (zeros: sequence start).

    Returns:
        (SiLU(conv) [B, T, C] in x's dtype, new cache [B, C, W - 1]: the last W - 1 inputs of cache + this call).
    """
    B, _T, C = x_BTC.shape
    W1 = weight_CW.shape[1] - 1
    x_BCT = x_BTC.transpose(1, 2)
    if cache_BCW is None:
        cache_BCW = x_BCT.new_zeros(B, C, W1)
    xx_BCL = torch.cat([cache_BCW.to(x_BCT.dtype), x_BCT], dim=-1)  # L = W - 1 + T
    y_BCT = F.conv1d(xx_BCL, weight_CW.to(x_BCT.dtype)[:, None], groups=C)
    return F.silu(y_BCT).transpose(1, 2), xx_BCL[..., xx_BCL.shape[-1] - W1:]


def _short_conv_fla(x_BTC, weight_CW, cache_BCW):
    from fla.modules.causal_conv1d import causal_conv1d

    # fla's state is [B, C, W] with the newest input last and its first column unread: pad ours in front, and
    # keep the last W - 1 of the state it returns. fla reads x through its strides (a column slice of a merged
    # projection's output, "QKV-style views"), so only a non-unit channel stride needs a copy.
    init = None if cache_BCW is None else F.pad(cache_BCW.to(x_BTC.dtype), (1, 0))
    x = x_BTC if x_BTC.stride(-1) == 1 else x_BTC.contiguous()
    y, final = causal_conv1d(x, weight=weight_CW.to(x_BTC.dtype), initial_state=init,
                             output_final_state=True, activation="silu", backend="triton")
    return y, final[..., 1:]


def short_conv(x_BTC: torch.Tensor, weight_CW: torch.Tensor, cache_BCW: torch.Tensor | None,
               backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`short_conv_torch` on the chosen back end ("auto", "torch", "fla"; module docstring). Same shapes and
    results up to rounding; the fla output is contiguous [B, T, C].

    Raises:
        ValueError / ImportError: as :func:`select_glue_backend`.
    """
    backend = select_glue_backend(backend, x_BTC.device, x_BTC.dtype, _needs_grad(x_BTC, weight_CW, cache_BCW))
    if backend == "fla":
        return _short_conv_fla(x_BTC, weight_CW, cache_BCW)
    return short_conv_torch(x_BTC, weight_CW, cache_BCW)


def gated_rms_norm_torch(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(o) * weight * silu(gate)`` over the last dim, in float32 (float64 for float64 inputs), returned in
    o's dtype. o, gate: [..., Vd]; weight: [Vd]. Reference: fla 0.6.0 ``FusedRMSNormGated`` (activation "swish")."""
    dt = torch.float64 if o.dtype == torch.float64 else torch.float32
    x = o.to(dt)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x * weight.to(dt) * F.silu(gate.to(dt))).to(o.dtype)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   backend: str = "auto") -> torch.Tensor:
    """:func:`gated_rms_norm_torch` on the chosen back end (fla: ``fla.modules.norm.fused_norm_gate.rms_norm_gated``,
    one pass, float32 inside). Shapes as the reference.

    Raises:
        ValueError / ImportError: as :func:`select_glue_backend`.
    """
    backend = select_glue_backend(backend, o.device, o.dtype, _needs_grad(o, gate, weight))
    if backend == "fla":
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        return rms_norm_gated(o, gate.to(o.dtype), weight, None, activation="swish", eps=eps)
    return gated_rms_norm_torch(o, gate, weight, eps)
