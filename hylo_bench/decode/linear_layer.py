"""GDN and Mamba-2 mixers over preallocated states, for the serving engine: chunked prefill through the module's
own forward (fla chunk kernels on CUDA, torch on CPU) and single-token decode (GDN: one Triton kernel for the
whole token on CUDA, or fla's fused recurrent kernel after a pre-step, or the torch step; Mamba-2: the module's
torch step). States are updated in place, so their addresses never change (CUDA graphs).

Legend: B batch, T tokens, D hidden, H heads, K / Vd GDN key / value head dims, C conv channels, W conv width.
"""

from __future__ import annotations

import torch

from hylo_bench.decode.fused import Prologue, merge_linears, project
from hylo_bench.kernels.gated_delta import DECODE_CHOICE, select_gdn_decode_backend, select_prestep_backend
from hylo_bench.kernels.gated_delta.ops import gdn_decode_prestep_op, gdn_decode_step, gdn_decode_token_op
from hylo_bench.models.cache import map_state


def _copy_state(dst, src) -> None:
    """Copy every tensor of state dataclass ``src`` into the same field of ``dst`` (in place)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    map_state(src, lambda t: pairs.append(t) or t)
    targets: list[torch.Tensor] = []
    map_state(dst, lambda t: targets.append(t) or t)
    for d, s in zip(targets, pairs):
        d.copy_(s)


class LinearServing:
    """Prefill / decode of one GDN (``hylo_bench.models.gdn.GatedDeltaNet``) or Mamba-2 mixer over a
    preallocated state (``GDNState`` / ``Mamba2State``, from the module's ``empty_state``).

    Args:
        module: the mixer. kind: "gdn" or "mamba". gdn_decode_backend: "auto", "torch", "fla" or "triton"
            (:func:`select_gdn_decode_backend`; "triton" runs the whole token in one kernel, so ``prestep_backend``
            does not apply).
        merge_projections: GDN decode reads q/k/v/a/b/g projections with one GEMV
            (:func:`hylo_bench.decode.fused.merge_linears`; rebinds the module's weights as views, values unchanged).
        prestep_backend: GDN decode's convolutions + SiLU + gates: "torch" (plain ops, fused by Inductor into about
            11 kernels), "triton" (one kernel, CUDA, 4-tap convs) or "auto" (triton on CUDA when Triton imports and
            the conv has 4 taps, torch otherwise); :mod:`hylo_bench.kernels.gated_delta.decode_prestep`.

    Raises:
        ValueError: unknown ``prestep_backend``, or "triton" for a GDN mixer off CUDA, in float64 or with a conv
            width other than 4.
    """

    def __init__(self, module, kind: str, gdn_decode_backend: str = "auto", merge_projections: bool = False,
                 prestep_backend: str = "torch"):
        self.m, self.kind = module, kind
        self.merged = None
        if kind == "gdn" and merge_projections:
            m = module
            self.merged = merge_linears([m.q_proj, m.k_proj, m.v_proj, m.a_proj, m.b_proj, m.g_proj])
        # the first matrix (q_proj / in_proj): the module's own A_log / dt_bias come first in parameters() and stay
        # float32 in a from_pretrained float64 or bf16 model
        w = next(p for p in module.parameters() if p.dim() >= 2)
        self.dtype = w.dtype
        self.gdn_backend = select_gdn_decode_backend(w.device, w.dtype, gdn_decode_backend,
                                                     getattr(module, "conv_size", 4)) if kind == "gdn" else "torch"
        self.counters: torch.Tensor | None = None  # the "triton" token kernel's per-(sequence, head) arrival counts
        prestep_backend = select_prestep_backend(w.device, w.dtype, prestep_backend, getattr(module, "conv_size", 0),
                                                 check=kind == "gdn")
        self.prestep_backend = prestep_backend
        if kind == "gdn":
            m = module
            self.conv_weight = torch.cat([c.weight.detach()[:, 0] for c in (m.q_conv1d, m.k_conv1d, m.v_conv1d)])
            DECODE_CHOICE.log(self.gdn_backend, "convs + gates: "
                              + ("in the same kernel" if self.gdn_backend == "triton" else prestep_backend))

    def new_state(self, batch: int):
        """Zero state for ``batch`` sequences (float64 recurrent state for float64 models, else the module's)."""
        state = self.m.empty_state(batch)
        if self.gdn_backend == "triton":
            self._counters_for(batch)
        if self.dtype == torch.float64:
            state = map_state(state, lambda t: t.double())
        return state

    def _counters_for(self, batch: int) -> torch.Tensor:
        """int32 zeros [>= batch * H] on the module's device, allocated once per larger batch (the kernel leaves
        them zero)."""
        n = batch * self.m.num_heads
        if self.counters is None or self.counters.numel() < n:
            self.counters = torch.zeros(n, dtype=torch.int32, device=self.conv_weight.device)
        return self.counters

    def prefill(self, x: torch.Tensor, state) -> torch.Tensor:
        """x [B, T, D] continuing ``state`` (updated in place) -> [B, T, D], through the module's own forward (its
        six projections apart: one GEMM over the merged weights measured slower, docs/kernels.md §3.7)."""
        out, new = self.m(x, state=state, use_cache=True)
        _copy_state(state, new)
        return out

    def decode(self, x: torch.Tensor, state, fused: Prologue | None = None) -> torch.Tensor:
        """x [B, 1, D] -> [B, 1, D]; ``state`` updated in place. No host synchronisation.

        ``fused`` (GDN with merged projections only): with ``fused.norm`` x is the residual stream, normalised in the
        merged GEMV's prologue; with ``fused.residual`` ``o_proj`` adds it (:mod:`hylo_bench.decode.fused`).

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
        """The T == 1 path of ``GatedDeltaNet.forward``: convolutions and gates on the selected pre-step back end
        (:func:`hylo_bench.kernels.gated_delta.ops.gdn_decode_prestep_op`), the recurrence on the selected GDN back
        end."""
        m = self.m
        B = x.shape[0]
        H, K, Vd = m.num_heads, m.head_k_dim, m.head_v_dim
        if fused is not None and self.merged is None:
            raise ValueError("fused decode GEMVs need merged projections (LinearServing(merge_projections=True))")
        if self.merged is not None:
            proj = self.merged.project(x, None if fused is None else fused.norm)  # [B, 1, q k v a b g]
        else:
            proj = torch.cat([p(x) for p in (m.q_proj, m.k_proj, m.v_proj, m.a_proj, m.b_proj, m.g_proj)], dim=-1)
        gate = proj[..., proj.shape[-1] - m.value_dim:]
        if self.gdn_backend == "triton":
            o = gdn_decode_token_op(proj, state.conv, self.conv_weight, m.A_log, m.dt_bias, state.recurrent,
                                    self._counters_for(B)).view(B, 1, H, Vd)
            return self._gdn_out(x, o, gate, fused)
        act, g, beta = gdn_decode_prestep_op(proj, state.conv, self.conv_weight, m.A_log, m.dt_bias,
                                             self.prestep_backend)
        Ck = m.key_dim
        q, k = act[:, :Ck].view(B, 1, H, K), act[:, Ck:2 * Ck].view(B, 1, H, K)
        v = act[:, 2 * Ck:].view(B, 1, H, Vd)
        g, beta = g.view(B, 1, H), beta.view(B, 1, H)
        o = gdn_decode_step(q, k, v, g, beta, state.recurrent, self.gdn_backend)
        return self._gdn_out(x, o, gate, fused)

    def _gdn_out(self, x: torch.Tensor, o: torch.Tensor, gate: torch.Tensor, fused: Prologue | None) -> torch.Tensor:
        """The recurrence's output o [B, 1, H, Vd] -> gated output norm -> ``o_proj`` (+ ``fused.residual``)."""
        m = self.m
        B, H, Vd = x.shape[0], m.num_heads, m.head_v_dim
        if fused is not None and fused.residual is not None:
            o = o.to(x.dtype).reshape(B, 1, H * Vd)
            if m.o_norm.weight.dtype == x.dtype:  # o_norm in o_proj's prologue, residual in its epilogue
                return project(o, m.o_proj.weight, Prologue(norm=m.o_norm, residual=fused.residual, gate=gate))
            o = m.o_norm(o.view(B, 1, H, Vd), gate.view(B, 1, H, Vd)).reshape(B, 1, H * Vd)
            return project(o, m.o_proj.weight, Prologue(residual=fused.residual))
        o = m.o_norm(o.to(x.dtype), gate.view(B, 1, H, Vd)).reshape(B, 1, H * Vd)
        return m.o_proj(o)
