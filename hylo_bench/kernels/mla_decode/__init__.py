"""Absorbed-weight MLA decode attention over the latent cache: one public entry with back ends.

Back ends: "torch" (:func:`mla_decode_reference`, any device) and "triton" (split-KV kernel, CUDA only,
imported lazily). "auto" picks triton on CUDA when Triton imports, torch otherwise, and logs each choice once
(kernel registry choice ``mla_decode``, ``$HYLO_BENCH_MLA_DECODE_BACKEND``).
Math: checkpoint-format.md §6 (absorbed query q_lat = W_UK^T q_nope, latent output times W_UV afterwards).
"""

from __future__ import annotations

import functools

import torch

from hylo_bench.kernels.mla_decode.reference import check_decode_inputs, mla_decode_reference
from hylo_bench.kernels.registry import KernelChoice, register, triton_available

__all__ = ["mla_decode", "mla_decode_reference", "select_mla_decode_backend"]

BACKENDS = ("auto", "torch", "triton")
TRITON_HINT = "install Triton (it comes with the CUDA build of torch: pip install torch --index-url ...cu1xx)"


@functools.cache
def select_mla_decode_backend(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """("torch" | "triton", reason) for backend="auto" (cached: called per layer and decode step)."""
    if device.type != "cuda":
        return "torch", f"device {device.type}"
    if dtype == torch.float64:
        return "torch", "float64 inputs"
    if not triton_available():
        return "torch", "triton not installed"
    return "triton", "CUDA"


CHOICE = register(KernelChoice("mla_decode", "MLA decode backend", ("triton", "torch"), select_mla_decode_backend))


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, *,
               scale: float, key_scale: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Latent attention output [B, H, R] (float32; float64 for float64 inputs) of one decode token per sequence.

    Args: see :func:`mla_decode_reference` (q_lat [B, H, R], q_rope [B, H, P], cache [B, T, R + P],
        lengths [B] int on the cache's device, scale, key_scale [B, T, G] or None); backend "auto", "torch" or
        "triton".

    Raises:
        ValueError: unknown backend, "triton" on a non-CUDA tensor, inconsistent shapes.
        ImportError: backend="triton" without Triton.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    check_decode_inputs(q_lat, q_rope, cache, lengths, key_scale)
    if backend == "auto":
        backend, reason = CHOICE.choose(cache.device, q_lat.dtype)
        CHOICE.log(backend, reason)
    if backend == "triton":
        if cache.device.type != "cuda":
            raise ValueError(f"backend='triton' needs CUDA tensors; got {cache.device}. Use backend='torch'.")
        try:
            from hylo_bench.kernels.mla_decode.triton_kernel import mla_decode_triton
        except ImportError as err:
            raise ImportError(f"MLA decode backend 'triton' needs Triton: {TRITON_HINT}") from err
        return mla_decode_triton(q_lat, q_rope, cache, lengths, scale, key_scale)
    return mla_decode_reference(q_lat, q_rope, cache, lengths, scale, key_scale)
