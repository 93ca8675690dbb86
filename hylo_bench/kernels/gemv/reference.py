"""Decode GEMV with its neighbours fused, in plain torch: the ground truth for the Triton kernel and the path
``torch.compile`` traces (Inductor then fuses the element-wise parts itself).

One decode token per sequence makes every linear layer a matrix-vector product per row: ``y = W x`` reads all of
W once and is bound by memory bandwidth. The element-wise work around it (the RMSNorm before a layer's first
projections, SwiGLU before ``down_proj``, the residual add after ``o_proj`` / ``down_proj``) is tiny but costs a
kernel launch each; the fused form does it in the GEMV's prologue and epilogue.

Legend: M rows (sequences), K input features, N output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_gemv_inputs(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, glu: bool,
                      residual: torch.Tensor | None, gate: torch.Tensor | None = None) -> tuple[int, int, int]:
    """Validate shapes and dtypes; returns (M, N, K) with x viewed as [M, K] ([M, 2K] when ``glu``).

    Raises:
        ValueError: naming the argument, the expected and the received shape, or a weight / norm_weight / residual
            whose dtype is not x's (the result is in x's dtype on every back end).
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K]; got {tuple(weight.shape)}")
    N, K = weight.shape
    if norm_weight is not None and glu:
        raise ValueError("norm_weight and glu=True cannot be combined (one prologue per GEMV)")
    width = 2 * K if glu else K
    if x.shape[-1] != width:
        raise ValueError(f"x must be [..., {width}] ({'2K for glu' if glu else 'K'}, K = weight.shape[1] = {K}); "
                         f"got {tuple(x.shape)}")
    if gate is not None:
        if norm_weight is None or norm_weight.dim() != 1 or K % norm_weight.numel():
            raise ValueError(f"gate needs norm_weight [G] with G dividing K={K} (the group RMSNorm's weight); got "
                             f"{None if norm_weight is None else tuple(norm_weight.shape)}")
        if gate.shape != x.shape:
            raise ValueError(f"gate must have x's shape {tuple(x.shape)}; got {tuple(gate.shape)}")
    elif norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm_weight must be [K={K}]; got {tuple(norm_weight.shape)}")
    if residual is not None and residual.shape != (*x.shape[:-1], N):
        raise ValueError(f"residual must be {(*x.shape[:-1], N)} (x's leading dims, N); got {tuple(residual.shape)}")
    for name, t in (("weight", weight), ("norm_weight", norm_weight), ("residual", residual), ("gate", gate)):
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}; got {t.dtype}")
    return x.numel() // width, N, K


def fused_gemv_reference(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                         eps: float = 1e-6, glu: bool = False, residual: torch.Tensor | None = None,
                         gate: torch.Tensor | None = None) -> torch.Tensor:
    """``residual + prologue(x) @ weight.T`` with the rounding of the unfused modules.

    Args:
        x: [..., K] (``[..., 2K]`` = ``[gate ; up]`` when ``glu``), model dtype.
        weight: [N, K] (``nn.Linear`` layout).
        norm_weight: [K]: prologue ``LlamaRMSNorm``: ``w * (x / sqrt(mean(x^2) + eps))`` with the statistics in
            float32 (also for float64 x) and the normalised x rounded to x's dtype before the weight multiply (as
            transformers does).
        glu: prologue SwiGLU: ``silu(gate) * up`` (``LlamaMLP``'s ``act_fn(gate_proj(x)) * up_proj(x)``).
        residual: [..., N] added after the product (``h + o_proj(o)``).
        gate: [..., K] with norm_weight [G] (G dividing K): prologue = Gated DeltaNet's output norm
            (:class:`hylo_bench.models.gdn.GatedRMSNorm`): RMSNorm over each group of G features, times norm_weight
            and ``silu(gate)``, in float32 (float64 for float64 x), rounded once to x's dtype.

    Returns:
        [..., N] in x's dtype.

    Raises:
        ValueError: see :func:`check_gemv_inputs`.
    """
    check_gemv_inputs(x, weight, norm_weight, glu, residual, gate)
    if gate is not None:
        G = norm_weight.numel()
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        xg = x.to(dt).unflatten(-1, (-1, G))
        xg = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)
        x = (xg * norm_weight.to(dt) * F.silu(gate.to(dt).unflatten(-1, (-1, G)))).flatten(-2).to(x.dtype)
    elif norm_weight is not None:
        xf = x.to(torch.float32)  # float32 even for float64 x, as LlamaRMSNorm does
        x = norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    elif glu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x, weight)
    return y if residual is None else residual + y


def mlp_chain_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
                        down: torch.Tensor) -> torch.Tensor:
    """``x + down(silu(gate) * up)``, ``[gate ; up] = gate_up(LlamaRMSNorm(x))``, with the rounding of the two
    fused GEMVs the engine runs (:func:`fused_gemv_reference`); the contract of
    :func:`hylo_bench.kernels.gemv.chain.mlp_chain_triton`.

    Args:
        x: [..., K] residual stream (model dtype). norm_weight: [K]. gate_up: [2I, K] (gate rows first).
        down: [K, I].

    Returns:
        [..., K] in x's dtype.
    """
    h = fused_gemv_reference(x, gate_up, norm_weight=norm_weight, eps=eps)
    return fused_gemv_reference(h, down, glu=True, residual=x)
