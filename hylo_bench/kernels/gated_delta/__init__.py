"""Gated delta rule (Gated DeltaNet recurrence): one public entry with back ends, plus reference and step ops.

Back ends: "torch" (pure-torch chunked, any device, autograd) and "fla" (fla 0.6.0 ``chunk_gated_delta_rule``
on CUDA/ROCm, imported lazily). "auto" picks per call through the kernel registry (choice ``gdn``:
:func:`select_gdn_backend`, ``$HYLO_BENCH_GDN_BACKEND``; :mod:`hylo_bench.kernels.registry`) and logs each distinct
choice once.
State layout everywhere: [B, HV, K, V] K-first, float32 (float64 for float64 inputs on the torch paths).
"""

from __future__ import annotations

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
from hylo_bench.kernels.registry import KernelChoice, fla_installed, register, triton_available

__all__ = [
    "GDNEnvironment",
    "chunk_gated_delta_rule_torch",
    "fla_backward_refusal",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "gated_delta_rule_step",
    "probe_gdn_environment",
    "select_gdn_backend",
    "select_gdn_decode_backend",
    "select_prestep_backend",
]

BACKENDS = ("auto", "torch", "fla")
CHOICE = register(KernelChoice("gdn", "GDN backend", ("fla", "torch"), select_gdn_backend,
                               describe=lambda name: "torch chunked" if name == "torch" else "fla"))


@torch.compiler.disable  # environment probing and logging: plain Python, never traced
def _select_and_log(device: torch.device, needs_grad: bool, dtype: torch.dtype) -> str:
    backend, reason = CHOICE.choose(device, needs_grad, dtype=dtype)
    CHOICE.log(backend, reason)
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


GDN_DECODE_BACKENDS = ("auto", "torch", "fla", "triton")
PRESTEP_BACKENDS = ("auto", "torch", "triton")


def _auto_gdn_decode(device: torch.device, dtype: torch.dtype, conv_size: int = 4) -> tuple[str, str]:
    """GDN decode for "auto": triton on CUDA (non-float64, 4-tap convs) when Triton imports, else fla on CUDA when
    installed, else torch."""
    if device.type == "cuda" and dtype != torch.float64 and conv_size == 4 and triton_available():
        return "triton", "CUDA, 4-tap convs"
    if device.type == "cuda" and dtype != torch.float64 and fla_installed():
        return "fla", "CUDA, fla installed"
    return "torch", f"device {device.type}" if device.type != "cuda" else "float64, or neither Triton nor fla"


DECODE_CHOICE = register(KernelChoice("gdn_decode", "GDN decode backend", ("triton", "fla", "torch"),
                                      _auto_gdn_decode))


def select_gdn_decode_backend(device: torch.device, dtype: torch.dtype, backend: str, conv_size: int = 4) -> str:
    """The GDN decode back end: "triton" (the whole token, convolutions to output, in one kernel:
    :mod:`hylo_bench.kernels.gated_delta.decode_token_triton`), "fla" (fla's recurrent kernel after the pre-step) or
    "torch". "auto": triton on CUDA (non-float64, 4-tap convs) when Triton imports, else fla on CUDA when installed,
    else torch.

    Raises:
        ValueError: unknown backend; "fla" or "triton" requested off CUDA; "triton" for float64 or a conv width
            other than 4.
        ImportError: "fla" requested but not installed; "triton" requested but Triton does not import.
    """
    if backend not in GDN_DECODE_BACKENDS:
        raise ValueError(f"GDN decode backend {backend!r}; expected one of {GDN_DECODE_BACKENDS}")
    if backend == "auto":
        forced = DECODE_CHOICE.override()  # $HYLO_BENCH_GDN_DECODE_BACKEND: then checked as an explicit request
        if forced is None:
            return DECODE_CHOICE.select(device, dtype, conv_size)[0]
        backend = forced
    if backend in ("fla", "triton") and device.type != "cuda":
        raise ValueError(f"GDN decode backend {backend!r} needs CUDA; got {device}. Use 'torch'.")
    if backend == "triton":
        if dtype == torch.float64 or conv_size != 4:
            raise ValueError(f"GDN decode backend 'triton' serves 4-tap convs in float32 / bfloat16 / float16; got "
                             f"conv_size={conv_size}, {dtype} (use 'torch' or 'auto')")
        if not triton_available():
            raise ImportError("GDN decode backend 'triton' needs Triton (it ships with CUDA builds of torch)")
    if backend == "fla" and not fla_installed():
        raise ImportError("GDN decode backend 'fla' needs flash-linear-attention: pip install "
                          "'hylo-bench[gpu]' (or flash-linear-attention fla-core[cuda])")
    return backend


def _auto_prestep(device: torch.device, dtype: torch.dtype, conv_size: int) -> tuple[str, str]:
    if device.type == "cuda" and dtype != torch.float64 and triton_available() and conv_size == 4:
        return "triton", "CUDA, 4-tap convs"
    return "torch", "not CUDA, float64, no Triton or not 4-tap convs"


PRESTEP_CHOICE = register(KernelChoice("gdn_prestep", "GDN decode pre-step backend", ("triton", "torch"),
                                       _auto_prestep))


def select_prestep_backend(device: torch.device, dtype: torch.dtype, backend: str, conv_size: int,
                           check: bool = True) -> str:
    """GDN decode's convolutions + SiLU + gates (when the token kernel does not do them): "torch", "triton" (one
    kernel, CUDA, 4-tap convs) or "auto" (kernel registry choice ``gdn_prestep``: triton on CUDA when Triton imports,
    the convs have 4 taps and the weights are not float64, else torch).

    Args:
        check: validate an explicit "triton" request against the mixer (a GDN mixer; Mamba-2 has no pre-step).

    Raises:
        ValueError: unknown backend, or "triton" (with ``check``) off CUDA, in float64 or with another conv width.
    """
    if backend not in PRESTEP_BACKENDS:
        raise ValueError(f"prestep_backend={backend!r}; expected one of {PRESTEP_BACKENDS}")
    if backend == "auto":
        backend = PRESTEP_CHOICE.override() or PRESTEP_CHOICE.select(device, dtype, conv_size)[0]
    if backend == "triton" and check:
        if conv_size != 4 or dtype == torch.float64:
            raise ValueError(f"prestep_backend='triton' serves 4-tap convs in float32 / bfloat16 / float16; got "
                             f"conv_size={conv_size or None}, {dtype} (use 'torch' or 'auto')")
        if device.type != "cuda":
            raise ValueError(f"prestep_backend='triton' needs CUDA; the module is on {device}")
    return backend
