"""Inference cache of a HyLo hybrid: MLA latents per MLA layer, recurrent + conv states per linear layer.

Legend: B batch, T cached tokens, R_kv = kv_lora_rank, R = qk_rope_head_dim.

Per MLA layer and token the cache holds R_kv + R elements (checkpoint-format.md §6): the KV latent c_KV and
the shared rope key. Without Qwen3 q/k norms the rope key is stored after RoPE (as Zebra-Llama's inference
stack does); with q/k norms the key norm needs k_nope first, so the raw rope key is stored together with the
token positions (one int per token) and RoPE is applied when the keys are rebuilt.
Linear layers keep a fixed-size state, independent of T: ``GDNState`` (recurrent + q/k/v conv inputs) for GDN
layers, ``Mamba2State`` (SSM state [B, H, P, N] + [x | B | C] conv inputs) for Mamba-2 layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache


@dataclass
class MLALayerCache:
    """Latent cache of one MLA layer.

    Attributes:
        latent: [B, T, R_kv + R] c_KV followed by the rope key (post-RoPE unless ``positions`` is kept).
        positions: [B, T] int64 token positions, only kept when keys are stored pre-RoPE (q/k-norm models).
        mask: [B, T] bool, True where the cached token is real (False for left padding).
    """

    latent: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor | None = None


@dataclass
class HyLoCache(Cache):
    """Cache for ``HyLoForCausalLM.generate``: one slot per layer (``MLALayerCache`` or a linear-layer state).

    Subclasses ``transformers.Cache`` so ``generate()`` accepts it; storage is our own.
    """

    num_layers: int
    layers_state: list[Any] = field(default_factory=list)
    seen_tokens: int = 0

    def __post_init__(self) -> None:
        super().__init__(layers=[])
        if not self.layers_state:
            self.layers_state = [None] * self.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of token positions already processed (including padding positions)."""
        return self.seen_tokens

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return self.num_layers

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select batch rows (beam search)."""
        for i, st in enumerate(self.layers_state):
            if st is None:
                continue
            if isinstance(st, MLALayerCache):
                self.layers_state[i] = MLALayerCache(
                    st.latent.index_select(0, beam_idx), st.mask.index_select(0, beam_idx),
                    None if st.positions is None else st.positions.index_select(0, beam_idx))
            else:
                self.layers_state[i] = map_state(st, lambda t: t.index_select(0, beam_idx))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held per kind: ``{"mla_latent": ..., "linear_state": ...}``."""
        out = {"mla_latent": 0, "linear_state": 0}
        for st in self.layers_state:
            if st is None:
                continue
            if isinstance(st, MLALayerCache):
                out["mla_latent"] += st.latent.numel() * st.latent.element_size()
            else:
                sizes: list[int] = []
                map_state(st, lambda t: sizes.append(t.numel() * t.element_size()) or t)
                out["linear_state"] += sum(sizes)
        return out


def map_state(state: Any, fn) -> Any:
    """Apply ``fn`` to every tensor of a linear-layer state dataclass (tensors or tuples of tensors)."""
    import dataclasses

    kwargs = {}
    for f in dataclasses.fields(state):
        v = getattr(state, f.name)
        if isinstance(v, torch.Tensor):
            v = fn(v)
        elif isinstance(v, tuple):
            v = tuple(fn(t) if isinstance(t, torch.Tensor) else t for t in v)
        kwargs[f.name] = v
    return type(state)(**kwargs)
