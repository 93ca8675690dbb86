"""The internal precision rule shared by the recurrent-scan kernels (gated delta rule, Mamba-2 SSD)."""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 for every other float dtype (the ops' internal precision)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
