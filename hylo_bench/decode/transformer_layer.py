"""A plain transformers Llama / Qwen3 model's own decoder layers over the engine's preallocated K/V cache (the
baseline :class:`hylo_bench.decode.engine.TransformerEngine`), as gpt-fast's ``KVCache``: the layers run
unchanged (norms, projections, Qwen3 q/k norms, RoPE, MLP, residuals); the cache object they are handed writes
each chunk's keys and values in place and returns the filled prefix, and the attention function the model is
switched to attends a chunk over that prefix (:func:`hylo_bench.kernels.prefix_attention.prefix_attention`:
lower-right causal mask, GQA without repeating K/V heads; cuDNN or flash on GPU).

Both go through transformers' public extension points: the layers call ``past_key_values.update(k, v,
layer_idx)``, and ``AttentionInterface.register`` + ``model.set_attn_implementation`` select the attention
function (with SDPA's mask builder under the same name). Called without the engine's marker keyword (any other
caller of the model), that function is transformers' SDPA attention, so the model keeps working outside the
engine, padding masks included.

Legend: B batch, G K/V heads, Tm max context, d head dim.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hylo_bench.kernels.prefix_attention import prefix_attention

ATTENTION_NAME = "hylo_prefix_sdpa"
START_KWARG = "hylo_prefix_start"  # the engine's marker: tokens already cached before this chunk


def _prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: q [B, H, T, d], k / v [B, G, S, d] -> ([B, T, H, d], None)."""
    start = kwargs.pop(START_KWARG, None)
    if start is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kwargs)
    out = prefix_attention(query, key, value, scaling, start)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION_NAME, _prefix_attention)
# transformers builds no mask at all for an attention name without a registered mask function, so the SDPA
# fallback would ignore padding (a left-padded generate() decodes garbage): give it SDPA's mask.
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def use_prefix_attention(model) -> None:
    """Switch ``model`` (a transformers causal LM) to the engine's attention function (in place)."""
    model.set_attn_implementation(ATTENTION_NAME)


class PrefixKVCache:
    """Preallocated K/V cache, one [max_batch, G, max_context, d] pair per layer (bf16 on GPU: L * 2 * G * d * 2
    bytes per token, the backbone row of ``hylo-bench kv``).

    Set ``start`` (tokens already cached) and ``batch`` before each forward; ``update`` writes the chunk's keys
    and values at ``start`` and returns the filled prefix views [batch, G, start + T, d].
    """

    def __init__(self, num_layers: int, max_batch: int, kv_heads: int, max_context: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (max_batch, kv_heads, max_context, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.start, self.batch = 0, max_batch

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """k, v [B, G, T, d] of the new tokens -> (keys, values) [B, G, start + T, d] of the whole prefix."""
        B, T = key_states.shape[0], key_states.shape[-2]
        end = self.start + T
        self.keys[layer_idx][:B, :, self.start:end] = key_states
        self.values[layer_idx][:B, :, self.start:end] = value_states
        return self.keys[layer_idx][:B, :, :end], self.values[layer_idx][:B, :, :end]

    def tensors(self) -> list[torch.Tensor]:
        return self.keys + self.values
