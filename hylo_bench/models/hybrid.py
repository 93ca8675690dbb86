"""The HyLo hybrid: decoder layers with an MLA or a linear (Gated DeltaNet / Mamba-2) mixer, SwiGLU MLP, RMSNorms.

Legend: B batch, T tokens, D hidden, V vocab.

Layer (paper eq. 15; checkpoint-format.md §4.1): ``h = x + mixer(input_layernorm(x))``,
``out = h + mlp(post_attention_layernorm(h))``. State-dict names follow the released checkpoints:
``model.layers.{i}.mla.*`` for MLA layers, ``model.layers.{i}.gdn.*`` for GDN layers (our canonical name;
the loader also finds a GDN mixer under another attribute by its signature keys), ``model.layers.{i}.mamba.*``
for Mamba-2 layers (Zebra-Llama), untied ``lm_head``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from hylo_bench.config.hybrid import HYBRID_CONFIG_NAME
from hylo_bench.config.hylo_config import HyLoConfig
from hylo_bench.models.cache import HyLoCache
from hylo_bench.models.checkpoint import (
    check_compatible,
    read_tensor_shapes,
    resolve_checkpoint_dir,
    save_hylo,
    warn_bad_weights,
)
from hylo_bench.models.mla import MLA


def build_mixer(config: HyLoConfig, layer_idx: int) -> tuple[str, nn.Module]:
    """(attribute name, module) of layer ``layer_idx``'s token mixer.

    Attribute names: ``mla`` (MLA), ``gdn`` (Gated DeltaNet, our canonical name), ``mamba`` (Mamba-2,
    Zebra-Llama's name; checkpoint-format.md sec. 4.1).

    Raises:
        ValueError: for an unknown mixer type or inconsistent Mamba-2 dims (see ``HyLoConfig.mamba_dims``).
    """
    kind = config.mixer_types[layer_idx]
    if kind == "mla":
        return "mla", MLA(config, layer_idx)
    if kind == "gdn":
        from hylo_bench.models.gdn import GatedDeltaNet

        return "gdn", GatedDeltaNet(hidden_size=config.hidden_size, num_heads=config.gdn_num_heads,
                                    head_dim=config.gdn_head_dim, expand_v=config.gdn_expand_v,
                                    conv_size=config.gdn_conv_size, norm_eps=config.gdn_norm_eps,
                                    layer_idx=layer_idx)
    if kind == "mamba":
        from hylo_bench.models.mamba2 import Mamba2

        return "mamba", Mamba2(**config.mamba_dims(), **config.mamba_options(), layer_idx=layer_idx)
    raise ValueError(f"layer {layer_idx}: unknown mixer type {kind!r}; expected 'mla', 'gdn' or 'mamba'")


class HyLoDecoderLayer(nn.Module):
    """Pre-norm residual block with an MLA, GDN or Mamba-2 mixer and the base model's SwiGLU MLP."""

    def __init__(self, config: HyLoConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_type = config.mixer_types[layer_idx]
        self.mixer_name, mixer = build_mixer(config, layer_idx)
        self.add_module(self.mixer_name, mixer)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, token_mask: torch.Tensor | None,
                state=None, use_cache: bool = False, cu_seqlens: torch.Tensor | None = None):
        """Returns (layer output [B, T, D], mixer output [B, T, D] before the residual add, new state).

        ``cu_seqlens``: packed-document offsets (``hylo_bench.models.varlen``), passed to the mixer.
        """
        x = self.input_layernorm(hidden_states)
        extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        if self.mixer_type == "mla":
            mixed, state = self.mixer(x, positions, token_mask, cache=state, use_cache=use_cache, **extra)
        else:
            mixed, state = self.mixer(x, attention_mask=token_mask, state=state, use_cache=use_cache, **extra)
        h = hidden_states + mixed
        return h + self.mlp(self.post_attention_layernorm(h)), mixed, state


class HyLoPreTrainedModel(PreTrainedModel):
    config_class = HyLoConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HyLoDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, LlamaRMSNorm):
            nn.init.ones_(module.weight)
        elif hasattr(module, "reset_special_parameters"):  # Mamba-2: A_log, dt_bias, D, norm (mamba_ssm defaults)
            module.reset_special_parameters()


