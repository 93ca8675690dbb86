"""GDN and Mamba-2 mixers over preallocated states, for the serving engine: chunked prefill through the module's
own forward (fla chunk kernels on CUDA, torch on CPU) and single-token decode (GDN: fla's fused recurrent kernel
on CUDA when installed, the torch step otherwise; Mamba-2: the module's torch step). States are updated in place,
so their addresses never change (CUDA graphs).

Legend: B batch, T tokens, D hidden, H heads, K / Vd GDN key / value head dims, C conv channels, W conv width.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F

from hylo_bench.models.cache import map_state
from hylo_bench.serving.fused import Prologue, merge_linears, project
from hylo_bench.serving.ops import gdn_decode_step

logger = logging.getLogger(__name__)
GDN_DECODE_BACKENDS = ("auto", "torch", "fla")


@functools.cache
def _log_once(msg: str) -> None:
    logger.info(msg)


def _copy_state(dst, src) -> None:
    """Copy every tensor of state dataclass ``src`` into the same field of ``dst`` (in place)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    map_state(src, lambda t: pairs.append(t) or t)
    targets: list[torch.Tensor] = []
    map_state(dst, lambda t: targets.append(t) or t)
    for d, s in zip(targets, pairs):
        d.copy_(s)


def select_gdn_decode_backend(device: torch.device, dtype: torch.dtype, backend: str) -> str:
    """"fla" on CUDA (non-float64) when fla is installed and ``backend`` allows it, else "torch".

    Raises:
        ValueError: unknown backend, or "fla" requested on a non-CUDA device.
        ImportError: "fla" requested but not installed.
    """
    if backend not in GDN_DECODE_BACKENDS:
        raise ValueError(f"GDN decode backend {backend!r}; expected one of {GDN_DECODE_BACKENDS}")
    fla_ok = importlib.util.find_spec("fla") is not None
    if backend == "fla":
        if device.type != "cuda":
            raise ValueError(f"GDN decode backend 'fla' needs CUDA; got {device}. Use 'torch'.")
        if not fla_ok:
            raise ImportError("GDN decode backend 'fla' needs flash-linear-attention: pip install "
                              "'hylo-bench[gpu]' (or flash-linear-attention fla-core[cuda])")
        return "fla"
    if backend == "auto" and device.type == "cuda" and dtype != torch.float64 and fla_ok:
        return "fla"
    return "torch"


class LinearServing:
    """Prefill / decode of one GDN (``hylo_bench.models.gdn.GatedDeltaNet``) or Mamba-2 mixer over a
    preallocated state (``GDNState`` / ``Mamba2State``, from the module's ``empty_state``).

    Args:
        module: the mixer. kind: "gdn" or "mamba". gdn_decode_backend: "auto", "torch" or "fla".
        merge_projections: GDN decode reads q/k/v/a/b/g projections with one GEMV
            (:func:`hylo_bench.serving.fused.merge_linears`; rebinds the module's weights as views, values unchanged).
    """

    def __init__(self, module, kind: str, gdn_decode_backend: str = "auto", merge_projections: bool = False):
        self.m, self.kind = module, kind
        self.merged = None
        if kind == "gdn" and merge_projections:
            m = module
            self.merged = merge_linears([m.q_proj, m.k_proj, m.v_proj, m.a_proj, m.b_proj, m.g_proj])
        w = next(module.parameters())
        self.gdn_backend = select_gdn_decode_backend(w.device, w.dtype, gdn_decode_backend) if kind == "gdn" \
            else "torch"
        if kind == "gdn":
            _log_once(f"GDN decode backend: {self.gdn_backend}")

    def new_state(self, batch: int):
        """Zero state for ``batch`` sequences (float64 recurrent state for float64 models, else the module's)."""
        state = self.m.empty_state(batch)
        if next(self.m.parameters()).dtype == torch.float64:
            state = map_state(state, lambda t: t.double())
        return state

    def prefill(self, x: torch.Tensor, state) -> torch.Tensor:
        """x [B, T, D] continuing ``state`` (updated in place) -> [B, T, D]."""
        out, new = self.m(x, state=state, use_cache=True)
        _copy_state(state, new)
        return out

    def decode(self, x: torch.Tensor, state, fused: Prologue | None = None) -> torch.Tensor:
        """x [B, 1, D] -> [B, 1, D]; ``state`` updated in place. No host synchronisation.

        ``fused`` (GDN with merged projections only): with ``fused.norm`` x is the residual stream, normalised in the
        merged GEMV's prologue; with ``fused.residual`` ``o_proj`` adds it (:mod:`hylo_bench.serving.fused`).

        Raises:
            ValueError: ``fused`` for a Mamba-2 mixer or without merged projections.
        """
        if self.kind == "gdn":
            return self._gdn_decode(x, state, fused)
        if fused is not None:
            raise ValueError("fused decode GEMVs serve GDN mixers with merged projections only")
        out, new = self.m(x, state=state, use_cache=True)
        _copy_state(state, new)
        return out

    def _gdn_decode(self, x: torch.Tensor, state, fused: Prologue | None = None) -> torch.Tensor:
        """The T == 1 path of ``GatedDeltaNet.forward`` with the recurrence on the selected back end.

        The 4-tap depthwise conv is written as a multiply-sum in float32 (float64 for float64 models), rounded to
        the model dtype before the SiLU as ``F.conv1d`` would, so ``torch.compile`` fuses it with its neighbours.
        """
        m = self.m
        B = x.shape[0]
        H, K, Vd = m.num_heads, m.head_k_dim, m.head_v_dim
        if fused is not None and self.merged is None:
            raise ValueError("fused decode GEMVs need merged projections (LinearServing(merge_projections=True))")
        if self.merged is not None:
            q_in, k_in, v_in, a_in, b_in, gate = self.merged(x, None if fused is None else fused.norm)
        else:
            q_in, k_in, v_in, a_in, b_in, gate = (p(x) for p in (m.q_proj, m.k_proj, m.v_proj, m.a_proj, m.b_proj,
                                                                  m.g_proj))
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        acts = []
        for inp, conv, cache in zip((q_in, k_in, v_in), (m.q_conv1d, m.k_conv1d, m.v_conv1d), state.conv):
            xx_BCW = torch.cat([cache.to(x.dtype), inp.transpose(1, 2)], dim=-1)  # [B, C, W]
            y_BC = (xx_BCW.to(dt) * conv.weight[:, 0].to(dt)).sum(-1).to(x.dtype)
            cache.copy_(xx_BCW[..., 1:])
            acts.append(F.silu(y_BC)[:, None])  # [B, 1, C]
        q, k, v = acts[0].view(B, 1, H, K), acts[1].view(B, 1, H, K), acts[2].view(B, 1, H, Vd)
        g = -m.A_log.to(dt).exp() * F.softplus(a_in.to(dt) + m.dt_bias.to(dt))
        beta = b_in.to(dt).sigmoid()
        o = gdn_decode_step(q, k, v, g, beta, state.recurrent, self.gdn_backend)
        o = m.o_norm(o.to(x.dtype), gate.view(B, 1, H, Vd)).reshape(B, 1, H * Vd)
        if fused is not None and fused.residual is not None:
            return project(o, m.o_proj.weight, Prologue(residual=fused.residual))
        return m.o_proj(o)
