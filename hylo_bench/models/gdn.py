"""Gated DeltaNet (GDN) token mixer with fla 0.6.0's parameter names and shapes, plus its decode state.

Checkpoints move between this module and ``fla.layers.GatedDeltaNet`` unchanged (checkpoint-format.md sec. 4.4).
Projections are plain torch; the short convolutions and the gated norm go through
``hylo_bench.kernels.gated_delta.glue`` (fla's Triton kernels for CUDA inference, torch otherwise), the recurrence
through ``hylo_bench.kernels.gated_delta`` (torch chunked on CPU, fla on CUDA, torch step for one-token decode).

Legend: B batch, T tokens, D hidden size, H heads, K key head dim, Vd value head dim (= expand_v * K),
C conv channels, W conv width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hylo_bench.kernels.gated_delta import gated_delta_rule, gated_delta_rule_step
from hylo_bench.kernels.gated_delta.glue import gated_rms_norm, short_conv

_DT_MIN, _DT_MAX, _DT_FLOOR = 1e-3, 0.1, 1e-4  # fla 0.6.0 GatedDeltaNet dt init (hard-coded there too)
_A_INIT_RANGE = (1e-4, 16.0)  # fla draws U(0, 16); the lower bound keeps log() finite


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64 (so float64 tests stay tight)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(slots=True)
class GDNState:
    """Per-layer recurrent state of a GDN mixer for a batch of sequences. Size does not grow with T.

    Attributes:
        recurrent: [B, H, K, Vd] float32, K-first (fla's op default; the fla *layer* cache is the V-first
            transpose [B, H, Vd, K]).
        conv: (q, k, v) pre-convolution inputs of the last W - 1 tokens, each [B, C, W - 1] in the projection
            dtype; C = H * K for q and k, H * Vd for v. (fla's layer cache keeps W columns instead.)
    """

    recurrent: torch.Tensor
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm followed by a SiLU output gate: ``rmsnorm(o) * weight * silu(gate)`` (normalise first).

    Computed in float32 (float64 for float64 inputs), returned in the dtype of ``o``. This module is the torch
    form (the decode step compiles it); ``GatedDeltaNet.forward`` over several tokens calls
    :func:`hylo_bench.kernels.gated_delta.glue.gated_rms_norm` with this module's weight, fla's kernel on CUDA.

    Reference:
        fla 0.6.0 ``fla/modules/fused_norm_gate.py::FusedRMSNormGated`` (activation "swish").
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o, gate: [..., Vd] -> [..., Vd] in o's dtype."""
        return gated_rms_norm(o, gate, self.weight, self.eps, backend="torch")


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer, fla 0.6.0 layout (``use_gate=True``, short conv without bias, num_v_heads = H).

    Parameters (about 6 * D^2 when H * K = 0.75 D and expand_v = 2; 25,215,500 for D = 2048, 6 x 256):
    q_proj, k_proj [H*K, D]; v_proj, g_proj [H*Vd, D]; a_proj, b_proj [H, D]; A_log, dt_bias [H] float32;
    q_conv1d, k_conv1d [H*K, 1, W]; v_conv1d [H*Vd, 1, W]; o_norm.weight [Vd]; o_proj [D, H*Vd]. No biases.

    Forward per token: q, k, v = SiLU(causal depthwise conv(proj(x))); q, k l2-normalised per head (eps 1e-6);
    g = -exp(A_log) * softplus(a + dt_bias); beta = sigmoid(b); gated delta rule with scale K^-1/2;
    o = RMSNorm_Vd(o) * w * SiLU(g_proj x) per head; then o_proj.

    Args:
        hidden_size: D.
        num_heads: H (q/k heads = value heads).
        head_dim: K, the key head dim (<= 256 for fla's chunk kernel).
        expand_v: Vd = head_dim * expand_v; must be an integer.
        conv_size: W, short-convolution width.
        norm_eps: epsilon of the gated RMSNorm.
        layer_idx: index of the layer in the model (bookkeeping only).
        backend: recurrence back end for T > 1: "auto", "torch" or "fla" (see ``gated_delta_rule``).

    Raises:
        ValueError: if head_dim * expand_v is not an integer, or a size is not positive.

    Reference:
        arXiv 2412.06464 (Gated DeltaNet); fla 0.6.0 ``fla/layers/gated_deltanet.py``; kernels.md sec. 3;
        checkpoint-format.md sec. 4.4.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        expand_v: float = 2,
        conv_size: int = 4,
        norm_eps: float = 1e-5,
        layer_idx: int | None = None,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        head_v_dim = round(head_dim * expand_v)
        if not math.isclose(head_dim * expand_v, head_v_dim, rel_tol=1e-5):
            raise ValueError(
                f"head_dim * expand_v = {head_dim} * {expand_v} = {head_dim * expand_v} is not an integer; "
                "choose expand_v so the value head dim is whole"
            )
        for name, val in (
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("conv_size", conv_size),
            ("value head dim", head_v_dim),
        ):
            if val < 1:
                raise ValueError(f"GatedDeltaNet {name} must be >= 1; got {val}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_k_dim = head_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_heads * head_dim
        self.value_dim = num_heads * head_v_dim
        self.conv_size = conv_size
        self.layer_idx = layer_idx
        self.backend = backend

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.q_conv1d = self._make_conv(self.key_dim)
        self.k_conv1d = self._make_conv(self.key_dim)
        self.v_conv1d = self._make_conv(self.value_dim)
        self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self._reset_gate_parameters()

    def _make_conv(self, channels: int) -> nn.Conv1d:
        # padding is applied by hand (zeros or the cached inputs), so the module itself pads nothing
        return nn.Conv1d(channels, channels, self.conv_size, groups=channels, padding=0, bias=False)

    @torch.no_grad()
    def _reset_gate_parameters(self) -> None:
        if self.A_log.is_meta:
            return  # no values on meta (and meta log() imports torch._dynamo, ~10 s); see reset_parameters
        H = self.num_heads
        A = torch.empty(H, dtype=torch.float32, device=self.A_log.device).uniform_(*_A_INIT_RANGE)
        self.A_log.copy_(A.log())
        u01 = torch.rand(H, dtype=torch.float32, device=self.dt_bias.device)
        dt = (u01 * (math.log(_DT_MAX) - math.log(_DT_MIN)) + math.log(_DT_MIN)).exp().clamp(min=_DT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def reset_parameters(self) -> None:
        """Re-initialise every parameter as fla does (torch defaults for linear/conv; e.g. after ``to_empty``)."""
        for mod in (
            self.q_proj,
            self.k_proj,
            self.v_proj,
            self.a_proj,
            self.b_proj,
            self.g_proj,
            self.o_proj,
            self.q_conv1d,
            self.k_conv1d,
            self.v_conv1d,
            self.o_norm,
        ):
            mod.reset_parameters()
        self._reset_gate_parameters()

    def state_bytes_per_sequence(self) -> int:
        """Bytes of decode state one sequence costs in this layer (independent of context length).

        Recurrent state H * K * Vd float32, plus conv inputs (2 * H * K + H * Vd) * (W - 1) in the projection
        weight dtype. E.g. D=2048, 6 x 256, expand_v 2, W 4, bf16: 3,145,728 + 36,864 = 3,182,592 bytes.
        """
        recurrent = self.num_heads * self.head_k_dim * self.head_v_dim * 4
        itemsize = self.q_proj.weight.element_size()
        conv = (2 * self.key_dim + self.value_dim) * (self.conv_size - 1) * itemsize
        return recurrent + conv

    def empty_state(
        self, batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> GDNState:
        """All-zero state for ``batch_size`` sequences; equivalent to passing ``state=None``.

        Args:
            batch_size: B.
            device: default: the parameters' device.
            dtype: conv-state dtype; default: the projection weight dtype (the recurrent state is float32).
        """
        w = self.q_proj.weight
        device = w.device if device is None else device
        dtype = w.dtype if dtype is None else dtype
        W1 = self.conv_size - 1
        return GDNState(
            recurrent=torch.zeros(
                batch_size, self.num_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32, device=device
            ),
            conv=tuple(
                torch.zeros(batch_size, c, W1, dtype=dtype, device=device)
                for c in (self.key_dim, self.key_dim, self.value_dim)
            ),
        )

    def _short_conv(
        self, conv: nn.Conv1d, x_BTC: torch.Tensor, cache_BCW: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU continuing from the cached inputs.

        Args:
            conv: the depthwise conv module (weight [C, 1, W]).
            x_BTC: [B, T, C] pre-conv inputs of this call.
            cache_BCW: [B, C, W - 1] inputs of the previous W - 1 tokens, or None (zeros: sequence start).

        Returns:
            (SiLU(conv) [B, T, C], new cache [B, C, W - 1] = last W - 1 inputs of cache + this call).
        """
        # one token (decode outside the engine) stays on torch: a Triton launch per tensor would cost more
        return short_conv(x_BTC, conv.weight[:, 0], cache_BCW, backend="auto" if x_BTC.shape[1] > 1 else "torch")

    def gates(self, a_BTH: torch.Tensor, b_BTH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The a / b projections [B, T, H] -> (log decay g = -exp(A_log) * softplus(a + dt_bias), write strength
        beta = sigmoid(b)), both [B, T, H] in float32 (float64 for float64 inputs)."""
        dt = _math_dtype(a_BTH.dtype)
        g_BTH = -self.A_log.to(dt).exp() * F.softplus(a_BTH.to(dt) + self.dt_bias.to(dt))
        return g_BTH, b_BTH.to(dt).sigmoid()

    def output(self, o_BTHV: torch.Tensor, gate_BTC: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The recurrence's output o [B, T, H, Vd] and the g projection [B, T, H * Vd] -> gated RMSNorm per head
        (fla's kernel for multi-token CUDA inference, :func:`gated_rms_norm`), then ``o_proj`` -> [B, T, D] in
        ``dtype``."""
        B, T, H, Vd = o_BTHV.shape
        o_BTHV = gated_rms_norm(o_BTHV.to(dtype), gate_BTC.view(B, T, H, Vd), self.o_norm.weight, self.o_norm.eps,
                                backend="auto" if T > 1 else "torch")
        return self.o_proj(o_BTHV.reshape(B, T, H * Vd))

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        state: GDNState | None = None,
        use_cache: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, GDNState | None]:
        """Mix a block of tokens, optionally continuing from and returning a decode state.

        T > 1 runs the chunked op (fla on CUDA when allowed, torch otherwise); T == 1 runs the recurrent step
        op. Prefill + step-by-step decode equals one full forward up to rounding.

        Padding: at positions with attention_mask == 0 the conv inputs are zeroed and g = beta = 0, so the
        recurrent state passes through unchanged and those outputs are set to 0. With LEFT padding at the start
        of a sequence (state=None) this gives exactly the unpadded result, and the returned state is valid
        for decoding. Right padding leaves zeros in the conv state: do not decode from it.

        Args:
            hidden_states: [B, T, D].
            attention_mask: [B, T'] with T' >= T, 1 = real token, 0 = pad (bool/int/float); only the last T
                columns are used (so an HF-style mask over past + current tokens also works).
            state: state after the previous tokens of the same sequences, or None at sequence start.
            use_cache: return the state after this call.
            cu_seqlens: [n_docs + 1] int32 offsets of packed documents over the flattened B * T tokens
                (``hylo_bench.models.varlen``; fla's ``cu_seqlens`` keyword): the short-conv history and the
                recurrent state restart at every document, so each document's output equals running it alone.
                Not combinable with ``state``, ``use_cache`` or a padding mask.

        Returns:
            (output [B, T, D] in the input dtype, new GDNState if use_cache else None).

        Raises:
            ValueError: on a mask that is not [B, T' >= T], or ``cu_seqlens`` with a state / cache / mask.
        """
        B, T, _ = hidden_states.shape
        H, K, Vd = self.num_heads, self.head_k_dim, self.head_v_dim
        if cu_seqlens is not None:
            if state is not None or use_cache or attention_mask is not None:
                raise ValueError("GatedDeltaNet: packed documents (cu_seqlens) cannot be combined with a decode "
                                 "state, use_cache or a padding mask")
            return self._forward_packed(hidden_states, cu_seqlens), None
        mask_BT = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError(
                    f"attention_mask must be a [B, T'] 0/1 padding mask with B={B}, T' >= {T}; "
                    f"got {tuple(attention_mask.shape)}"
                )
            mask_BT = attention_mask[:, -T:].to(hidden_states.dtype)

        conv_in = [proj(hidden_states) for proj in (self.q_proj, self.k_proj, self.v_proj)]  # [B, T, C]
        if mask_BT is not None:
            conv_in = [x * mask_BT[..., None] for x in conv_in]
        caches = state.conv if state is not None else (None, None, None)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        (q, new_q), (k, new_k), (v, new_v) = (
            self._short_conv(conv, x, c) for conv, x, c in zip(convs, conv_in, caches)
        )
        q_BTHK, k_BTHK, v_BTHV = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, Vd)

        dt = _math_dtype(hidden_states.dtype)
        g_BTH, beta_BTH = self.gates(self.a_proj(hidden_states), self.b_proj(hidden_states))
        if mask_BT is not None:
            g_BTH = g_BTH * mask_BT.to(dt)[..., None]
            beta_BTH = beta_BTH * mask_BT.to(dt)[..., None]

        recurrent = state.recurrent if state is not None else None
        if T == 1:
            o_BTHV, recurrent = gated_delta_rule_step(
                q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, recurrent, use_qk_l2norm_in_kernel=True
            )
        else:
            o_BTHV, recurrent = gated_delta_rule(
                q_BTHK,
                k_BTHK,
                v_BTHV,
                g_BTH,
                beta_BTH,
                initial_state=recurrent,
                output_final_state=use_cache,
                use_qk_l2norm_in_kernel=True,
                backend=self.backend,
            )
        out_BTD = self.output(o_BTHV, self.g_proj(hidden_states), hidden_states.dtype)
        if mask_BT is not None:
            out_BTD = out_BTD * mask_BT[..., None]
        new_state = GDNState(recurrent=recurrent, conv=(new_q, new_k, new_v)) if use_cache else None
        return out_BTD, new_state

    def _forward_packed(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Forward over packed documents (see ``forward``): [B, T, D] -> [B, T, D]."""
        from hylo_bench.models.varlen import check_packed, document_index, varlen_causal_conv1d

        B, T, _ = hidden_states.shape
        H, K, Vd = self.num_heads, self.head_k_dim, self.head_v_dim
        check_packed(cu_seqlens, B, T)
        cu_seqlens = cu_seqlens.to(hidden_states.device)
        _, pos_BT = document_index(cu_seqlens, B, T)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        q, k, v = (F.silu(varlen_causal_conv1d(proj(hidden_states).transpose(1, 2), conv.weight, None, pos_BT))
                   .transpose(1, 2) for proj, conv in zip((self.q_proj, self.k_proj, self.v_proj), convs))
        g, beta = self.gates(self.a_proj(hidden_states), self.b_proj(hidden_states))
        # fla's varlen convention: the documents of all rows flattened into one batch row
        o, _ = gated_delta_rule(q.reshape(1, B * T, H, K), k.reshape(1, B * T, H, K), v.reshape(1, B * T, H, Vd),
                                g.reshape(1, B * T, H), beta.reshape(1, B * T, H), use_qk_l2norm_in_kernel=True,
                                backend=self.backend, cu_seqlens=cu_seqlens)
        gate = self.g_proj(hidden_states).view(B, T, H, Vd)
        o = self.o_norm(o.view(B, T, H, Vd).to(hidden_states.dtype), gate)
        return self.o_proj(o.reshape(B, T, H * Vd))
