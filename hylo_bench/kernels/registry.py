"""One registry for every kernel back-end choice (as fla's ``ops/backends``): each choice point is a
:class:`KernelChoice` with its back ends in priority order, an availability rule (its ``select`` function: the
first back end that can run these arguments, and why), an environment override, and one log line per distinct
choice saying what runs.

Choice points (``CHOICES``): ``gdn`` (Gated DeltaNet chunked recurrence), ``ssd`` (Mamba-2 scan), ``mla_decode``
(absorbed MLA decode attention), ``gdn_decode`` (GDN single-token decode), ``gdn_prestep`` (GDN decode pre-step:
convolutions and gates), ``gdn_glue`` (the GDN mixer's multi-token short convolutions and gated norm),
``layer_glue`` (the decoder layers' RMSNorms, residual adds and SwiGLU in a prefill), ``gemv`` (the engine's fused
decode GEMVs), ``prefix_attention`` (chunked-prefill attention over a cached prefix: cuDNN split or SDPA).

Environment override: ``HYLO_BENCH_<NAME>_BACKEND`` (e.g. ``HYLO_BENCH_GDN_BACKEND=torch``) replaces what
``"auto"`` would pick for that choice point; it must name one of its back ends (else ValueError naming the
variable), and the pick is then checked as an explicit request would be (a back end that cannot run raises).
An explicit ``backend=`` argument other than ``"auto"`` is never overridden.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)
ENV_TEMPLATE = "HYLO_BENCH_{}_BACKEND"


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """One kernel choice point.

    Attributes:
        name: registry key (``gdn``, ``ssd``, ...); the override variable is ``HYLO_BENCH_<NAME>_BACKEND``.
        label: what the log line calls it (``"GDN backend"``).
        backends: the back ends in priority order (``"auto"`` not included).
        select: availability and priority: ``select(*args, **kwargs) -> (backend, reason)`` for ``"auto"``.
        describe: how a back end is named in the log line (default: its name).
    """

    name: str
    label: str
    backends: tuple[str, ...]
    select: Callable[..., tuple[str, str]]
    describe: Callable[[str], str] = str

    @property
    def env(self) -> str:
        return ENV_TEMPLATE.format(self.name.upper())

    def override(self) -> str | None:
        """The back end named by the environment override, or None when it is unset or empty.

        Raises:
            ValueError: the variable names no back end of this choice point.
        """
        value = os.environ.get(self.env, "").strip().lower()
        if not value or value == "auto":
            return None
        if value not in self.backends:
            raise ValueError(f"${self.env}={value!r}: expected auto or one of {', '.join(self.backends)}")
        return value

    def choose(self, *args, **kwargs) -> tuple[str, str]:
        """``(backend, reason)`` for ``"auto"``: the environment override, else ``select``'s pick."""
        forced = self.override()
        if forced is not None:
            return forced, f"${self.env}={forced}"
        return self.select(*args, **kwargs)

    def log(self, backend: str, reason: str) -> None:
        """One INFO line per distinct (choice point, back end, reason) in this process."""
        _log_once(self.label, self.describe(backend), reason)


@functools.cache
def _log_once(label: str, backend: str, reason: str) -> None:
    if reason:
        logger.info("%s: %s (%s)", label, backend, reason)
    else:
        logger.info("%s: %s", label, backend)


def triton_available() -> bool:
    """Whether Triton imports (it ships with CUDA / ROCm builds of torch, not with the CPU wheels)."""
    return importlib.util.find_spec("triton") is not None


def fla_installed() -> bool:
    """Whether flash-linear-attention is installed (``hylo-bench[gpu]``)."""
    return importlib.util.find_spec("fla") is not None


def fla_for_inference(device, dtype, needs_grad: bool) -> tuple[str, str]:
    """The availability rule of the inference-only fla glue choices (``gdn_glue``, ``layer_glue``): ``("fla",
    why)`` on CUDA for float32 / bfloat16 / float16 inputs when no gradient is needed and fla is installed, else
    ``("torch", why not)``. Training keeps the torch ops: its GPU checks and measured runs use them."""
    if device.type != "cuda":
        return "torch", f"device {device.type}"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "torch", f"{dtype} inputs"
    if needs_grad:
        return "torch", "a gradient is needed (training keeps the torch ops)"
    if not fla_installed():
        return "torch", "fla not installed"
    return "fla", "CUDA inference, fla installed"


@torch.compiler.disable  # environment probing and logging: plain Python, never traced
def _choose_and_log(choice: "KernelChoice", *args) -> str:
    backend, reason = choice.choose(*args)
    choice.log(backend, reason)
    return backend


def select_fla_glue_backend(choice: "KernelChoice", what: str, backend: str, device: torch.device,
                            dtype: torch.dtype, needs_grad: bool) -> str:
    """The back end of a torch / fla glue choice point (``gdn_glue``, ``layer_glue``): ``backend`` itself when
    explicit, else what ``choice`` picks by :func:`fla_for_inference` (and the environment override), logged once.
    "torch" returns before any probing, so a compiled step traces straight through.

    Args:
        what: how errors name the choice point ("GDN glue", "layer glue").

    Raises:
        ValueError: a backend other than "auto" or one of ``choice.backends``, or "fla" off CUDA.
        ImportError: "fla" without flash-linear-attention installed.
    """
    allowed = ("auto",) + choice.backends
    if backend not in allowed:
        raise ValueError(f"{what} backend {backend!r}; expected one of {allowed}")
    if backend == "torch":
        return backend
    if backend == "auto":
        backend = _choose_and_log(choice, device, dtype, needs_grad)
    if backend == "fla":
        if device.type != "cuda":
            raise ValueError(f"{what} backend 'fla' needs CUDA / ROCm tensors; got {device}. Use 'torch'.")
        if not fla_installed():
            raise ImportError(f"{what} backend 'fla' needs flash-linear-attention: pip install 'hylo-bench[gpu]'")
    return backend


CHOICES: dict[str, KernelChoice] = {}


def register(choice: KernelChoice) -> KernelChoice:
    """Add a choice point (module import time); returns it.

    Raises:
        ValueError: a choice point of that name is already registered with other back ends.
    """
    old = CHOICES.get(choice.name)
    if old is not None and old.backends != choice.backends:
        raise ValueError(f"kernel choice {choice.name!r} registered twice with different back ends")
    CHOICES[choice.name] = choice
    return choice


def clear_log() -> None:
    """Forget which choices were logged (tests check the line a fresh process writes)."""
    _log_once.cache_clear()
