"""fla back end of the gated delta rule: environment probe, back-end choice (fla issue #640), and the fla call.

Nothing here imports fla or triton at module load; versions are read from package metadata and fla is imported
inside ``fla_chunk_gated_delta_rule`` only. The #640 guard inside fla is never patched or bypassed: when fla
would refuse the backward, ``select_gdn_backend`` picks the torch chunked path instead.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch
from packaging.version import InvalidVersion, Version

from hylo_bench.kernels.gated_delta._common import check_inputs
from hylo_bench.kernels.registry import fla_installed

logger = logging.getLogger(__name__)

FLA_EXTRA_HINT = "pip install 'hylo-bench[gpu]' (flash-linear-attention 0.6.x)"
_TRITON_BAD_MIN = Version("3.4.0")
_TRITON_FIXED = Version("3.7.1")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GDNEnvironment:
    """What decides whether fla's GDN kernels may run on one CUDA/ROCm device.

    Attributes:
        fla_version: installed fla-core / flash-linear-attention version, None when ``fla`` is not importable.
        triton_version: installed triton version, None when absent.
        is_nvidia: True on an NVIDIA GPU, False on ROCm (HIP) builds.
        capability: CUDA compute capability (major, minor), e.g. (9, 0) for H100/H200.
        device_name: e.g. "NVIDIA H200".
        tilelang_usable: TileLang importable, enabled (FLA_TILELANG != 0, backend dispatch not disabled) and an
            nvcc binary found, i.e. fla 0.6.0 would route the #640 kernel to TileLang.
    """

    fla_version: str | None
    triton_version: str | None
    is_nvidia: bool
    capability: tuple[int, int]
    device_name: str
    tilelang_usable: bool


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _has_nvcc() -> bool:
    # same places fla 0.6.0 ``fla.utils.has_usable_nvcc`` looks (TileLang JIT needs a real nvcc binary)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return True
    if shutil.which("nvcc"):
        return True
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    if any(f.name == "nvcc" for f in files):
        return True
    return (Path("/usr/local/cuda") / "bin" / "nvcc").exists()


def probe_gdn_environment(device: torch.device) -> GDNEnvironment:
    """Read versions, capability and TileLang availability for a CUDA/ROCm ``device`` (no fla import)."""
    fla_present = fla_installed()
    tilelang_usable = (
        importlib.util.find_spec("tilelang") is not None
        and os.environ.get("FLA_TILELANG", "1") != "0"
        and os.environ.get("FLA_DISABLE_BACKEND_DISPATCH", "0") != "1"
        and _has_nvcc()
    )
    return GDNEnvironment(
        fla_version=(_dist_version("fla-core", "flash-linear-attention") or "unknown") if fla_present else None,
        triton_version=_dist_version("triton", "pytorch-triton-rocm", "pytorch-triton"),
        is_nvidia=torch.version.hip is None,
        capability=tuple(torch.cuda.get_device_capability(device)),
        device_name=torch.cuda.get_device_name(device),
        tilelang_usable=tilelang_usable,
    )


@functools.cache
def _cached_probe(device_type: str, index: int | None) -> GDNEnvironment:
    return probe_gdn_environment(torch.device(device_type, index))


def _parse(version: str | None) -> Version | None:
    if version is None:
        return None
    try:
        return Version(version.split("+")[0])
    except InvalidVersion:
        return None


def fla_backward_refusal(env: GDNEnvironment) -> str | None:
    """Why fla 0.6.0 would raise in the GDN backward on this device (fla issue #640), or None if it would not.

    Mirrors fla 0.6.0 exactly: the guard in ``fla/ops/common/chunk_o.py::chunk_bwd_dqkwg`` fires on NVIDIA
    Hopper (``fla.utils.IS_NVIDIA_HOPPER``: capability major == 9 or an "NVIDIA H" device name) with
    3.4.0 <= triton < 3.7.1, unless the TileLang back end takes that kernel (``CommonTileLangBackend``:
    tilelang importable, FLA_TILELANG not "0", dispatch not disabled, nvcc found).
    """
    if not env.is_nvidia:
        return None
    hopper = env.capability[0] == 9 or "NVIDIA H" in env.device_name
    triton = _parse(env.triton_version)
    if not hopper or triton is None or not (_TRITON_BAD_MIN <= triton < _TRITON_FIXED):
        return None
    if env.tilelang_usable:
        return None
    cap = f"{env.capability[0]}.{env.capability[1]}"
    return (
        f"fla {env.fla_version} refuses GDN backward on Hopper ({env.device_name}, capability {cap}) with triton "
        f"{env.triton_version} < 3.7.1 and TileLang is not usable (not installed, FLA_TILELANG=0, or no nvcc); "
        "fla issue #640"
    )


def select_gdn_backend(
    device: torch.device | str,
    needs_grad: bool,
    *,
    dtype: torch.dtype | None = None,
    env: GDNEnvironment | None = None,
) -> tuple[str, str]:
    """Choose the GDN kernel back end for tensors on ``device``.

    Args:
        device: where the tensors live.
        needs_grad: whether the call must support a backward pass.
        dtype: dtype of q/k/v if known; fla's Triton kernels do not compile for float64 (torch is picked).
        env: environment to decide on; probed (and cached per device) when None. Tests pass a fake one.

    Returns:
        (name, reason): name is "torch" (pure-torch chunked) or "fla" (fla ``chunk_gated_delta_rule``);
        reason is a one-line human explanation suitable for a log line.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "torch", f"tensors on {device.type}; fla kernels are only wired for CUDA/ROCm"
    if dtype == torch.float64:
        return "torch", "float64 inputs; fla kernels take fp16/bf16/fp32"
    if env is None:
        env = _cached_probe(device.type, device.index)
    if env.fla_version is None:
        return "torch", f"fla is not installed ({FLA_EXTRA_HINT})"
    if needs_grad:
        refusal = fla_backward_refusal(env)
        if refusal is not None:
            return "torch", refusal
    mode = "fwd+bwd" if needs_grad else "fwd"
    via = ""
    if needs_grad and env.is_nvidia and env.tilelang_usable and fla_backward_refusal(
            dataclasses.replace(env, tilelang_usable=False)) is not None:
        via = "; backward's chunk_bwd_dqkwg on TileLang (fla #640 workaround)"
    return "fla", f"fla {env.fla_version} chunk_gated_delta_rule ({mode}, triton {env.triton_version}{via})"


@torch.compiler.disable  # fla's autotuned Triton / TileLang kernels run as they are; torch.compile breaks around them
def fla_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Call fla's ``chunk_gated_delta_rule`` with hylo-bench's op contract.

    g is passed as float32 log decay and beta as post-sigmoid values in q's dtype (fla's defaults
    ``use_gate_in_kernel=False``, ``use_beta_sigmoid_in_kernel=False``; the dtypes transformers' Qwen3-Next
    passes to the same kernel); the state stays K-first
    ([B, HV, K, V], fla's default ``state_v_first=False``), so no transpose is needed.

    Args:
        q, k: [B, T, H, K] bf16/fp16 on a CUDA/ROCm device; K <= 256.
        v: [B, T, HV, V] same dtype.
        g: [B, T, HV] log decay (any float dtype; cast to float32).
        beta: [B, T, HV] post-sigmoid (cast to q's dtype).
        scale: default K ** -0.5.
        initial_state: [B, HV, K, V], cast to float32.
        output_final_state: return the float32 final state.
        use_qk_l2norm_in_kernel: forwarded to fla.
        cu_seqlens: packed-document offsets [n_docs + 1] (B = 1), passed to fla as int64; ``initial_state`` is
            then [n_docs, HV, K, V].

    Returns:
        o [B, T, HV, V] in q's dtype and the final state [B, HV, K, V] float32 or None.

    Raises:
        ValueError: on inconsistent shapes (e.g. a V-first state).
        ImportError: when fla is not installed (names the extra to install).
        RuntimeError: from fla itself, e.g. its #640 guard in the backward; never bypassed here.

    Reference:
        fla 0.6.0 ``fla/ops/gated_delta_rule/chunk.py::chunk_gated_delta_rule``; kernels.md sec. 4.1.
    """
    check_inputs(q, k, v, g, beta, None if cu_seqlens is not None else initial_state)
    if cu_seqlens is not None:
        from hylo_bench.kernels.varlen import check_cu_seqlens

        check_cu_seqlens(cu_seqlens, q.shape[1])
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens needs batch size 1 (fla varlen); got {q.shape[0]}")
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.long)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as err:
        raise ImportError(f"GDN backend 'fla' needs flash-linear-attention: {FLA_EXTRA_HINT}") from err
    if initial_state is not None:
        initial_state = initial_state.float()
    cu_seqlens_cpu = None
    if cu_seqlens is None and intracard_split(q):
        cu_seqlens, cu_seqlens_cpu = _whole_sequence_offsets(q.shape[1], q.device)
    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g.float(),
        beta.to(q.dtype),
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )


INTRACARD_ENV = "FLA_INTRACARD_CP"
INTRACARD_MIN_TOKENS = 3 * 8192
"""fla 0.6.0 splits a sequence only from three parts of at least 128 chunks of 64 tokens on
(``compute_subseq_len``, ``prepare_subseq_cu_seqlens``); shorter calls keep the plain path."""


def intracard_split(q: torch.Tensor) -> bool:
    """Whether this call goes through fla's intra-card context-parallel state pass
    (``fla/ops/common/backends/intracard.py``): one sequence (B = 1) of at least :data:`INTRACARD_MIN_TOKENS`
    tokens under ``torch.inference_mode()``, with fla's own opt-in ``$FLA_INTRACARD_CP`` set. fla applies it only to
    variable-length calls, so such a call is passed as one document (``cu_seqlens = [0, T]``): the sequential
    state pass over T / 64 chunks then runs as several sub-sequences side by side, merged by their affine state
    maps, instead of one program per (head, value block) walking all chunks (6 heads x 8 blocks = 48 programs on
    132 SMs for the Qwen 7MLA21GDN layout)."""
    return (q.shape[0] == 1 and q.shape[1] >= INTRACARD_MIN_TOKENS and torch.is_inference_mode_enabled()
            and os.environ.get(INTRACARD_ENV, "0") != "0")


@functools.lru_cache(maxsize=64)
def _whole_sequence_offsets(T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens = [0, T]`` on ``device`` and on the host, kept for the 64 most recent (T, device): fla caches
    its split plan by the tensor's identity (a prompt's full chunks share one T)."""
    host = torch.tensor([0, T], dtype=torch.long)
    return host.to(device), host
