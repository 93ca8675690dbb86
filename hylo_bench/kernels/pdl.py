"""Programmatic dependent launch (PDL) for our Triton decode kernels: whether to use it on a device.

With PDL (CUDA, compute capability >= 9.0) a kernel may start while the kernel before it in the stream is still
running. It reads what does not depend on that kernel (constant weights) first, then waits for it with
``tl.extra.cuda.gdc_wait()`` (which also makes its writes visible), and lets the next PDL kernel start with
``gdc_launch_dependents()``. A decode step is a chain of short, bandwidth-bound kernels, so each one's launch
latency and its first weight loads hide behind the previous one's tail. Inside a CUDA graph the dependency
becomes a programmatic edge. Reference: the CUDA programming guide, "Programmatic Dependent Launch and
Synchronization"; Triton's tutorial 11 (``launch_pdl=True``).
"""

from __future__ import annotations

import torch

# "auto": on where supported; False: never (benchmarks compare); True: same as "auto" (never on unsupported devices)
MODE: bool | str = "auto"
_OK: dict[int, bool] = {}


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL: ``MODE`` allows it, the device is an NVIDIA GPU of compute
    capability >= 9 (not ROCm) and this Triton has grid dependency control (``triton.language.extra.cuda.gdc_wait``,
    Triton >= 3.4)."""
    if MODE is not True and MODE != "auto":
        return False
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _OK:
        try:
            from triton.language.extra.cuda import gdc_wait  # noqa: F401
            ok = torch.cuda.get_device_capability(idx)[0] >= 9
        except ImportError:
            ok = False
        _OK[idx] = ok
    return _OK[idx]
