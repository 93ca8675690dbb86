"""HyLo configuration fields, in plain Python: the layer plan and mixer dimensions of a hybrid
(``hybrid_config.json``). No torch or transformers import, so ``hylo-bench info`` / ``kv`` stay instant;
:class:`hylo_bench.models.config.HyLoConfig` is the same fields bound to transformers' ``PretrainedConfig``.

A released HyLo checkpoint directory holds two configs (checkpoint-format.md §2-3):

* ``config.json``: the *student base model's* HF config (Llama / Qwen3), kept as reference. We read only
  vocab size, norm eps, activation, RoPE base and token ids from it.
* ``hybrid_config.json``: the Zebra-Llama ``HybridConfig`` fields plus the HyLo GDN additions.

``HybridFields`` holds both in one object; ``HyLoConfig`` (``models/config.py``) mixes it into a transformers
``PretrainedConfig`` so ``HyLoForCausalLM`` can be a ``PreTrainedModel``; ``HybridSpec`` is the torch-free twin.
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

# Keys of hybrid_config.json that we write (Zebra-Llama HybridConfig fields + HyLo additions), in order.
HYBRID_KEYS = (
    "hidden_size", "intermediate_size", "hidden_act", "n_layer", "mla_layers", "rms_norm_eps",
    "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "use_lora_layer_norm",
    "use_full_kv_head", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qkv_rank_divisor",
    "max_position_embeddings", "rope_theta", "rope_scaling", "attention_bias", "attention_dropout",
    "linear_type", "gdn_num_heads", "gdn_head_dim", "gdn_expand_v", "gdn_conv_size", "gdn_norm_eps",
    "use_qk_norm", "d_model", "ssm_cfg", "d_inner", "d_xb",
)
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
}
NULLABLE_KEYS = {"q_lora_rank", "rope_scaling", "d_inner", "d_xb", "d_model"}
_ATTR_FOR_KEY = {"rope_theta": "mla_rope_theta", "rope_scaling": "mla_rope_scaling"}
# Keys older Zebra-Llama / X-EcoMLA configs carry that we accept and ignore (checkpoint-format.md §8).
LEGACY_KEYS = ("rope_type", "use_fixed_rank_for_first_and_last_block", "layer_rank_list", "q_energy_ratio",
               "kv_energy_ratio")

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


class HybridFields:
    """Fields and logic of a HyLo hybrid's configuration (MLA + Gated DeltaNet / Mamba-2 layers).

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

    Raises:
        ValueError: on inconsistent values (rank not a multiple of the divisor, heads not divisible, a layer
            index out of range, unknown linear type).
    """

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
        if self.linear_type == "mamba" and len(self.mla_layers) < self.n_layer:
            self.mamba_dims()

    # ---- hybrid_config.json -------------------------------------------------------------------------
    def to_hybrid_dict(self) -> dict[str, Any]:
        """The ``hybrid_config.json`` content (Zebra-Llama keys + HyLo keys), JSON-serialisable."""
        out = {k: copy.deepcopy(getattr(self, _ATTR_FOR_KEY.get(k, k))) for k in HYBRID_KEYS}
        if self.linear_type == "mamba":
            for k in ("gdn_num_heads", "gdn_head_dim", "gdn_expand_v", "gdn_conv_size", "gdn_norm_eps"):
                out.pop(k)
            if len(self.mla_layers) < self.n_layer:  # write the resolved Zebra-Llama Mamba-2 fields (§3.1)
                m = self.mamba_dims()
                out.update(d_model=self.hidden_size, d_inner=m["d_inner"], d_xb=m["d_xb"])
                out["ssm_cfg"] = {"expand": 1, **self.ssm_cfg, "ngroups": m["ngroups"], "d_state": m["d_state"],
                                  "repeat_kv_before_conv": False}
        return out

    def to_base_dict(self) -> dict[str, Any]:
        """The ``config.json`` content: the base model's HF config (with the vocab and ids of this model)."""
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
        return base

    @classmethod
    def from_dicts(cls, base: dict[str, Any], hybrid: dict[str, Any], source: str = "<memory>"):
        """Build from a base ``config.json`` dict and a ``hybrid_config.json`` dict.

        Tolerates legacy keys (dropped with a warning) and the legacy llama3-typed ``rope_scaling``
        (checkpoint-format.md §8).

        Raises:
            ValueError: naming ``source`` and the key when a required key is missing or has a wrong type.
        """
        hybrid = dict(hybrid)
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
            base_config=base,
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


class HybridSpec(HybridFields):
    """The hybrid config without transformers: same fields, validation, ``from_dicts`` / ``from_directory`` /
    ``to_hybrid_dict`` / ``to_base_dict`` as ``HyLoConfig`` (``tests/models/test_spec.py`` checks they agree
    on every shipped recipe). What ``hylo-bench info`` / ``kv`` use; :meth:`to_hylo_config` converts.

    Raises:
        ValueError: as :class:`HybridFields`.
    """

    def __init__(self, **kwargs: Any) -> None:
        rest = self._set_fields(**kwargs)
        self.tie_word_embeddings = bool(rest.pop("tie_word_embeddings", False))
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(self, k, rest.pop(k, None))
        self.extra = rest
        self._validate()

    def to_hylo_config(self):
        """The equivalent :class:`hylo_bench.models.config.HyLoConfig` (imports transformers)."""
        from hylo_bench.models.config import HyLoConfig

        return HyLoConfig.from_dicts(self.to_base_dict(), self.to_hybrid_dict())


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
