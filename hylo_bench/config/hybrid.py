"""HyLo configuration fields, in plain Python: the layer plan and mixer dimensions of a hybrid
(``hybrid_config.json``). No torch or transformers import, so ``hylo-bench info`` / ``kv`` stay instant;
:class:`hylo_bench.config.hylo_config.HyLoConfig` is the same fields bound to transformers' ``PretrainedConfig``.

A released HyLo checkpoint directory holds two configs (checkpoint-format.md §2-3):

* ``config.json``: the *student base model's* HF config (Llama / Qwen3), kept as reference. We read only
  vocab size, norm eps, activation, RoPE base and token ids from it.
* ``hybrid_config.json``: the Zebra-Llama ``HybridConfig`` fields plus the HyLo GDN additions.

:class:`HybridSpec` (the one hybrid config class) holds both in one object; ``HyLoConfig``
(``config/hylo_config.py``) mixes it into a transformers ``PretrainedConfig`` so ``HyLoForCausalLM`` can be a
``PreTrainedModel``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from pathlib import Path
from typing import Any

from hylo_bench.io_utils import read_text_utf8

logger = logging.getLogger(__name__)

HYBRID_CONFIG_NAME = "hybrid_config.json"
BASE_CONFIG_NAME = "config.json"

# hybrid_config.json as Zebra-Llama's ``HybridConfig`` dataclass writes it (``asdict``, field order;
# Zebra-Llama/hybrid/hybrid_config.py, checkpoint-format.md sec. 3.1). ``HybridConfig(**json)`` rejects any other key.
ZEBRA_KEYS = (
    "hidden_size", "intermediate_size", "hidden_act", "n_layer", "mla_layers", "rms_norm_eps",
    "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "use_lora_layer_norm",
    "use_full_kv_head", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qkv_rank_divisor",
    "max_position_embeddings", "rope_theta", "rope_scaling", "attention_bias", "attention_dropout", "rope_type",
    "d_model", "ssm_cfg", "d_inner", "d_xb",
)
HYLO_GDN_KEYS = ("gdn_num_heads", "gdn_head_dim")
"""The HyLo additions of the model cards, written for GDN models only (checkpoint-format.md sec. 3.2)."""
EXTRA_KEYS = ("linear_type", "use_qk_norm", "gdn_expand_v", "gdn_conv_size", "gdn_norm_eps")
"""Our facts that the released schema has no key for. Written to ``config.json`` under :data:`EXTRAS_KEY` (the
reference builds a ``LlamaConfig(**config_json)``, which keeps unknown keys); read from there or, in files
hylo-bench wrote before, from ``hybrid_config.json``."""
EXTRAS_KEY = "hylo_bench"
# Keys of hybrid_config.json that we read into the config (rope_type is handled on its own).
HYBRID_KEYS = tuple(k for k in ZEBRA_KEYS if k != "rope_type") + HYLO_GDN_KEYS + EXTRA_KEYS + ("layer_rank_list",)
MLA_REQUIRED_KEYS = ["num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                     "qk_nope_head_dim", "v_head_dim"]
_NUM = (int, float)
KEY_TYPES: dict[str, Any] = {
    "hidden_size": int, "intermediate_size": int, "n_layer": int, "mla_layers": list, "num_attention_heads": int,
    "num_key_value_heads": int, "kv_lora_rank": int, "q_lora_rank": int, "qk_rope_head_dim": int,
    "qk_nope_head_dim": int, "v_head_dim": int, "qkv_rank_divisor": int, "max_position_embeddings": int,
    "gdn_num_heads": int, "gdn_head_dim": int, "gdn_conv_size": int, "rms_norm_eps": _NUM, "rope_theta": _NUM,
    "gdn_expand_v": _NUM, "gdn_norm_eps": _NUM, "attention_dropout": _NUM, "rope_scaling": dict,
    "use_lora_layer_norm": bool, "use_full_kv_head": bool, "attention_bias": bool, "use_qk_norm": bool,
    "linear_type": str, "hidden_act": str, "ssm_cfg": dict, "d_model": int, "d_inner": int, "d_xb": int,
    "layer_rank_list": dict,
}
NULLABLE_KEYS = {"q_lora_rank", "rope_scaling", "d_inner", "d_xb", "d_model"}
_ATTR_FOR_KEY = {"rope_theta": "mla_rope_theta", "rope_scaling": "mla_rope_scaling"}
# Keys older Zebra-Llama / X-EcoMLA configs carry that we accept and ignore (checkpoint-format.md §8);
# ``layer_rank_list`` is honoured (per-layer MLA ranks).
LEGACY_KEYS = ("rope_type", "use_fixed_rank_for_first_and_last_block", "layer_rank_list", "q_energy_ratio",
               "kv_energy_ratio")

LATENT_NORM_EPS = 1e-6
"""eps of the MLA latent norms ``q_a_layernorm`` / ``kv_a_layernorm`` (``use_lora_layer_norm``): Zebra-Llama builds
them as ``DeepseekV3RMSNorm(rank)`` with its default eps 1e-6, not ``rms_norm_eps``
(``hybrid/mla/hybrid_mla_layer.py``)."""

# ssm_cfg keys (Zebra-Llama hybrid_mamba2_layer.Mamba2 keyword arguments) and, for those whose other values are not
# implemented, the one value that is.
_SSM_CFG_KEYS = ("expand", "ngroups", "d_state", "d_conv", "repeat_kv_before_conv", "d_ssm", "headdim",
                 "norm_before_gate", "dt_limit", "dt_min", "dt_max", "dt_init_floor", "A_init_range", "conv_init",
                 "chunk_size", "use_mem_eff_path", "D_has_hdim", "rmsnorm", "bias", "conv_bias")
_SSM_CFG_FIXED = {"D_has_hdim": False, "rmsnorm": True, "bias": False, "conv_bias": True,
                  "repeat_kv_before_conv": False}

# Released HyLo MLA placements, keyed by (n_layer, n_mla) (checkpoint-format.md §3.4; paper Table 7).
RELEASED_MLA_LAYERS: dict[tuple[int, int], list[int]] = {
    (16, 4): [1, 5, 10, 14],
    (16, 8): [0, 2, 4, 6, 8, 10, 12, 14],
    (28, 6): [0, 5, 10, 16, 21, 26],
    (28, 14): list(range(0, 28, 2)),
    (28, 7): [1, 5, 9, 13, 17, 21, 25],
}


def default_mla_layers(n_layer: int, n_mla: int) -> list[int]:
    """Default MLA placement for ``n_mla`` of ``n_layer`` layers.

    Uses the released HyLo list when (n_layer, n_mla) matches a released layout (paper Table 7), otherwise
    spreads the MLA layers uniformly: index ``floor(stride * (i + 0.5))`` with ``stride = n_layer / n_mla``.

    Raises:
        ValueError: if ``n_mla`` is not in ``[0, n_layer]``.
    """
    if not 0 <= n_mla <= n_layer:
        raise ValueError(f"layout asks for {n_mla} MLA layers but the model has {n_layer} layers")
    if (n_layer, n_mla) in RELEASED_MLA_LAYERS:
        return list(RELEASED_MLA_LAYERS[(n_layer, n_mla)])
    if n_mla == 0:
        return []
    stride = n_layer / n_mla
    return [int(math.floor(stride * (i + 0.5))) for i in range(n_mla)]


def parse_layout(layout: str, n_layer: int) -> tuple[list[int], str]:
    """Parse a layout name such as ``7MLA21GDN`` or ``14MLA14M2`` into (mla_layers, linear_type).

    Raises:
        ValueError: on a malformed name or when the counts do not add up to ``n_layer``.
    """
    import re

    m = re.fullmatch(r"(\d+)MLA(\d+)(GDN|M2)", layout.strip(), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"--layout {layout!r}: expected '<n>MLA<m>GDN' or '<n>MLA<m>M2', e.g. '7MLA21GDN'")
    n_mla, n_lin, kind = int(m.group(1)), int(m.group(2)), m.group(3).upper()
    if n_mla + n_lin != n_layer:
        raise ValueError(f"--layout {layout!r} has {n_mla}+{n_lin}={n_mla + n_lin} layers; the base model has "
                         f"{n_layer}")
    return default_mla_layers(n_layer, n_mla), ("gdn" if kind == "GDN" else "mamba")


POSITIVE_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings")


def read_hf_config(d: Path, flag: str) -> dict[str, Any]:
    """A checkpoint's ``config.json``, checked as far as a model build depends on it.

    Raises:
        FileNotFoundError: no ``config.json``. ValueError: not UTF-8, not a JSON object, or a size key (hidden_size,
            num_hidden_layers, ...) that is not a positive integer (file, key and value named).
    """
    path = d / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {d}: no config.json; expected a Llama / Qwen3 checkpoint directory "
                                f"(config.json, weights, tokenizer files)")
    try:
        cfg = json.loads(read_text_utf8(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    for key in POSITIVE_CONFIG_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{path}: {key} = {value!r}; expected a positive integer")
    if not isinstance(cfg.get("model_type"), str):
        raise ValueError(f"{path}: model_type = {cfg.get('model_type')!r}; expected the model family, e.g. 'llama'")
    return cfg


class HybridSpec:
    """THE configuration of a HyLo hybrid (MLA + Gated DeltaNet / Mamba-2 layers): fields, one validation, and
    ``hybrid_config.json`` / ``config.json`` I/O (``from_dicts`` / ``from_directory`` / ``to_hybrid_dict`` /
    ``to_base_dict``), in plain Python (no torch or transformers import: what ``hylo-bench info`` / ``kv`` use).
    :class:`hylo_bench.config.hylo_config.HyLoConfig` is its transformers binding (the same class mixed into a
    ``PretrainedConfig``, for ``HyLoForCausalLM``); ``tests/test_info.py`` checks both write the same files for
    every shipped recipe.

    Field names follow Zebra-Llama's ``HybridConfig`` (``hybrid_config.json``) and HF (``config.json``).
    Every layer whose index is not in ``mla_layers`` is a linear layer of type ``linear_type``.

    Args (main ones):
        vocab_size: V, from the base ``config.json``.
        hidden_size: H. intermediate_size: I (SwiGLU). n_layer: L (alias ``num_hidden_layers``).
        mla_layers: 0-based indices of MLA layers.
        num_attention_heads: MLA query heads n_h. num_key_value_heads: KV heads n_kvm produced by kv_b_proj.
        kv_lora_rank, q_lora_rank: r_kv, r_q (multiples of ``qkv_rank_divisor``).
        qk_rope_head_dim, qk_nope_head_dim, v_head_dim: d_R, d_N, d_V.
        rope_theta, rope_scaling: RoPE base and YaRN dict for the MLA rope dims (checkpoint-format.md §5.3).
        linear_type: ``"gdn"`` or ``"mamba"``. gdn_num_heads, gdn_head_dim: GDN heads h and key head dim K
            (value head dim = ``gdn_expand_v * K``).
        use_qk_norm: Qwen3 q/k RMSNorms inside MLA layers (checkpoint-format.md §4.3 (d)).
        base_model_type: ``model_type`` of the base ``config.json`` ("llama", "qwen3").
        base_num_key_value_heads, base_head_dim: n_kv and d_h of the base attention (KV-cache % reference).
        base_config: the base ``config.json`` dict, written back verbatim on save.
        layer_rank_list: legacy per-layer MLA ranks ``{"<layer>": {"q_rank": r_q, "kv_rank": r_kv}}``
            (Zebra-Llama before ``c33ccff``, X-EcoMLA; checkpoint-format.md sec. 8), see :meth:`mla_ranks`.

    Raises:
        ValueError: on inconsistent values (rank not a multiple of the divisor, heads not divisible, a layer
            index out of range, unknown linear type).
    """

    def __init__(self, **kwargs: Any) -> None:
        rest = self._set_fields(**kwargs)
        self.tie_word_embeddings = bool(rest.pop("tie_word_embeddings", False))
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(self, k, rest.pop(k, None))
        self.extra = rest
        self._validate()

    def _set_fields(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        intermediate_size: int = 8192,
        hidden_act: str = "silu",
        n_layer: int | None = None,
        num_hidden_layers: int | None = None,
        mla_layers: list[int] | None = None,
        rms_norm_eps: float = 1e-5,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        kv_lora_rank: int = 128,
        q_lora_rank: int | None = 1536,
        use_lora_layer_norm: bool = False,
        use_full_kv_head: bool = False,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        qk_nope_head_dim: int = 128,
        qkv_rank_divisor: int = 8,
        max_position_embeddings: int = 4096,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        linear_type: str = "gdn",
        gdn_num_heads: int = 6,
        gdn_head_dim: int = 256,
        gdn_expand_v: float = 2,
        gdn_conv_size: int = 4,
        gdn_norm_eps: float = 1e-5,
        use_qk_norm: bool = False,
        d_model: int | None = None,
        ssm_cfg: dict | None = None,
        d_inner: int | None = None,
        d_xb: int | None = None,
        layer_rank_list: dict | None = None,
        base_model_type: str = "llama",
        base_num_key_value_heads: int | None = None,
        base_head_dim: int | None = None,
        base_config: dict | None = None,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Set every hybrid field from keyword arguments; returns the keywords it does not own (token ids,
        ``tie_word_embeddings``, HF keys) for the caller."""
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        n = n_layer if n_layer is not None else num_hidden_layers
        self.n_layer = int(n if n is not None else 32)
        self.mla_layers = sorted(int(i) for i in (mla_layers or []))
        self.rms_norm_eps = rms_norm_eps
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if use_full_kv_head else num_key_value_heads
        self.kv_lora_rank = kv_lora_rank
        self.q_lora_rank = q_lora_rank
        self.use_lora_layer_norm = use_lora_layer_norm
        self.use_full_kv_head = use_full_kv_head
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qkv_rank_divisor = qkv_rank_divisor
        self.max_position_embeddings = max_position_embeddings
        # Stored under mla_* names: transformers' PretrainedConfig rewrites attributes named rope_theta /
        # rope_scaling into its own rope_parameters format. They are written back under the released names.
        self.mla_rope_theta = float(rope_theta)
        self.mla_rope_scaling = normalize_rope_scaling(rope_scaling)
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.linear_type = linear_type
        self.gdn_num_heads = gdn_num_heads
        self.gdn_head_dim = gdn_head_dim
        self.gdn_expand_v = gdn_expand_v
        self.gdn_conv_size = gdn_conv_size
        self.gdn_norm_eps = gdn_norm_eps
        self.use_qk_norm = use_qk_norm
        self.d_model = d_model if d_model is not None else hidden_size
        self.ssm_cfg = dict(ssm_cfg or {})
        self.d_inner = d_inner
        self.d_xb = d_xb
        self.layer_rank_list = copy.deepcopy(layer_rank_list) if layer_rank_list else {}
        self.base_model_type = base_model_type
        self.base_num_key_value_heads = base_num_key_value_heads or num_key_value_heads
        self.base_head_dim = base_head_dim or (hidden_size // num_attention_heads)
        self.base_config = dict(base_config or {})
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.mlp_bias = False  # SwiGLU without biases (Llama, Qwen3)
        kwargs.pop("num_hidden_layers", None)
        return kwargs

    # HF code (generate, caches) looks for num_hidden_layers.
    @property
    def num_hidden_layers(self) -> int:
        return self.n_layer

    @num_hidden_layers.setter
    def num_hidden_layers(self, value: int) -> None:
        self.n_layer = int(value)

    @property
    def mixer_types(self) -> list[str]:
        """Per-layer mixer type, e.g. ``["gdn", "mla", "gdn", ...]`` (``"mamba"`` for Mamba-2 layers)."""
        mla = set(self.mla_layers)
        return ["mla" if i in mla else self.linear_type for i in range(self.n_layer)]

    @property
    def qk_head_dim(self) -> int:
        """d_qk = d_N + d_R, the per-head query/key width inside MLA."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def gdn_value_head_dim(self) -> int:
        """GDN value head dim Vd = expand_v * K (fla ``GatedDeltaNet``)."""
        return int(self.gdn_head_dim * self.gdn_expand_v)

    def mla_ranks(self, layer_idx: int) -> tuple[int | None, int]:
        """(q_lora_rank, kv_lora_rank) of MLA layer ``layer_idx``.

        Without a ``layer_rank_list``: the top-level ranks. With one: the entry of the layer, or else of the
        nearest earlier MLA layer that has one (Zebra-Llama's ``DeepseekV3Attention`` writes each entry into the
        shared config as it builds the layers in order, so a layer without an entry keeps the previous one's
        ranks), or else the top-level ranks.
        """
        ranks = (self.q_lora_rank, self.kv_lora_rank)
        for i in self.mla_layers:
            if i > layer_idx:
                break
            entry = self.layer_rank_list.get(str(i))
            if entry is not None:
                ranks = (entry["q_rank"], entry["kv_rank"])
        return ranks

    def mamba_dims(self) -> dict[str, int]:
        """Mamba-2 mixer dims: ``hidden_size, d_inner, d_xb, ngroups, d_state, d_conv`` (checkpoint-format.md sec. 3.1).

        Read from ``ssm_cfg`` / ``d_inner`` / ``d_xb`` when present, else the Zebra-Llama convention:
        ngroups = n_h, d_state = d_h (base head dim), d_inner = ngroups * d_state, d_xb = n_kv * d_state
        (n_kv of the base model), d_conv = 4. Released Qwen3-1.7B: 2048, 1024, 16, 128.

        Raises:
            ValueError: on ``repeat_kv_before_conv: true`` (not a released layout; not implemented), on
                ``d_model`` != ``hidden_size``, or on dims that break d_inner = ngroups * d_state /
                d_xb = n_kv * d_state with n_kv dividing ngroups.
        """
        cfg = self.ssm_cfg
        if cfg.get("repeat_kv_before_conv"):
            raise ValueError("hybrid config ssm_cfg.repeat_kv_before_conv = true is not supported (every released "
                             "Zebra-Llama / HyLo layout uses false: x and B are repeated after the conv)")
        if self.d_model != self.hidden_size:
            raise ValueError(f"hybrid config key 'd_model' = {self.d_model} must equal hidden_size = "
                             f"{self.hidden_size}")
        ngroups = int(cfg.get("ngroups") or self.num_attention_heads)
        d_state = int(cfg.get("d_state") or self.base_head_dim)
        d_inner = int(self.d_inner or ngroups * d_state)
        d_xb = int(self.d_xb or self.base_num_key_value_heads * d_state)
        if d_inner != ngroups * d_state:
            raise ValueError(f"hybrid config: d_inner = {d_inner} must equal ssm_cfg.ngroups * ssm_cfg.d_state = "
                             f"{ngroups} * {d_state} (Mamba-2 heads of d_state dims, checkpoint-format.md sec. 4.5)")
        if d_xb % d_state or ngroups % (d_xb // d_state):
            raise ValueError(f"hybrid config: d_xb = {d_xb} must be n_kv * d_state (d_state {d_state}) with n_kv "
                             f"dividing ssm_cfg.ngroups = {ngroups}")
        return dict(hidden_size=self.hidden_size, d_inner=d_inner, d_xb=d_xb, ngroups=ngroups, d_state=d_state,
                    d_conv=int(cfg.get("d_conv", 4)))

    def mamba_options(self) -> dict[str, Any]:
        """Mamba-2 behaviour options read from ``ssm_cfg`` (Zebra-Llama / mamba_ssm ``Mamba2`` keyword names),
        as :class:`hylo_bench.models.mamba2.Mamba2` keyword arguments: ``norm_before_gate``, ``dt_limit`` and,
        when set, the initialisation options ``dt_min``, ``dt_max``, ``dt_init_floor``, ``A_init_range``,
        ``conv_init``.

        Accepted without effect (no effect on the outputs in the reference either): ``expand`` (d_inner is
        given), ``headdim`` (the reference overrides it with d_state), ``chunk_size`` and ``use_mem_eff_path``
        (kernel choices). ``ngroups``, ``d_state``, ``d_conv``, ``repeat_kv_before_conv`` and ``d_ssm`` are
        dimensions (:meth:`mamba_dims`).

        Raises:
            ValueError: an unknown ``ssm_cfg`` key, or a value whose effect is not implemented (``D_has_hdim``
                true, ``rmsnorm`` false, ``bias`` true, ``conv_bias`` false, ``d_ssm`` != d_inner), or a bad
                ``dt_limit`` (checkpoint-format.md sec. 3.1, 4.5).
        """
        cfg = dict(self.ssm_cfg)
        unknown = sorted(set(cfg) - set(_SSM_CFG_KEYS))
        if unknown:
            raise ValueError(f"hybrid config ssm_cfg has unknown key(s) {unknown}; accepted: {list(_SSM_CFG_KEYS)}")
        for key, released in _SSM_CFG_FIXED.items():
            if key in cfg and cfg[key] != released:
                raise ValueError(f"hybrid config ssm_cfg.{key} = {cfg[key]!r} is not supported (only {released!r}, "
                                 f"the Zebra-Llama / HyLo value, is implemented)")
        if cfg.get("d_ssm") is not None and int(cfg["d_ssm"]) != self.mamba_dims()["d_inner"]:
            raise ValueError(f"hybrid config ssm_cfg.d_ssm = {cfg['d_ssm']} must equal d_inner = "
                             f"{self.mamba_dims()['d_inner']} (Zebra-Llama asserts it; a partial SSM is not supported)")
        out: dict[str, Any] = {"norm_before_gate": bool(cfg.get("norm_before_gate", False))}
        if not isinstance(cfg.get("norm_before_gate", False), bool):  # a bad file: ValueError as for every key
            raise ValueError(  # noqa: TRY004
                f"hybrid config ssm_cfg.norm_before_gate should be true or false, got {cfg['norm_before_gate']!r}")
        limit = cfg.get("dt_limit", (0.0, math.inf))
        if (not isinstance(limit, (list, tuple)) or len(limit) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit)
                or not 0 <= limit[0] < limit[1]):
            raise ValueError(f"hybrid config ssm_cfg.dt_limit should be [min, max] with 0 <= min < max, got "
                             f"{limit!r}")
        out["dt_limit"] = (float(limit[0]), float(limit[1]))
        for key in ("dt_min", "dt_max", "dt_init_floor", "conv_init"):
            if cfg.get(key) is not None:
                out[key] = float(cfg[key])
        if cfg.get("A_init_range") is not None:
            out["A_init_range"] = tuple(float(v) for v in cfg["A_init_range"])
        return out

    def _positive_sizes(self) -> None:
        """Sizes a model is built from must be positive (``info`` once printed -1,632,756 parameters)."""
        keys = ["vocab_size", "hidden_size", "intermediate_size", "n_layer", "max_position_embeddings"]
        if self.mla_layers:
            keys += ["num_attention_heads", "num_key_value_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"]
            keys += ["q_lora_rank"] if self.q_lora_rank is not None else []
        if self.linear_type == "gdn" and len(self.mla_layers) < self.n_layer:
            keys += ["gdn_num_heads", "gdn_head_dim", "gdn_conv_size"]
        for key in keys:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"hybrid config key {key!r} = {value!r}; expected a positive integer")
        if self.mla_layers and (isinstance(self.qk_nope_head_dim, bool) or not isinstance(self.qk_nope_head_dim, int)
                                or self.qk_nope_head_dim < 0):
            raise ValueError(f"hybrid config key 'qk_nope_head_dim' = {self.qk_nope_head_dim!r}; expected an "
                             f"integer >= 0")
        for key in ("rms_norm_eps", "mla_rope_theta") + (("gdn_expand_v",) if "gdn_num_heads" in keys else ()):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                name = "rope_theta" if key == "mla_rope_theta" else key
                raise ValueError(f"hybrid config key {name!r} = {value!r}; expected a positive number")

    def _validate(self) -> None:
        if self.linear_type not in ("gdn", "mamba"):
            raise ValueError(f"hybrid config key 'linear_type' = {self.linear_type!r}; expected 'gdn' or 'mamba'")
        self._positive_sizes()
        bad = [i for i in self.mla_layers if not 0 <= i < self.n_layer]
        if bad:
            raise ValueError(f"hybrid config key 'mla_layers' has indices {bad} outside [0, {self.n_layer}) "
                             f"(n_layer = {self.n_layer})")
        if len(set(self.mla_layers)) != len(self.mla_layers):
            raise ValueError(f"hybrid config key 'mla_layers' has duplicates: {self.mla_layers}")
        if self.layer_rank_list:
            self._check_layer_rank_list()
        if self.mla_layers:  # MLA fields are placeholders when there are no MLA layers (§3.1).
            div = self.qkv_rank_divisor
            for key in ("kv_lora_rank", "q_lora_rank"):
                val = getattr(self, key)
                if val is not None and val % div:
                    raise ValueError(f"hybrid config key {key!r} = {val} must be a multiple of "
                                     f"qkv_rank_divisor = {div}")
            if self.num_attention_heads % self.num_key_value_heads:
                raise ValueError(f"num_attention_heads = {self.num_attention_heads} is not divisible by "
                                 f"num_key_value_heads = {self.num_key_value_heads}")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim = {self.qk_rope_head_dim} must be even (RoPE pairs)")
            try:
                yarn_attention_factor(self.mla_rope_scaling)
            except ValueError as e:
                raise ValueError(f"hybrid config key 'rope_scaling': {e}") from None
        if self.linear_type == "mamba" and len(self.mla_layers) < self.n_layer:
            self.mamba_dims()
            self.mamba_options()

    def _check_layer_rank_list(self) -> None:
        """Validate ``layer_rank_list``; when every MLA layer ends up with the same ranks, fold them into the
        top-level ``q_lora_rank`` / ``kv_lora_rank`` and drop the list.

        Raises:
            ValueError: a key that is not an MLA layer index, or an entry without positive int ``q_rank`` /
                ``kv_rank``.
        """
        for key, entry in self.layer_rank_list.items():
            if not str(key).isdigit() or int(key) not in self.mla_layers:
                raise ValueError(f"hybrid config key 'layer_rank_list' has an entry for {key!r}, which is not an MLA "
                                 f"layer (mla_layers = {self.mla_layers})")
            ok = isinstance(entry, dict) and all(
                isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool) and entry[k] > 0
                for k in ("q_rank", "kv_rank"))
            if not ok:
                raise ValueError(f"hybrid config key 'layer_rank_list' entry {key!r} = {entry!r}: expected "
                                 '{"q_rank": <int > 0>, "kv_rank": <int > 0>}')
        per_layer = {self.mla_ranks(i) for i in self.mla_layers}
        if len(per_layer) <= 1:
            if per_layer:
                self.q_lora_rank, self.kv_lora_rank = per_layer.pop()
            self.layer_rank_list = {}

    @property
    def uniform_mla_ranks(self) -> bool:
        """True when every MLA layer has the top-level ``q_lora_rank`` / ``kv_lora_rank``."""
        return not self.layer_rank_list

    # ---- hybrid_config.json -------------------------------------------------------------------------
    def to_hybrid_dict(self) -> dict[str, Any]:
        """The ``hybrid_config.json`` content, JSON-serialisable: exactly the fields of Zebra-Llama's
        ``HybridConfig`` in its order (:data:`ZEBRA_KEYS`), then ``gdn_num_heads`` / ``gdn_head_dim`` for a GDN
        model, and ``layer_rank_list`` only when MLA layers have different ranks (the legacy key; today's
        ``HybridConfig`` has none). Our other facts go to ``config.json`` (:meth:`extras_dict`)."""
        out: dict[str, Any] = {}
        for k in ZEBRA_KEYS:
            out[k] = "yarn" if k == "rope_type" else copy.deepcopy(getattr(self, _ATTR_FOR_KEY.get(k, k)))
        if self.linear_type == "mamba" and len(self.mla_layers) < self.n_layer:
            m = self.mamba_dims()  # write the resolved Zebra-Llama Mamba-2 fields (§3.1)
            out.update(d_model=self.hidden_size, d_inner=m["d_inner"], d_xb=m["d_xb"])
            out["ssm_cfg"] = {"expand": 1, **self.ssm_cfg, "ngroups": m["ngroups"], "d_state": m["d_state"],
                              "repeat_kv_before_conv": False}
        if self.linear_type == "gdn":
            out.update({k: getattr(self, k) for k in HYLO_GDN_KEYS})
        if self.layer_rank_list:
            out["layer_rank_list"] = {str(i): dict(zip(("q_rank", "kv_rank"), self.mla_ranks(i)))
                                      for i in self.mla_layers}
        return out

    def extras_dict(self) -> dict[str, Any]:
        """Our facts outside the released schema (:data:`EXTRA_KEYS`), stored in ``config.json`` under
        :data:`EXTRAS_KEY`: the linear block type, the Qwen3 q/k-norm switch and the GDN constructor values."""
        out: dict[str, Any] = {"linear_type": self.linear_type, "use_qk_norm": bool(self.use_qk_norm)}
        if self.linear_type == "gdn":
            out.update(gdn_expand_v=self.gdn_expand_v, gdn_conv_size=self.gdn_conv_size,
                       gdn_norm_eps=self.gdn_norm_eps)
        return out

    def to_base_dict(self) -> dict[str, Any]:
        """The ``config.json`` content: the base model's HF config (with the vocab and ids of this model), plus
        :meth:`extras_dict` under :data:`EXTRAS_KEY`."""
        base = copy.deepcopy(self.base_config) or {
            "model_type": self.base_model_type,
            "architectures": ["LlamaForCausalLM" if self.base_model_type == "llama" else "Qwen3ForCausalLM"],
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.n_layer, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.base_num_key_value_heads, "head_dim": self.base_head_dim,
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": self.hidden_act, "rope_theta": self.mla_rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
        }
        base["vocab_size"] = self.vocab_size
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self, k, None) is not None:
                base[k] = getattr(self, k)
        base[EXTRAS_KEY] = self.extras_dict()
        return base

    @classmethod
    def from_dicts(cls, base: dict[str, Any], hybrid: dict[str, Any], source: str = "<memory>"):
        """Build from a base ``config.json`` dict and a ``hybrid_config.json`` dict.

        Reads the released schema (:data:`ZEBRA_KEYS` + the GDN keys), our extra keys from ``config.json``'s
        :data:`EXTRAS_KEY` object or, in files written before, from ``hybrid_config.json``; honours a legacy
        ``layer_rank_list``, drops other legacy keys (unknown ones with a warning) and converts the legacy
        llama3-typed ``rope_scaling`` (checkpoint-format.md §8).

        Raises:
            ValueError: naming ``source`` and the key when a required key is missing or has a wrong type.
        """
        hybrid = dict(hybrid)
        extras = base.get(EXTRAS_KEY, {})
        if not isinstance(extras, dict):  # a bad file: ValueError as for every other key
            raise ValueError(  # noqa: TRY004
                f"{source}: config.json key {EXTRAS_KEY!r} should be an object with hylo-bench's keys "
                f"{list(EXTRA_KEYS)}, got {type(extras).__name__}")
        for k in EXTRA_KEYS:  # hybrid_config.json wins: files we wrote before kept these keys there
            if k in extras and k not in hybrid:
                hybrid[k] = extras[k]
        if hybrid.get("layer_rank_list") == []:  # some legacy files write an empty list
            hybrid["layer_rank_list"] = {}
        required = ["hidden_size", "n_layer", "mla_layers", "intermediate_size"]
        if hybrid.get("mla_layers"):
            required += MLA_REQUIRED_KEYS
        if hybrid.get("linear_type", "gdn" if hybrid.get("gdn_num_heads") else "mamba") == "gdn":
            required += ["gdn_num_heads", "gdn_head_dim"]
        missing = [k for k in required if k not in hybrid]
        if missing:
            raise ValueError(f"{source}: hybrid_config.json is missing required key(s) {missing}")
        for key, value in hybrid.items():
            typ = KEY_TYPES.get(key)
            ok = typ is None or value is None and key in NULLABLE_KEYS or (
                isinstance(value, typ) and not (isinstance(value, bool) and typ in (int, (int, float))))
            if not ok:
                name = typ.__name__ if isinstance(typ, type) else "number"
                raise ValueError(f"{source}: hybrid_config.json key {key!r} should be {name}, got "
                                 f"{type(value).__name__} ({value!r})")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in hybrid["mla_layers"]):
            raise ValueError(f"{source}: hybrid_config.json key 'mla_layers' should be a list of int, got "
                             f"{hybrid['mla_layers']!r}")
        top_rope_type = hybrid.get("rope_type")
        unknown = [k for k in hybrid if k not in HYBRID_KEYS]
        for k in unknown:
            hybrid.pop(k)
        if [k for k in unknown if k not in LEGACY_KEYS]:
            logger.warning("%s: ignoring unknown hybrid_config.json keys %s", source,
                           [k for k in unknown if k not in LEGACY_KEYS])
        rs = hybrid.get("rope_scaling")
        if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "llama3" and top_rope_type == "yarn":
            logger.warning("%s: legacy rope_scaling of type 'llama3' with top-level rope_type 'yarn'; treating it "
                           "as YaRN factor %s, original %s", source, rs.get("factor"),
                           rs.get("original_max_position_embeddings"))
            hybrid["rope_scaling"] = {"rope_type": "yarn", "factor": rs.get("factor", 1.0),
                                      "original_max_position_embeddings":
                                          rs.get("original_max_position_embeddings", 4096)}
        if "linear_type" not in hybrid:  # §3.2 rules 2-3
            hybrid["linear_type"] = "gdn" if hybrid.get("gdn_num_heads", 0) else "mamba"
        base_type = base.get("model_type", "llama")
        if "use_qk_norm" not in hybrid:
            hybrid["use_qk_norm"] = base_type == "qwen3"
        n_heads = base.get("num_attention_heads", hybrid.get("num_attention_heads", 32))
        kwargs = dict(
            vocab_size=base.get("vocab_size", 32000),
            base_model_type=base_type,
            base_num_key_value_heads=base.get("num_key_value_heads", n_heads),
            base_head_dim=base.get("head_dim") or base.get("hidden_size", hybrid["hidden_size"]) // n_heads,
            base_config={k: v for k, v in base.items() if k != EXTRAS_KEY},
            bos_token_id=base.get("bos_token_id"),
            eos_token_id=base.get("eos_token_id"),
            pad_token_id=base.get("pad_token_id"),
        )
        kwargs.update(hybrid)
        return cls(**kwargs)

    def save_files(self, directory: str | Path) -> None:
        """Write ``config.json`` (base) and ``hybrid_config.json`` atomically into ``directory``."""
        from hylo_bench.io_utils import atomic_write_text

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / BASE_CONFIG_NAME, json.dumps(self.to_base_dict(), indent=2, sort_keys=True) + "\n")
        atomic_write_text(d / HYBRID_CONFIG_NAME, json.dumps(self.to_hybrid_dict(), indent=4) + "\n")

    @classmethod
    def from_directory(cls, directory: str | Path):
        """Read ``config.json`` + ``hybrid_config.json`` from a checkpoint directory.

        Raises:
            FileNotFoundError: naming the missing file.
            ValueError: on unreadable JSON (file and reason).
        """
        d = Path(directory)
        dicts = []
        for name in (BASE_CONFIG_NAME, HYBRID_CONFIG_NAME):
            p = d / name
            if not p.is_file():
                raise FileNotFoundError(f"{p}: not found; a HyLo checkpoint needs config.json and "
                                        f"hybrid_config.json")
            try:
                dicts.append(json.loads(read_text_utf8(p)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}: not valid JSON ({e})") from e
            if not isinstance(dicts[-1], dict):
                raise ValueError(f"{p}: expected a JSON object, got {type(dicts[-1]).__name__}")
        try:
            return cls.from_dicts(dicts[0], dicts[1], source=str(d))
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(str(d)) else f"{d / HYBRID_CONFIG_NAME}: {msg}") from None


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN attention scale ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1).

    Source: DeepSeek-V2 / Zebra-Llama ``yarn_get_mscale``, transformers ``_compute_yarn_parameters.get_mscale``.
    """
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _scaling_active(rs: dict | None) -> bool:
    return bool(rs) and rs.get("rope_type", rs.get("type", "yarn")) not in ("default", "none")


def yarn_attention_factor(rs: dict | None) -> float:
    """The cos/sin multiplier of the MLA rope dims for a ``rope_scaling`` dict (1.0 without YaRN).

    transformers ``_compute_yarn_parameters``: an explicit ``attention_factor`` wins; else, with both ``mscale``
    and ``mscale_all_dim`` set, ``yarn_get_mscale(F, mscale) / yarn_get_mscale(F, mscale_all_dim)``; else
    ``yarn_get_mscale(F)``. Zebra-Llama's ``DeepseekV3YarnRotaryEmbedding`` always takes the ratio (defaults
    mscale 1, mscale_all_dim 0) and ignores ``attention_factor``; the two agree on every config that sets both
    keys or neither (all released ones set neither: 0.1 ln F + 1).

    Raises:
        ValueError: when only one of ``mscale`` / ``mscale_all_dim`` is set and the two references give
            different multipliers (set both, or an explicit ``attention_factor``); a non-positive
            ``attention_factor``; ``truncate: false`` (transformers only; Zebra-Llama always truncates).
    """
    if not _scaling_active(rs):
        return 1.0
    assert rs is not None
    if rs.get("truncate", True) is not True:
        raise ValueError("rope_scaling.truncate = false is not supported: Zebra-Llama's YaRN always floors / ceils "
                         "the correction range (transformers' default, truncate = true)")
    if rs.get("rope_type", rs.get("type", "yarn")) != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        factor_attn = rs["attention_factor"]
        if isinstance(factor_attn, bool) or not isinstance(factor_attn, (int, float)) or not factor_attn > 0:
            raise ValueError(f"rope_scaling.attention_factor = {factor_attn!r}: expected a number > 0")
        return float(factor_attn)
    factor = float(rs.get("factor", 1.0))
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    transformers_value = yarn_get_mscale(factor)
    zebra_value = yarn_get_mscale(factor, 1.0 if mscale is None else mscale) / yarn_get_mscale(
        factor, mscale_all_dim or 0.0)
    if abs(transformers_value - zebra_value) > 1e-12 * transformers_value:
        raise ValueError(
            f"rope_scaling sets mscale = {mscale!r} and mscale_all_dim = {mscale_all_dim!r}: with only one of them "
            f"set, transformers' _compute_yarn_parameters scales cos/sin by {transformers_value:.6g} and Zebra-Llama's "
            f"DeepseekV3YarnRotaryEmbedding by {zebra_value:.6g}; set both keys (DeepSeek style) or an explicit "
            f"attention_factor")
    return transformers_value


def mla_softmax_mscale2(rs: dict | None) -> float:
    """The softmax-scale multiplier ``yarn_get_mscale(F, mscale_all_dim) ** 2`` of a scaling dict that sets a
    non-zero ``mscale_all_dim`` (transformers DeepseekV3 ``yarn_apply_mscale``; Zebra-Llama
    ``DeepseekV3Attention.__init__``), else 1. Released HyLo configs set no ``mscale_all_dim``: 1."""
    if not _scaling_active(rs):
        return 1.0
    assert rs is not None
    mscale_all_dim = rs.get("mscale_all_dim", 0)
    if not mscale_all_dim:
        return 1.0
    m = yarn_get_mscale(float(rs.get("factor", 1.0)), mscale_all_dim)
    return m * m


def mla_softmax_scale(qk_head_dim: int, rs: dict | None) -> float:
    """MLA softmax scale ``d_qk ** -0.5 * mla_softmax_mscale2(rs)`` (DeepseekV3's rule; 1/sqrt(d_qk) for every
    released config)."""
    return qk_head_dim ** -0.5 * mla_softmax_mscale2(rs)


def normalize_rope_scaling(rs: dict | None) -> dict | None:
    """Normalise a ``rope_scaling`` dict: the key ``type`` becomes ``rope_type`` (default ``"yarn"``).

    A factor <= 1 is kept as written; the rotary module treats it as plain RoPE (checkpoint-format.md §3.3).
    """
    if not rs:
        return None
    rs = dict(rs)
    if "type" in rs and "rope_type" not in rs:
        rs["rope_type"] = rs.pop("type")
    rs.setdefault("rope_type", "yarn")
    return rs
