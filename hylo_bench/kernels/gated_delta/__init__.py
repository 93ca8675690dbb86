"""Gated delta rule (Gated DeltaNet recurrence): one public entry with back ends, plus reference and step ops.

Back ends: "torch" (pure-torch chunked, any device, autograd) and "fla" (fla 0.6.0 ``chunk_gated_delta_rule``
on CUDA/ROCm, imported lazily). "auto" picks per call and logs each distinct choice once.
State layout everywhere: [B, HV, K, V] K-first, float32 (float64 for float64 inputs on the torch paths).
"""

from __future__ import annotations

import functools
import logging

import torch

from hylo_bench.kernels.gated_delta.chunk import chunk_gated_delta_rule_torch, gated_delta_rule_step
from hylo_bench.kernels.gated_delta.fla_backend import (
    GDNEnvironment,
    fla_backward_refusal,
    fla_chunk_gated_delta_rule,
    probe_gdn_environment,
    select_gdn_backend,
)
from hylo_bench.kernels.gated_delta.reference import gated_delta_rule_reference

__all__ = [
    "GDNEnvironment",
    "chunk_gated_delta_rule_torch",
    "fla_backward_refusal",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "gated_delta_rule_step",
    "probe_gdn_environment",
    "select_gdn_backend",
]

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "torch", "fla")


@functools.cache
def _log_choice_once(name: str, reason: str) -> None:
    label = "torch chunked" if name == "torch" else "fla"
    logger.info("GDN backend: %s (%s)", label, reason)


@torch.compiler.disable  # environment probing and logging: plain Python, never traced
def _select_and_log(device: torch.device, needs_grad: bool, dtype: torch.dtype) -> str:
    backend, reason = select_gdn_backend(device, needs_grad, dtype=dtype)
    _log_choice_once(backend, reason)
    return backend


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over a whole sequence (prefill / training).

    Args:
        q, k: [B, T, H, K].
        v: [B, T, HV, V]; HV % H == 0.
        g: [B, T, HV] log-space decay (g <= 0), e.g. -exp(A_log) * softplus(a + dt_bias).
        beta: [B, T, HV] post-sigmoid write strength.
        scale: output scale; default K ** -0.5.
        initial_state: [B, HV, K, V] K-first state; zeros when None.
        output_final_state: also return the final state.
        use_qk_l2norm_in_kernel: l2-normalise q and k inside the op (eps 1e-6), as fla's flag.
        backend: "auto" (CPU or float64 -> torch; CUDA -> fla unless fla is missing or refuses a needed
            backward, see ``select_gdn_backend``), "torch" or "fla".
        cu_seqlens: [n_docs + 1] int document offsets of packed sequences (B must be 1, fla's convention): the
            state restarts at each document; ``initial_state`` / final state are then per document
            [n_docs, HV, K, V]. See ``hylo_bench.kernels.varlen``.

    Returns:
        o [B, T, HV, V] in q's dtype and the final state [B, HV, K, V] (float32) or None.

    Raises:
        ValueError: unknown backend, "fla" on non-CUDA tensors, or inconsistent shapes.
        ImportError: backend="fla" without fla installed.

    Reference:
        arXiv 2412.06464 (Gated DeltaNet); fla 0.6.0 ``fla/ops/gated_delta_rule/chunk.py``;
        kernels.md sec. 2, 4, 6.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)
        )
        backend = _select_and_log(q.device, needs_grad, q.dtype)
    kwargs = {
        "scale": scale,
        "initial_state": initial_state,
        "output_final_state": output_final_state,
        "use_qk_l2norm_in_kernel": use_qk_l2norm_in_kernel,
        "cu_seqlens": cu_seqlens,
    }
    if backend == "fla":
        if q.device.type != "cuda":
            raise ValueError(f"backend='fla' needs CUDA/ROCm tensors; got {q.device}. Use backend='torch'.")
        return fla_chunk_gated_delta_rule(q, k, v, g, beta, **kwargs)
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, **kwargs)