class HyLoModel(HyLoPreTrainedModel):
    """Embeddings, decoder layers and the final norm; returns the last hidden state [B, T, D]."""

    def __init__(self, config: HyLoConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HyLoDecoderLayer(config, i) for i in range(config.n_layer))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: HyLoCache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool = False,
                output_hidden_states: bool = False, cu_seqlens: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        """Run the decoder stack.

        Args:
            input_ids: [B, T] token ids (or ``inputs_embeds`` [B, T, D]).
            attention_mask: [B, P + T] 0/1 padding mask over cached and new tokens. Left padding only when caching
                (``use_cache``); right padding is fine without a cache (scoring).
            position_ids: [B, T]; derived from ``attention_mask`` (cumsum - 1) when absent (from ``cu_seqlens``
                when given: restarting at 0 per document).
            past_key_values: a ``HyLoCache`` from an earlier call, or None.
            cu_seqlens: packed documents: int32 [n_docs + 1] offsets into the flattened B * T tokens, every row
                start a document start (``hylo_bench.models.varlen``). MLA attends within a document only, GDN
                and Mamba-2 restart their conv and recurrent state at each document, so every document's outputs
                equal a separate run. Packing is NOT inferred from ``position_ids``; pass this explicitly
                (e.g. ``cu_seqlens_from_position_ids(position_ids)``).

        Raises:
            ValueError: ``cu_seqlens`` with a cache, ``use_cache`` or a padding mask, or invalid offsets;
                ``use_cache`` with an ``attention_mask`` that has padding after a real token (right padding).
        """
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T, _ = inputs_embeds.shape
        if cu_seqlens is not None:
            from hylo_bench.models.varlen import check_packed, position_ids_from_cu_seqlens

            if use_cache or past_key_values is not None:
                raise ValueError("cu_seqlens (packed documents) is for training / scoring; it cannot be combined "
                                 "with past_key_values or use_cache")
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                raise ValueError("cu_seqlens (packed documents) cannot be combined with padding in attention_mask; "
                                 "packed rows have no padding")
            attention_mask = None
            check_packed(cu_seqlens, B, T)
            cu_seqlens = cu_seqlens.to(device=inputs_embeds.device, dtype=torch.int32)
            if position_ids is None:
                position_ids = position_ids_from_cu_seqlens(cu_seqlens, B, T)
        if use_cache and not isinstance(past_key_values, HyLoCache):
            if past_key_values is not None and past_key_values.get_seq_length() > 0:
                raise ValueError("HyLo models need a HyLoCache; got a non-empty "
                                 f"{type(past_key_values).__name__}")
            past_key_values = HyLoCache(num_layers=self.config.n_layer)
        past = past_key_values.seen_tokens if isinstance(past_key_values, HyLoCache) else 0
        if use_cache and attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] > 1:
            real = attention_mask.bool()
            if bool((real[:, :-1] & ~real[:, 1:]).any()):  # a real token followed by padding
                raise ValueError(
                    "use_cache with right (or inner) padding in attention_mask is not supported: the GDN / Mamba-2 "
                    "conv states would end in padding and the next positions would be off, so decoding from that "
                    "cache is wrong. Pad on the left (tokenizer.padding_side = 'left', as generate() expects), or "
                    "score right-padded batches without use_cache")
        token_mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            token_mask = attention_mask[:, -T:].bool()
            if bool(token_mask.all()) and past == 0:
                token_mask = None
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(past, past + T, device=inputs_embeds.device).expand(B, T)
        if token_mask is None and isinstance(past_key_values, HyLoCache) and past > 0:
            token_mask = torch.ones(B, T, dtype=torch.bool, device=inputs_embeds.device)

        hidden = inputs_embeds
        all_hidden = [hidden] if output_hidden_states else None
        for i, layer in enumerate(self.layers):
            state = past_key_values.layers_state[i] if isinstance(past_key_values, HyLoCache) else None
            if self.gradient_checkpointing and self.training:
                hidden, _, state = checkpoint(layer, hidden, position_ids, token_mask, state, use_cache,
                                              cu_seqlens=cu_seqlens, use_reentrant=False)
            else:
                hidden, _, state = layer(hidden, position_ids, token_mask, state, use_cache, cu_seqlens=cu_seqlens)
            if use_cache:
                past_key_values.layers_state[i] = state
            if output_hidden_states:
                all_hidden.append(hidden)
        hidden = self.norm(hidden)
        if use_cache:
            past_key_values.seen_tokens += T
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values if use_cache
                                       else None, hidden_states=tuple(all_hidden) if all_hidden else None)


