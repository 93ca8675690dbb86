"""Multi-head Latent Attention in the released Zebra-Llama / HyLo layout (attribute ``mla``).

Legend: B batch, T new tokens, S keys (cached + new), D hidden, H query heads n_h, G KV heads n_kvm,
N = qk_nope_head_dim, R = qk_rope_head_dim, V = v_head_dim, Rq / Rkv the LoRA ranks.

Forward (checkpoint-format.md §5.1; paper App. A.2.1; Zebra-Llama ``DeepseekV3Attention``):
q = q_b(q_a(x)) -> [B, H, T, N + R]; [c_KV ; k_pe] = kv_a_proj_with_mqa(x) (k_pe one shared head);
[k_nope ; v] = kv_b(c_KV) per KV head, repeated to H heads; optional Qwen3 q/k RMSNorm over the assembled
N + R dims (§4.3 (d), placement flagged); RoPE (with YaRN) on the R dims only; causal softmax attention with
scale 1/sqrt(N + R) (times yarn_mscale(F, mscale_all_dim)^2 when the YaRN dict sets ``mscale_all_dim``,
DeepseekV3's rule); out_proj. Optional latent norms (``use_lora_layer_norm``) use eps 1e-6 as Zebra-Llama's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hylo_bench.config.hybrid import LATENT_NORM_EPS, mla_softmax_scale
from hylo_bench.config.hylo_config import HyLoConfig
from hylo_bench.models.attention import (
    causal_attention,
    left_padded_causal_attention,
    left_padding,
    varlen_causal_attention,
)
from hylo_bench.models.cache import MLALayerCache
from hylo_bench.models.rope import MLARotary, apply_rope_interleaved


class MLA(nn.Module):
    """MLA mixer with the released key names: q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, out_proj.

    Args:
        config: the hybrid config (ranks, head dims, rope settings, ``use_qk_norm``).
        layer_idx: index of the decoder layer (cache slot).
    """

    def __init__(self, config: HyLoConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        q_rank, self.kv_rank = c.mla_ranks(layer_idx)  # per layer with a legacy layer_rank_list
        # 1/sqrt(N + R), times yarn_mscale(F, mscale_all_dim)^2 when the YaRN dict sets mscale_all_dim (DeepseekV3)
        self.scale = mla_softmax_scale(self.qk_dim, c.mla_rope_scaling)
        bias = c.attention_bias
        if q_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, q_rank, bias=bias)
            if c.use_lora_layer_norm:
                self.q_a_layernorm = LlamaRMSNorm(q_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, self.kv_rank + self.rope_dim, bias=bias)
        if c.use_lora_layer_norm:
            self.kv_a_layernorm = LlamaRMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.num_kv_heads * (self.nope_dim + self.v_dim), bias=False)
        self.out_proj = nn.Linear(self.num_heads * self.v_dim, c.hidden_size, bias=bias)
        self.use_qk_norm = c.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = LlamaRMSNorm(self.qk_dim, eps=c.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.qk_dim, eps=c.rms_norm_eps)
        self.rotary = MLARotary(self.rope_dim, c.mla_rope_theta, c.mla_rope_scaling)

    def _queries(self, x: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, D] -> q [B, H, T, N + R]. ``first``: ``q_proj(x)`` / ``q_a_proj(x)`` when already computed (the
        serving engine's merged GEMV)."""
        if first is None:
            first = (self.q_proj if hasattr(self, "q_proj") else self.q_a_proj)(x)
        q = first
        if not hasattr(self, "q_proj"):
            q = self.q_b_proj(self.q_a_layernorm(first) if hasattr(self, "q_a_layernorm") else first)
        return q.unflatten(-1, (self.num_heads, self.qk_dim)).transpose(1, 2)  # [B, H, T, N + R]

    def _expand_kv(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [B, S, Rkv] -> k_nope [B, H, S, N], v [B, H, S, V] (KV heads repeat-interleaved to H)."""
        if hasattr(self, "kv_a_layernorm"):
            c_kv = self.kv_a_layernorm(c_kv)
        kv = self.kv_b_proj(c_kv).unflatten(-1, (self.num_kv_heads, self.nope_dim + self.v_dim)).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k_nope, v = k_nope.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return k_nope, v

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        cache: MLALayerCache | None = None,
        use_cache: bool = False,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MLALayerCache | None]:
        """Attend over the cached and new tokens.

        Args:
            hidden_states: [B, T, D] normalised layer input.
            positions: [B, T] int64 RoPE positions of the new tokens.
            token_mask: [B, T] bool, False at padding (None = all real).
            cache: this layer's cache from earlier calls, or None.
            use_cache: return the updated cache.
            cu_seqlens: [n_docs + 1] int32 offsets of packed documents over the flattened B * T tokens
                (``hylo_bench.models.varlen``): each token attends only to earlier tokens of its own document.
                ``positions`` should then restart per document. Not combinable with a cache or padding.

        Returns:
            ([B, T, D] output, updated cache or None).

        Raises:
            ValueError: ``cu_seqlens`` together with a cache, ``use_cache`` or a padding mask.
        """
        B, T, _ = hidden_states.shape
        if cu_seqlens is not None and (cache is not None or use_cache or token_mask is not None):
            raise ValueError("MLA: packed documents (cu_seqlens) are for training / scoring whole rows; they "
                             "cannot be combined with a KV cache, use_cache or a padding mask")
        q = self._queries(hidden_states)
        latent_new = self.kv_a_proj_with_mqa(hidden_states)  # [B, T, Rkv + R]
        cos, sin = self.rotary.cos_sin(positions, q.dtype)
        mask_new = torch.ones(B, T, dtype=torch.bool, device=q.device) if token_mask is None else token_mask.bool()
        if not self.use_qk_norm:  # store the rope key post-RoPE (checkpoint-format.md §6)
            k_pe = apply_rope_interleaved(latent_new[:, None, :, self.kv_rank:], cos, sin)
            latent_new = torch.cat([latent_new[..., : self.kv_rank], k_pe[:, 0]], dim=-1)
        if cache is not None:
            latent = torch.cat([cache.latent, latent_new], dim=1)
            kmask = torch.cat([cache.mask, mask_new], dim=1)
            kpos = None if cache.positions is None else torch.cat([cache.positions, positions], dim=1)
        else:
            latent, kmask, kpos = latent_new, mask_new, (positions if self.use_qk_norm else None)
        new_cache = MLALayerCache(latent, kmask, kpos) if use_cache else None

        S = latent.shape[1]
        k_nope, v = self._expand_kv(latent[..., : self.kv_rank])
        k_pe = latent[..., self.kv_rank:][:, None].expand(B, self.num_heads, S, self.rope_dim)
        if self.use_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(torch.cat([k_nope, k_pe], dim=-1))
            kcos, ksin = self.rotary.cos_sin(kpos, q.dtype)
            k = torch.cat([k[..., : self.nope_dim], apply_rope_interleaved(k[..., self.nope_dim:], kcos, ksin)], -1)
        else:
            k = torch.cat([k_nope, k_pe], dim=-1)
        q = torch.cat([q[..., : self.nope_dim], apply_rope_interleaved(q[..., self.nope_dim:], cos, sin)], dim=-1)

        if cu_seqlens is not None:
            out = varlen_causal_attention(q, k, v, self.scale, cu_seqlens)
        elif cache is None and token_mask is None:
            out = causal_attention(q, k, v, self.scale)
        elif cache is None and (pads := left_padding(kmask)) is not None:
            out = left_padded_causal_attention(q, k, v, self.scale, pads)
        else:
            past = S - T
            causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=past)
            allowed = causal[None] & kmask[:, None, :]
            diag = torch.arange(T, device=q.device)
            allowed[:, diag, past + diag] = True  # a padded query sees itself: no empty softmax rows
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=self.scale)
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_dim)
        return self.out_proj(out), new_cache
