"""Mamba-2 token mixer in the released Zebra-Llama layout (attribute ``mamba``), plus its decode state.

Parameter names and shapes follow checkpoint-format.md sec. 4.5 (Zebra-Llama ``hybrid_mamba2_layer.Mamba2`` with
``repeat_kv_before_conv: false``): x and B have the KV width d_xb and are repeated to the heads after the conv.
Projections, conv and gated norm are plain torch; the scan goes through ``hylo_bench.kernels.ssd``.

Legend: B batch, T tokens, D hidden size, H heads (= ngroups), P head dim (= d_state), N state size,
Gx x/B groups (= d_xb / d_state), E d_inner (= H * P), X d_xb, C conv channels (= E + 2 X), W conv width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hylo_bench.kernels.ssd import DEFAULT_CHUNK_SIZE, ssd_scan, ssd_step

_DT_MIN, _DT_MAX, _DT_FLOOR = 1e-3, 0.1, 1e-4  # mamba_ssm Mamba2 defaults (checkpoint-format.md sec. 7.3)
_A_INIT_RANGE = (1.0, 16.0)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(slots=True)
class Mamba2State:
    """Per-layer decode state of a Mamba-2 mixer for a batch of sequences (size independent of T).

    Attributes:
        ssm: [B, H, P, N] float32 (float64 for float64 models), mamba_ssm's ``ssm_state`` layout.
        conv: [B, C, W - 1] pre-conv [x | B | C] inputs of the last W - 1 tokens in the projection dtype.
            (Zebra-Llama's cache keeps W columns, [B, C, W]; the oldest one is never read.)
    """

    ssm: torch.Tensor
    conv: torch.Tensor


class GatedRMSNormGroups(nn.Module):
    """Gated RMSNorm per group of ``group_size``: ``rmsnorm_group(y * silu(z)) * weight`` (gate first, the
    Zebra-Llama default) or, with ``norm_before_gate``, ``rmsnorm_group(y) * weight * silu(z)``.

    Computed in float32 (float64 for float64 inputs), returned in y's dtype.

    Reference:
        mamba_ssm ``ops/triton/layernorm_gated.py::RMSNorm`` (``rms_norm_ref``) with ``group_size = d_inner /
        ngroups`` (checkpoint-format.md sec. 4.5 step 5, sec. 4.3 (e)).
    """

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5, norm_before_gate: bool = False) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"gated norm width {dim} is not a multiple of its group size {group_size}")
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = bool(norm_before_gate)
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z: [..., E] -> [..., E] in y's dtype."""
        dt = _math_dtype(y.dtype)
        gate = F.silu(z.to(dt))
        g = y.to(dt) if self.norm_before_gate else y.to(dt) * gate
        g = g.unflatten(-1, (-1, self.group_size))
        g = (g * torch.rsqrt(g.pow(2).mean(dim=-1, keepdim=True) + self.eps)).flatten(-2) * self.weight.to(dt)
        if self.norm_before_gate:
            g = g * gate
        return g.to(y.dtype)


class Mamba2(nn.Module):
    """Mamba-2 mixer, Zebra-Llama layout: heads = ngroups, head dim = d_state, x/B of KV width repeated after conv.

    Parameters: in_proj [2E + 2X + H, D] (rows [z | x | B | C | dt], no bias); conv1d weight [C, 1, W] and bias
    [C] over [x | B | C]; dt_bias, A_log, D [H]; norm.weight [E]; out_proj [D, E] (no bias). For the released
    Qwen3-1.7B layer (D 2048, E 2048, X 1024, H 16, N 128, W 4): 16,832,560 parameters.

    Forward per token: [z, xBC, dt] = in_proj(u); xBC = SiLU(causal depthwise conv(xBC) + bias); split x, B, C;
    x and B are viewed as Gx groups of N and each repeated H / Gx times (group j -> heads j*g ... j*g + g - 1);
    SSD scan with dt = softplus(dt + dt_bias), A = -exp(A_log), skip D; y = RMSNorm_group(y * SiLU(z)) * w;
    out_proj(y).

    Args:
        hidden_size: D (Zebra-Llama ``d_model``).
        d_inner: E = ngroups * d_state (z, C and y width).
        d_xb: X, width of x and B (a multiple of d_state; the base model's n_kv * d_h).
        ngroups: H, number of heads and of C groups.
        d_state: N = P.
        d_conv: W.
        norm_eps: epsilon of the gated RMSNorm (1e-5 in Zebra-Llama).
        chunk_size: chunk length of the torch scan.
        layer_idx: index of the layer in the model (bookkeeping only).
        norm_before_gate: gated norm order (``ssm_cfg.norm_before_gate``; Zebra-Llama default False: gate first).
        dt_limit: (min, max) clamp of dt after the softplus (``ssm_cfg.dt_limit``; mamba_ssm's
            ``mamba_chunk_scan_combined``); default (0, inf) = no clamp. Applied in decode steps too (Zebra-Llama's
            ``step`` omits it, so its decode would disagree with its own prefill).
        dt_min, dt_max, dt_init_floor, A_init_range, conv_init: initialisation of dt_bias, A_log and the conv
            kernel (mamba_ssm ``Mamba2`` arguments; ``conv_init`` None keeps torch's default conv init).
        backend: scan back end for T > 1: "auto", "torch" or "fla" (see ``hylo_bench.kernels.ssd.ssd_scan``).

    Raises:
        ValueError: if d_inner != ngroups * d_state, d_xb is not a multiple of d_state, ngroups is not a
            multiple of d_xb / d_state, or a size is not positive.

    Reference:
        arXiv 2405.21060 (Mamba-2); Zebra-Llama ``hybrid/mamba2/hybrid_mamba2_layer.py``; checkpoint-format.md
        sec. 3.1 (``ssm_cfg``, ``d_inner``, ``d_xb``), 4.3 (e), 4.5.
    """

    def __init__(
        self,
        hidden_size: int,
        d_inner: int,
        d_xb: int,
        ngroups: int,
        d_state: int,
        d_conv: int = 4,
        norm_eps: float = 1e-5,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        layer_idx: int | None = None,
        *,
        norm_before_gate: bool = False,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        dt_min: float = _DT_MIN,
        dt_max: float = _DT_MAX,
        dt_init_floor: float = _DT_FLOOR,
        A_init_range: tuple[float, float] = _A_INIT_RANGE,
        conv_init: float | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        for name, val in (("hidden_size", hidden_size), ("d_inner", d_inner), ("d_xb", d_xb),
                          ("ngroups", ngroups), ("d_state", d_state), ("d_conv", d_conv)):
            if val < 1:
                raise ValueError(f"Mamba2 {name} must be >= 1; got {val}")
        if d_inner != ngroups * d_state:
            raise ValueError(f"Mamba2 needs d_inner = ngroups * d_state (heads of d_state dims); got d_inner "
                             f"{d_inner}, ngroups {ngroups}, d_state {d_state}. Set d_inner = n_h * d_h, "
                             f"ssm_cfg.ngroups = n_h, ssm_cfg.d_state = d_h")
        if d_xb % d_state or ngroups % (d_xb // d_state):
            raise ValueError(f"Mamba2 needs d_xb = n_kv * d_state with n_kv dividing ngroups; got d_xb {d_xb}, "
                             f"d_state {d_state}, ngroups {ngroups}")
        self.hidden_size = hidden_size
        self.d_inner = d_inner
        self.d_xb = d_xb
        self.nheads = ngroups
        self.d_state = d_state
        self.headdim = d_state
        self.num_xb_groups = d_xb // d_state
        self.repeat_group = ngroups // self.num_xb_groups
        self.d_conv = d_conv
        self.conv_dim = d_inner + 2 * d_xb
        self.chunk_size = chunk_size
        self.layer_idx = layer_idx
        self.backend = backend
        lo, hi = (float(v) for v in dt_limit)
        if not 0.0 <= lo < hi:
            raise ValueError(f"Mamba2 dt_limit must be (min, max) with 0 <= min < max; got {tuple(dt_limit)}")
        self.dt_limit = (lo, hi)
        if not (0 < dt_min <= dt_max and dt_init_floor >= 0 and 0 < A_init_range[0] <= A_init_range[1]):
            raise ValueError(f"Mamba2 init: need 0 < dt_min <= dt_max, dt_init_floor >= 0, 0 < A_init_range[0] <= "
                             f"A_init_range[1]; got {dt_min}, {dt_max}, {dt_init_floor}, {tuple(A_init_range)}")
        self._dt_init = (float(dt_min), float(dt_max), float(dt_init_floor))
        self._A_init_range = (float(A_init_range[0]), float(A_init_range[1]))
        self.conv_init = conv_init

        self.in_proj = nn.Linear(hidden_size, 2 * d_inner + 2 * d_xb + ngroups, bias=False)
        # padding is applied by hand (zeros or the cached inputs), so the module itself pads nothing
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, padding=0, bias=True)
        self.dt_bias = nn.Parameter(torch.empty(ngroups))
        self.A_log = nn.Parameter(torch.empty(ngroups))
        self.D = nn.Parameter(torch.empty(ngroups))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        self.norm = GatedRMSNormGroups(d_inner, group_size=d_state, eps=norm_eps, norm_before_gate=norm_before_gate)
        self.out_proj = nn.Linear(d_inner, hidden_size, bias=False)
        self._init_conv()
        self.reset_special_parameters()

    @torch.no_grad()
    def _init_conv(self) -> None:
        if self.conv_init is not None and not self.conv1d.weight.is_meta:
            nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)

    @torch.no_grad()
    def reset_special_parameters(self) -> None:
        """mamba_ssm init: dt_bias = softplus^-1(dt), dt ~ log-U[dt_min, dt_max] floored at dt_init_floor (defaults
        1e-3, 0.1, 1e-4); A_log = log U[A_init_range] (default [1, 16]); D = 1; norm weight 1 (checkpoint-format.md
        sec. 7.3). No-op on the meta device."""
        if self.A_log.is_meta:
            return
        H, dev = self.nheads, self.A_log.device
        dt_min, dt_max, dt_floor = self._dt_init
        u01 = torch.rand(H, dtype=torch.float32, device=dev)
        dt = (u01 * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).exp().clamp(min=dt_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.A_log.copy_(torch.empty(H, dtype=torch.float32, device=dev).uniform_(*self._A_init_range).log())
        self.D.fill_(1.0)
        self.norm.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise every parameter (torch defaults for in_proj, conv1d, out_proj; mamba_ssm for the rest)."""
        for mod in (self.in_proj, self.conv1d, self.out_proj):
            mod.reset_parameters()
        self._init_conv()
        self.reset_special_parameters()

    def state_bytes_per_sequence(self) -> int:
        """Bytes of decode state per sequence: H * P * N float32 + C * (W - 1) in the projection dtype.

        E.g. the released Qwen layer in bf16: 16 * 128 * 128 * 4 + 4096 * 3 * 2 = 1,048,576 + 24,576 bytes.
        """
        return self.nheads * self.headdim * self.d_state * 4 + \
            self.conv_dim * (self.d_conv - 1) * self.in_proj.weight.element_size()

    def empty_state(self, batch_size: int, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None) -> Mamba2State:
        """All-zero state for ``batch_size`` sequences; equivalent to ``state=None``."""
        w = self.in_proj.weight
        device = w.device if device is None else device
        dtype = w.dtype if dtype is None else dtype
        return Mamba2State(
            ssm=torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, dtype=_math_dtype(dtype),
                            device=device),
            conv=torch.zeros(batch_size, self.conv_dim, self.d_conv - 1, dtype=dtype, device=device))

    def _conv(self, xBC_BTC: torch.Tensor, cache_BCW: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + bias + SiLU continuing from the cached inputs.

        Returns (SiLU(conv) [B, T, C], new cache [B, C, W - 1] = last W - 1 inputs of cache + this call).
        """
        B, _T, C = xBC_BTC.shape
        W1 = self.d_conv - 1
        x_BCT = xBC_BTC.transpose(1, 2)
        if cache_BCW is None:
            cache_BCW = x_BCT.new_zeros(B, C, W1)
        xx_BCL = torch.cat([cache_BCW.to(x_BCT.dtype), x_BCT], dim=-1)
        y_BCT = F.conv1d(xx_BCL, self.conv1d.weight.to(x_BCT.dtype), self.conv1d.bias.to(x_BCT.dtype), groups=C)
        return F.silu(y_BCT).transpose(1, 2), xx_BCL[..., xx_BCL.shape[-1] - W1:]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        state: Mamba2State | None = None,
        use_cache: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Mamba2State | None]:
        """Mix a block of tokens, optionally continuing from and returning a decode state.

        T > 1 runs the chunked scan; T == 1 the recurrent step. Prefill + decode equals one full forward up to
        rounding. Padding: at positions with attention_mask == 0 the conv inputs are zeroed and dt = 0, so the SSM
        state passes through unchanged, and the outputs there are 0. With LEFT padding this gives exactly the
        unpadded result and a valid decode state. Right padding leaves zeros in the conv state: do not decode
        from it.

        Args:
            hidden_states: u [B, T, D].
            attention_mask: [B, T'] with T' >= T, 1 = real token, 0 = pad; only the last T columns are used.
            state: state after the previous tokens of the same sequences, or None at sequence start.
            use_cache: return the state after this call.
            cu_seqlens: [n_docs + 1] int32 offsets of packed documents over the flattened B * T tokens
                (``hylo_bench.models.varlen``; mamba_ssm's ``seq_idx`` in offset form): conv history and SSM
                state restart at every document. Not combinable with ``state``, ``use_cache`` or a padding mask.

        Returns:
            (output [B, T, D] in the input dtype, new Mamba2State if use_cache else None).

        Raises:
            ValueError: on a mask that is not [B, T' >= T], or ``cu_seqlens`` with a state / cache / mask.
        """
        Bsz, T, _ = hidden_states.shape
        H, P, N, E, X = self.nheads, self.headdim, self.d_state, self.d_inner, self.d_xb
        pos_BT = None
        if cu_seqlens is not None:
            from hylo_bench.models.varlen import check_packed, document_index

            if state is not None or use_cache or attention_mask is not None:
                raise ValueError("Mamba2: packed documents (cu_seqlens) cannot be combined with a decode state, "
                                 "use_cache or a padding mask")
            check_packed(cu_seqlens, Bsz, T)
            cu_seqlens = cu_seqlens.to(hidden_states.device)
            pos_BT = document_index(cu_seqlens, Bsz, T)[1]
        mask_BT = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != Bsz or attention_mask.shape[1] < T:
                raise ValueError(f"attention_mask must be a [B, T'] 0/1 padding mask with B={Bsz}, T' >= {T}; "
                                 f"got {tuple(attention_mask.shape)}")
            mask_BT = attention_mask[:, -T:].to(hidden_states.dtype)

        z_BTE, xBC_BTC, dt_BTH = self.in_proj(hidden_states).split([E, E + 2 * X, H], dim=-1)
        if mask_BT is not None:
            xBC_BTC = xBC_BTC * mask_BT[..., None]
        if pos_BT is not None:
            from hylo_bench.models.varlen import varlen_causal_conv1d

            xBC_BTC = F.silu(varlen_causal_conv1d(xBC_BTC.transpose(1, 2), self.conv1d.weight, self.conv1d.bias,
                                                  pos_BT)).transpose(1, 2)
            new_conv = None
        else:
            xBC_BTC, new_conv = self._conv(xBC_BTC, state.conv if state is not None else None)
        x_BTX, b_BTX, c_BTE = xBC_BTC.split([X, X, E], dim=-1)
        g = self.repeat_group
        x_BTHP = x_BTX.unflatten(-1, (self.num_xb_groups, N)).repeat_interleave(g, dim=2)
        b_BTHN = b_BTX.unflatten(-1, (self.num_xb_groups, N)).repeat_interleave(g, dim=2)
        c_BTHN = c_BTE.unflatten(-1, (H, N))

        cdt = _math_dtype(hidden_states.dtype)
        dt_BTH = F.softplus(dt_BTH.to(cdt) + self.dt_bias.to(cdt))
        if self.dt_limit != (0.0, math.inf):  # mamba_ssm clamps after the softplus, before the scan
            dt_BTH = dt_BTH.clamp(*self.dt_limit)
        if mask_BT is not None:
            dt_BTH = dt_BTH * mask_BT.to(cdt)[..., None]
        A_H = -torch.exp(self.A_log.to(cdt))
        ssm = state.ssm if state is not None else None
        if pos_BT is not None:  # packed: one flattened row, fla's varlen convention
            y, _ = ssd_scan(x_BTHP.reshape(1, Bsz * T, H, P), dt_BTH.reshape(1, Bsz * T, H), A_H,
                            b_BTHN.reshape(1, Bsz * T, H, N), c_BTHN.reshape(1, Bsz * T, H, N), D=self.D,
                            chunk_size=self.chunk_size, backend=self.backend, cu_seqlens=cu_seqlens)
            y_BTHP = y.view(Bsz, T, H, P)
        elif T == 1:
            y_BHP, ssm = ssd_step(x_BTHP[:, 0], dt_BTH[:, 0], A_H, b_BTHN[:, 0], c_BTHN[:, 0], ssm, D=self.D)
            y_BTHP = y_BHP[:, None]
        else:
            y_BTHP, ssm = ssd_scan(x_BTHP, dt_BTH, A_H, b_BTHN, c_BTHN, D=self.D, initial_state=ssm,
                                   chunk_size=self.chunk_size, backend=self.backend)
        y_BTE = self.norm(y_BTHP.reshape(Bsz, T, E).to(hidden_states.dtype), z_BTE)
        out_BTD = self.out_proj(y_BTE)
        if mask_BT is not None:
            out_BTD = out_BTD * mask_BT[..., None]
        return out_BTD, (Mamba2State(ssm=ssm, conv=new_conv) if use_cache else None)
