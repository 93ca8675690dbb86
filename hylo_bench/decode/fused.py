"""Merged decode projections for the serving engine: the linears that read the same input become one GEMV.

At batch 1 a decode step is a chain of matrix-vector products, each bound by reading its weight. Many small
GEMVs waste bandwidth (each launch ramps up and drains) and add a kernel each. Serving engines therefore merge the
projections that share an input (vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``). The engine
merges, per layer:

- GDN: ``q_proj, k_proj, v_proj, a_proj, b_proj, g_proj`` (all read the normalised layer input);
- MLA: ``q_proj`` (or ``q_a_proj``) and ``kv_a_proj_with_mqa``;
- MLP: ``gate_proj`` and ``up_proj``.

With ``Engine(gemv_backend="triton")`` the decode step also folds the element-wise work around these GEMVs into
them (:func:`hylo_bench.kernels.gemv.fused_gemv`): the layer's RMSNorm into the first projections' prologue,
SwiGLU into ``down_proj``'s, the residual adds into ``o_proj`` / ``out_proj`` / ``down_proj``'s epilogues, the
final norm into the ``lm_head``'s (:class:`Prologue`, :func:`project`).

No weight is copied for good: :func:`merge_linears` concatenates the weights once and rebinds every original
``weight`` as a row view of the merged buffer, so the model keeps its values, its parameters and its memory size
(the originals are freed). Linears with a bias, or with different input sizes, dtypes or devices, are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, eq=False)
class Prologue:
    """How a decode step's fused GEMVs treat their input.

    Attributes:
        norm: the ``LlamaRMSNorm`` (``weight``, ``variance_epsilon``) the first GEMV applies to its input, or None
            (the input is already normalised).
        residual: [..., N] added to the output (the decoder layer's residual stream), or None.
        gate: [..., K] with ``norm`` a :class:`hylo_bench.models.gdn.GatedRMSNorm` (``weight`` [head_v_dim],
            ``eps``): GDN's output norm, per head and gated by ``silu(gate)``, in ``o_proj``'s prologue.
    """

    norm: nn.Module | None = None
    residual: torch.Tensor | None = None
    gate: torch.Tensor | None = None


def project(x: torch.Tensor, weight: torch.Tensor, fused: Prologue | None = None, glu: bool = False) -> torch.Tensor:
    """``x @ weight.T``; with ``fused`` (or ``glu``) through the Triton GEMV with ``fused.norm`` as prologue (or
    SwiGLU over x = [gate ; up]) and ``fused.residual`` as epilogue (:func:`hylo_bench.kernels.gemv.ops.fused_gemv_op`).
    x [..., K] (or [..., 2K]) -> [..., N]."""
    if fused is None and not glu:
        return F.linear(x, weight)
    from hylo_bench.kernels.gemv.ops import fused_gemv_op

    norm = fused.norm if fused is not None else None
    eps = 1e-6 if norm is None else getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    return fused_gemv_op(x, weight, norm_weight=None if norm is None else norm.weight, eps=eps, glu=glu,
                         residual=None if fused is None else fused.residual,
                         gate=None if fused is None else fused.gate)


@dataclass
class MergedLinear:
    """Weights of several linears with one input, stacked by output rows.

    Attributes:
        weight: [sum(out_i), D], the storage the original ``weight`` parameters now view.
        splits: out_i of each original linear, in order.
    """

    weight: torch.Tensor
    splits: tuple[int, ...]

    def __call__(self, x: torch.Tensor, norm: nn.Module | None = None) -> tuple[torch.Tensor, ...]:
        """x [..., D] -> one tensor [..., out_i] per original linear (views of one GEMM output). ``norm``: an
        ``LlamaRMSNorm`` not yet applied to x, fused into the Triton GEMV's prologue."""
        return self.project(x, norm).split(self.splits, dim=-1)

    def project(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """x [..., D] -> [..., sum(out_i)], the outputs side by side (``norm`` as in ``__call__``)."""
        return project(x, self.weight, None if norm is None else Prologue(norm))


def merge_linears(linears: list[nn.Linear]) -> MergedLinear | None:
    """Merge bias-free linears that share an input into one :class:`MergedLinear`, rebinding each ``weight``'s
    data as a view of its rows (values unchanged, no extra memory once the old storages are freed).

    Returns:
        The merged weight, or None (and nothing changed) when the linears cannot be merged: any bias, different
        ``in_features``, dtypes or devices, or fewer than two linears.
    """
    if len(linears) < 2:
        return None
    w0 = linears[0].weight
    if any(lin.bias is not None or lin.weight.shape[1] != w0.shape[1] or lin.weight.dtype != w0.dtype
           or lin.weight.device != w0.device for lin in linears):
        return None
    with torch.no_grad():
        merged = torch.cat([lin.weight.detach() for lin in linears], dim=0)
        row = 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight.data = merged[row:row + n]
            row += n
    return MergedLinear(merged, tuple(lin.weight.shape[0] for lin in linears))


def merge_mlp(mlp: nn.Module) -> MergedLinear | None:
    """``gate_proj`` + ``up_proj`` of a SwiGLU MLP (LlamaMLP layout: ``down(act(gate(x)) * up(x))``), or None."""
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return None
    return merge_linears([mlp.gate_proj, mlp.up_proj])


def mlp_forward(mlp: nn.Module, merged: MergedLinear | None, x: torch.Tensor) -> torch.Tensor:
    """The MLP on x [..., D] through the merged gate/up GEMV when there is one, else the module itself."""
    if merged is None:
        return mlp(x)
    gate, up = merged(x)
    return mlp.down_proj(mlp.act_fn(gate) * up)
