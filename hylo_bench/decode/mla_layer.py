"""MLA over a preallocated latent cache, for the serving engine: chunked prefill (decompress the cached prefix,
SDPA) and absorbed-weight decode (checkpoint-format.md §5.1, §6). Uses an ``MLA`` module's weights, never
changes them.

Legend: B batch, T new tokens, S keys (cached prefix + new), Tm cache capacity, D hidden, H query heads,
G KV heads of kv_b_proj (n_kvm), N = qk_nope_head_dim, P = qk_rope_head_dim, V = v_head_dim, R = kv_lora_rank.

Cache row per token: ``[c_KV (R) ; kr (P)]`` with ``kr = RoPE(k_pe)`` stored after RoPE (§6).
Qwen3 q/k norms (§4.3 (d)): the key norm is an RMSNorm over the assembled key ``[k_nope_g ; k_pe]`` of KV head g,
``k = w * x / rms(x)``. RoPE is linear and ``rms`` is a per-token, per-group scalar, so with
``kr = RoPE(w_P * k_pe)`` and ``W_UK' = w_N * W_UK`` the normalised key is ``[W_UK'[g] c ; kr] / rms_g`` exactly.
The engine therefore caches ``key_scale = 1 / rms_g`` ([B, Tm, G], G numbers per token and layer) next to the
latent and folds ``w_N`` into the absorbed query: the absorbed decode stays exact with q/k norms, at the cost of
G extra cache elements per token (2.5 % for Qwen 7MLA: 8 on top of 320).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hylo_bench.decode.fused import Prologue, merge_linears, project
from hylo_bench.kernels.mla_decode import CHOICE as MLA_DECODE_CHOICE
from hylo_bench.kernels.mla_decode.ops import mla_decode_op, mla_decode_prep_op, mla_value_up_op
from hylo_bench.kernels.prefix_attention import prefix_attention
from hylo_bench.models.rope import rope_interleaved


@dataclass
class MLACacheSlot:
    """Preallocated cache of one MLA layer.

    Attributes:
        latent: [B, Tm, R + P] c_KV then the post-RoPE rope key, in the model dtype.
        key_scale: [B, Tm, G] inverse RMS of the assembled key per KV group (q/k-norm models), else None.
    """

    latent: torch.Tensor
    key_scale: torch.Tensor | None


def _rms_inv(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2, -1) + eps) in float32 (float64 for float64), as LlamaRMSNorm computes it."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.rsqrt(x.to(dt).pow(2).mean(-1) + eps)


class MLAServing:
    """Prefill / decode of one ``hylo_bench.models.mla.MLA`` module over an :class:`MLACacheSlot`.

    Precomputes the inference-only absorbed weights (never saved, §6 step 1): ``w_uk`` [G, N, R] (times the
    key norm's nope weight for q/k-norm models) and ``w_uv`` [G, V, R], and the rotary inverse frequencies on the
    module's device (so decode needs no host-to-device copies and can be captured in a CUDA graph).

    Args:
        mla: the MLA module (``hylo_bench.models.mla.MLA``).
        decode_backend: "auto", "torch" or "triton" (see :func:`hylo_bench.kernels.mla_decode.mla_decode`).
        merge_projections: read the query's first projection (``q_proj`` or ``q_a_proj``) and
            ``kv_a_proj_with_mqa`` with one GEMV (:func:`hylo_bench.decode.fused.merge_linears`; rebinds the module's
            weights as views, values unchanged).
    """

    def __init__(self, mla, decode_backend: str = "auto", merge_projections: bool = False):
        self.m = mla
        first = mla.q_proj if hasattr(mla, "q_proj") else mla.q_a_proj
        self.merged = merge_linears([first, mla.kv_a_proj_with_mqa]) if merge_projections else None
        w = mla.kv_b_proj.weight
        self.G, self.H, self.N, self.P, self.V, self.R = (mla.num_kv_heads, mla.num_heads, mla.nope_dim,
                                                          mla.rope_dim, mla.v_dim, mla.kv_rank)
        kv_b = w.detach().view(self.G, self.N + self.V, self.R)
        w_uk, self.w_uv = kv_b[:, : self.N], kv_b[:, self.N:]
        self.qk_norm = mla.use_qk_norm
        if self.qk_norm:
            kw = mla.k_norm.weight.detach()
            w_uk = w_uk * kw[: self.N, None].to(w_uk.dtype)
            self.k_pe_weight = kw[self.N:]
        self.w_uk = w_uk.contiguous()
        # the prefill's decompression weight [G * (N + V), R]: kv_b_proj with the key norm's nope weight folded in
        # (as w_uk), so the prefix keys need one scaling pass (the key scales) instead of two
        self.kv_b_prefill = (torch.cat([self.w_uk, self.w_uv], dim=1).reshape(-1, self.R) if self.qk_norm
                             else w.detach())
        self.inv_freq = mla.rotary.inv_freq.to(device=w.device)
        self.mscale = mla.rotary.mscale
        if decode_backend == "auto":  # resolved once here, so a traced decode step sees a constant
            decode_backend, reason = MLA_DECODE_CHOICE.choose(w.device, w.dtype)
            MLA_DECODE_CHOICE.log(decode_backend, reason)
        self.prefill_pad_values = True  # chunked prefill on the sdpa back end: V padded to the q/k width for flash
        self.decode_backend = decode_backend
        # the fused prep kernel: with the Triton decode back end (CUDA, Triton, not float64) and fused GEMVs, for
        # LlamaRMSNorm-style norms and the query through q_b_proj (no bias) or a merged q_proj
        norms = [getattr(mla, n) for n in ("q_a_layernorm", "kv_a_layernorm", "q_norm", "k_norm") if hasattr(mla, n)]
        self._prep_module_ok = (all(isinstance(n, LlamaRMSNorm) for n in norms)
                                and (hasattr(mla, "q_proj") or getattr(mla.q_b_proj, "bias", None) is None))
        self.prep_backend = "triton" if (decode_backend == "triton" and w.device.type == "cuda"
                                         and w.dtype != torch.float64) else "torch"

    def new_slot(self, batch: int, capacity: int) -> MLACacheSlot:
        """Zero cache for ``batch`` sequences of up to ``capacity`` tokens (model dtype and device)."""
        w = self.m.kv_a_proj_with_mqa.weight
        lat = torch.zeros(batch, capacity, self.R + self.P, dtype=w.dtype, device=w.device)
        ks = torch.zeros(batch, capacity, self.G, dtype=w.dtype, device=w.device) if self.qk_norm else None
        return MLACacheSlot(lat, ks)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, P/2] float32, times the YaRN mscale (§5.3)."""
        f = positions.to(torch.float32)[..., None] * self.inv_freq
        return f.cos() * self.mscale, f.sin() * self.mscale

    def _projections(self, x: torch.Tensor, norm=None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """x [B, T, D] -> (first query projection [B, T, H*(N+P)] or [B, T, q_lora_rank], or None when the
        projections are not merged; kv_a output [B, T, R + P]). ``norm``: RMSNorm fused into the merged GEMV."""
        if self.merged is not None:
            return self.merged(x, norm)
        return None, self.m.kv_a_proj_with_mqa(x)

    def _queries(self, x: torch.Tensor, cos, sin, first: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (q_nope [B, H, T, N], rotated q_pe [B, H, T, P]) with the q norm applied. ``first``: the
        query's first projection of x when already computed (merged GEMV)."""
        q = self.m._queries(x, first)
        if self.qk_norm:
            q = self.m.q_norm(q)
        return q[..., : self.N], rope_interleaved(q[..., self.N:], cos[:, None], sin[:, None])

    def _new_rows(self, lat: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kv_a output ``lat`` [B, T, R + P] of the new tokens -> their cache rows [B, T, R + P] and key scales
        [B, T, G] (or None)."""
        c, k_pe = lat[..., : self.R], lat[..., self.R:]
        if hasattr(self.m, "kv_a_layernorm"):
            c = self.m.kv_a_layernorm(c)
        ks = None
        if self.qk_norm:
            k_nope = F.linear(c, self.m.kv_b_proj.weight).unflatten(-1, (self.G, self.N + self.V))[..., : self.N]
            raw = torch.cat([k_nope, k_pe[..., None, :].expand(*k_nope.shape[:-1], self.P)], dim=-1)
            ks = _rms_inv(raw, self.m.k_norm.variance_epsilon).to(lat.dtype)  # [B, T, G]
            k_pe = k_pe * self.k_pe_weight.to(k_pe.dtype)
        kr = rope_interleaved(k_pe, cos, sin)
        return torch.cat([c, kr], dim=-1), ks

    def prefill(self, x: torch.Tensor, slot: MLACacheSlot, start: int) -> torch.Tensor:
        """Process tokens at positions ``start .. start + T - 1`` (same for every row), writing their cache rows.

        Keys and values of the whole prefix are decompressed from the cache (transient [B, G, S, N + P] and
        [B, G, S, V]); attention is lower-right causal (:func:`hylo_bench.kernels.prefix_attention.prefix_attention`:
        cuDNN or flash kernels on GPU, GQA without repeating KV heads). Never materialises [T, S] scores on GPU.

        Args:
            x: [B, T, D] normalised layer input. slot: this layer's cache. start: tokens already cached.

        Returns:
            [B, T, D] mixer output (before the residual add).
        """
        B, T, _ = x.shape
        S = start + T
        pos = torch.arange(start, S, device=x.device).expand(B, T)
        cos, sin = self._cos_sin(pos)
        first, lat = self._projections(x)
        q_nope, q_pe = self._queries(x, cos, sin, first)
        rows, ks = self._new_rows(lat, cos, sin)
        slot.latent[:B, start:S] = rows
        if ks is not None:
            slot.key_scale[:B, start:S] = ks
        k, v = self._prefix_keys_values(slot, B, S)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = prefix_attention(q, k, v, self.m.scale, start, pad_values=self.prefill_pad_values)
        return self.m.out_proj(out.transpose(1, 2).reshape(B, T, self.H * self.V))

    def _prefix_keys_values(self, slot: MLACacheSlot, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first S cached tokens of rows 0 .. B-1 decompressed: keys [B, G, S, N + P] (``[W_UK' c ; kr]``
        times the key scale, module docstring) and values [B, G, S, V] (a strided view of the decompression).

        Each key element is written once: the nope part straight from the decompression times the key scale, the
        rope part broadcast over the G groups, no concatenation (at 2M tokens the keys are 4 GiB per layer and
        chunk, so every extra read and write of them costs about 2 ms on an H200).
        """
        prefix = slot.latent[:B, :S]
        kv = F.linear(prefix[..., : self.R], self.kv_b_prefill).unflatten(-1, (self.G, self.N + self.V))
        k_nope, v = kv.transpose(1, 2).split([self.N, self.V], dim=-1)  # [B, G, S, N], [B, G, S, V]
        kr = prefix[:, None, :, self.R:]  # [B, 1, S, P]
        k = kv.new_empty(B, self.G, S, self.N + self.P)
        if slot.key_scale is None:
            k[..., : self.N] = k_nope
            k[..., self.N:] = kr
        else:
            scale = slot.key_scale[:B, :S].transpose(1, 2)[..., None]  # [B, G, S, 1]
            torch.mul(k_nope, scale, out=k[..., : self.N])
            torch.mul(kr, scale, out=k[..., self.N:])
        return k, v

    def decode(self, x: torch.Tensor, slot: MLACacheSlot, positions: torch.Tensor,
               fused: Prologue | None = None) -> torch.Tensor:
        """One token per sequence in absorbed-weight form (§6): writes its cache row at ``positions`` and attends
        over rows ``0 .. positions[b]`` through :func:`mla_decode`. No host synchronisation (graph-capturable).

        Args:
            x: [B, 1, D] normalised layer input (with ``fused.norm``: the residual stream, normalised inside the
                merged GEMV). slot: this layer's cache. positions: [B] int64 on x's device.
            fused: Triton GEMVs with ``fused.norm`` (if set) as the merged projection's prologue and
                ``fused.residual`` (if set) added by ``out_proj`` (needs merged projections;
                :mod:`hylo_bench.decode.fused`).

        Returns:
            [B, 1, D] mixer output (plus ``fused.residual`` when set).

        Raises:
            ValueError: ``fused`` without merged projections.
        """
        B = x.shape[0]
        if fused is not None and self.merged is None:
            raise ValueError("fused decode GEMVs need merged projections (MLAServing(merge_projections=True))")
        first, lat = self._projections(x, None if fused is None else fused.norm)
        triton_glue = fused is not None and self.prep_fusable()
        if triton_glue:  # one kernel for the query / cache-row glue, one for W_UV (prep_triton module)
            q_lat, q_pe, lengths = self.prep_triton(self._query_gemv(first), lat, slot, positions)
        else:
            (q_lat, q_pe), lengths = self.prep_torch(x, first, lat, slot, positions), positions + 1
        o_lat = mla_decode_op(q_lat, q_pe, slot.latent[:B], lengths, scale=self.m.scale,
                              key_scale=None if slot.key_scale is None else slot.key_scale[:B],
                              backend=self.decode_backend)
        if triton_glue:
            o = mla_value_up_op(o_lat, self.w_uv.to(x.dtype)).view(B, 1, self.H * self.V)
        else:
            rep = self.H // self.G
            o = torch.einsum("bgrc,gvc->bgrv", o_lat.unflatten(1, (self.G, rep)).to(x.dtype), self.w_uv.to(x.dtype))
            o = o.reshape(B, 1, self.H * self.V)
        if fused is not None and fused.residual is not None:
            return project(o, self.m.out_proj.weight, Prologue(residual=fused.residual))
        return self.m.out_proj(o)

    def prep_torch(self, x: torch.Tensor, first: torch.Tensor | None, lat: torch.Tensor, slot: MLACacheSlot,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode token's absorbed query and cache row, as torch ops (any device and dtype; Inductor fuses the
        element-wise parts under ``torch.compile``).

        Args:
            x: [B, 1, D] the layer's (normalised) input, used only when ``first`` is None. first: the query's
                first projection [B, 1, q_lora_rank or H*(N+P)] or None. lat: [B, 1, R + P] kv_a output.
            slot: the cache, row ``positions[b]`` written (and its key scale). positions: [B] int64.

        Returns:
            (q_lat [B, H, R] = W_UK'[g(h)]^T q_nope[h], q_pe [B, H, P] rotated), x's dtype.
        """
        B = lat.shape[0]
        cos, sin = self._cos_sin(positions[:, None])
        q_nope, q_pe = self._queries(x, cos, sin, first)  # [B, H, 1, N], [B, H, 1, P]
        rows, ks = self._new_rows(lat, cos, sin)  # [B, 1, R + P], [B, 1, G]
        b_idx = torch.arange(B, device=lat.device)
        slot.latent[b_idx, positions] = rows[:, 0]
        if ks is not None:
            slot.key_scale[b_idx, positions] = ks[:, 0]
        rep = self.H // self.G
        q_lat = torch.einsum("bgrn,gnc->bgrc", q_nope[:, :, 0].unflatten(1, (self.G, rep)), self.w_uk.to(lat.dtype))
        return q_lat.flatten(1, 2), q_pe[:, :, 0]

    def prep_fusable(self) -> bool:
        """Whether :meth:`prep_triton` serves this layer: a Triton decode back end (CUDA, not float64), merged
        projections, and a module the kernel can serve (``_prep_module_ok``, checked once at construction)."""
        return self.prep_backend == "triton" and self.merged is not None and self._prep_module_ok

    def _query_gemv(self, first: torch.Tensor) -> torch.Tensor:
        """The query [B, 1, H*(N+P)] from its first projection: ``q_b_proj`` on the Triton GEMV (with
        ``q_a_layernorm`` in its prologue when the model has one), or ``first`` itself for a plain ``q_proj``."""
        if hasattr(self.m, "q_proj"):
            return first
        return project(first, self.m.q_b_proj.weight, Prologue(norm=getattr(self.m, "q_a_layernorm", None)))

    def prep_triton(self, q: torch.Tensor, lat: torch.Tensor, slot: MLACacheSlot, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`prep_torch` in one Triton kernel (:mod:`hylo_bench.kernels.mla_decode.prep_triton`), from the
        query q [B, 1, H*(N+P)] (after ``q_b_proj``) and lat [B, 1, R + P]; also returns lengths = positions + 1."""
        m = self.m
        kva = getattr(m, "kv_a_layernorm", None)
        return mla_decode_prep_op(
            q, lat, positions, slot.latent, slot.key_scale, self.w_uk.to(q.dtype), m.kv_b_proj.weight, self.inv_freq,
            float(self.mscale), self.H, self.N, self.P, self.V,
            m.q_norm.weight if self.qk_norm else None, m.q_norm.variance_epsilon if self.qk_norm else 1e-6,
            m.k_norm.weight if self.qk_norm else None, m.k_norm.variance_epsilon if self.qk_norm else 1e-6,
            None if kva is None else kva.weight, 1e-6 if kva is None else kva.variance_epsilon)