class HyLoForCausalLM(HyLoPreTrainedModel, GenerationMixin):
    """HyLo hybrid language model with an untied ``lm_head`` (checkpoint-format.md §4.3 (a)).

    ``save_pretrained`` / ``from_pretrained`` use the released layout (``config.json`` = base config,
    ``hybrid_config.json``, ``model.safetensors``): see :mod:`hylo_bench.models.checkpoint`.
    """

    _tied_weights_keys: dict = {}

    def __init__(self, config: HyLoConfig):
        super().__init__(config)
        self.model = HyLoModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: HyLoCache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                logits_to_keep: int = 0, cu_seqlens: torch.Tensor | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        """Logits [B, T, V] (the last ``logits_to_keep`` positions when > 0) and the shifted CE loss.

        Args:
            labels: [B, T] next-token targets aligned with ``input_ids`` (shifted inside), -100 = ignore. With
                ``cu_seqlens`` the last token of a document does not predict the next document's first token
                (that target is ignored, as ``DataCollatorWithFlattening`` does).
            cu_seqlens: packed-document offsets, see :meth:`HyLoModel.forward`.
        """
        use_cache = bool(use_cache) if use_cache is not None else False
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=bool(output_hidden_states), cu_seqlens=cu_seqlens)
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            if cu_seqlens is not None:
                starts = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
                starts[cu_seqlens[:-1].to(device=labels.device, dtype=torch.long)] = True
                labels = labels.masked_fill(starts.view_as(labels), -100)
            flat = logits[:, :-1].flatten(0, 1)
            flat = flat.float() if flat.dtype in (torch.bfloat16, torch.float16) else flat
            loss = F.cross_entropy(flat, labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, past_key_values=None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool = True,
                                      **kwargs) -> dict:
        """Feed only the tokens the cache has not seen; positions come from ``attention_mask``."""
        seen = past_key_values.seen_tokens if isinstance(past_key_values, HyLoCache) else 0
        return {"input_ids": input_ids[:, seen:], "attention_mask": attention_mask,
                "past_key_values": past_key_values if isinstance(past_key_values, HyLoCache) else None,
                "use_cache": use_cache, "logits_to_keep": 1}

    def save_pretrained(self, save_directory, **kwargs) -> None:  # noqa: D102 - see checkpoint.save_hylo
        save_hylo(self, save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, dtype: torch.dtype | None = torch.bfloat16,
                        device: str | torch.device = "cpu", **kwargs) -> "HyLoForCausalLM":
        """Load a HyLo checkpoint (local dir, hub id or HF cache), strictly; fp32 weights cast to ``dtype``.

        See :func:`load_hylo` for the errors raised.
        """
        return load_hylo(pretrained_model_name_or_path, dtype=dtype, device=device)


def load_hylo(spec: str | Path, dtype: torch.dtype | None = torch.bfloat16, device: str | torch.device = "cpu"):
    """Load a HyLo checkpoint strictly.

    Args:
        spec: local directory, ``demo`` or hub id (see :func:`resolve_checkpoint_dir`).
        dtype: parameter dtype (released weights are fp32; default bf16 as the cards say). None keeps the
            stored dtype.
        device: where the weights go.

    Raises:
        FileNotFoundError: missing config/weights. ValueError: bad config (file and key named).
        CheckpointMismatchError: missing/unexpected/mis-shaped tensors (all listed, before loading data).
    """
    d = resolve_checkpoint_dir(spec)
    if not (d / HYBRID_CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{d}: no {HYBRID_CONFIG_NAME}; this is not a HyLo checkpoint (a plain "
                                f"transformers model loads with hylo_bench.models.loading.load_model)")
    config = HyLoConfig.from_directory(d)
    with torch.device("meta"):
        model = HyLoForCausalLM(config)
    stored = read_tensor_shapes(d)
    mapping = check_compatible(model, stored, str(d))
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for src, dst in mapping.items():
        real = src.removesuffix("#tied")
        by_file.setdefault(stored[real][1], []).append((real, dst))
    state = {}
    for f, pairs in by_file.items():  # each file is opened (or unpickled) once
        if f.suffix == ".bin":
            whole = torch.load(f, map_location="cpu", weights_only=True)
            tensors = {dst: whole[real] for real, dst in pairs}
        else:
            with safe_open(f, framework="pt", device="cpu") as fh:
                tensors = {dst: fh.get_tensor(real) for real, dst in pairs}
        for dst, t in tensors.items():
            keep_fp32 = dst.endswith(("A_log", "dt_bias"))  # fla/mamba_ssm keep the gate parameters in fp32
            target = torch.float32 if keep_fp32 and dtype is not None else dtype
            state[dst] = t.to(device=device, dtype=target or t.dtype)
    if "model.embed_tokens.weight#tied" in mapping:
        # A tied export: the (untied) head starts as its own copy of the embedding, so the two train apart and
        # save as two tensors (one shared storage would make safetensors refuse to save).
        state["lm_head.weight"] = state["lm_head.weight"].clone()
    model.load_state_dict(state, strict=True, assign=True)
    model.eval()
    warn_bad_weights(d, model)
    return model
