"""Recipes: one YAML per released HyLo checkpoint (plus the paper-only Mamba-2 layouts), loaded into ``Recipe``.

The YAML files live in ``hylo_bench/recipes/`` (package data; the single source of truth, see
``recipes/README.md``). A recipe fixes the backbone and teacher, the layer plan, the MLA and GDN / Mamba-2
dimensions, YaRN, and the training stages of training-recipe.md. :func:`recipe_hybrid_config` builds the
``HyLoConfig`` from it without network access; :func:`hylo_bench.config.upcycle.upcycle_config_from_recipe`
turns it into the ``UpcycleConfig`` of ``hylo-bench upcycle --recipe``, with explicit CLI flags taking precedence.
"""

from __future__ import annotations

import copy
import difflib
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hylo_bench.config.mixture import parse_mixture
from hylo_bench.config.units import format_length

_NUM = (int, float)
# key -> (type, required); nested blocks are checked by _check_block.
_TOP: dict[str, tuple[Any, bool]] = {
    "name": (str, True), "released": (bool, True), "hub_id": ((str, type(None)), True), "backbone": (str, True),
    "teacher": (str, True), "layout": (str, True), "linear_type": (str, True), "trained_context_tokens": (int, True),
    "paper_kv_cache_pct": (_NUM, False), "paper_params_rounded": (str, False), "base_architecture": (dict, True),
    "mla_layers": (list, True), "mla": (dict, True), "gdn": (dict, False), "mamba2": (dict, False),
    "rope_scaling": ((dict, type(None)), True), "stages": (list, True), "loss": (dict, False),
    "optimizer": (dict, False), "precision": (str, False), "seed": (int, False),
    "data": (dict, False), "chat_template": ((str, type(None)), False),
}
_BASE: dict[str, tuple[Any, bool]] = {
    "model_type": (str, True), "vocab_size": (int, True), "hidden_size": (int, True),
    "intermediate_size": (int, True), "num_hidden_layers": (int, True), "num_attention_heads": (int, True),
    "num_key_value_heads": (int, True), "head_dim": (int, True), "hidden_act": (str, True),
    "rope_theta": (_NUM, True), "rope_scaling": ((dict, type(None)), False), "rms_norm_eps": (_NUM, True),
    "tie_word_embeddings": (bool, True), "max_position_embeddings": (int, True),
    "bos_token_id": ((int, type(None)), False), "eos_token_id": ((int, list, type(None)), False),
}
_MLA: dict[str, tuple[Any, bool]] = {
    "q_lora_rank": (int, True), "kv_lora_rank": (int, True), "qk_rope_head_dim": (int, True),
    "qk_nope_head_dim": (int, True), "v_head_dim": (int, True), "num_key_value_heads": (int, True),
    "use_qk_norm": (bool, True),
}
_GDN: dict[str, tuple[Any, bool]] = {
    "num_heads": (int, True), "head_dim": (int, True), "expand_v": (_NUM, False), "conv_size": (int, False),
}
_MAMBA2: dict[str, tuple[Any, bool]] = {"d_inner": (int, True), "d_xb": (int, True), "ssm_cfg": (dict, True)}
_STAGE: dict[str, tuple[Any, bool]] = {
    "kind": (str, True), "seq_len_tokens": (int, True), "lr": (_NUM, True), "data_fraction": (_NUM, False),
    "epochs": (_NUM, False), "global_batch_sequences": (int, False), "per_device_batch_sequences": (int, False),
    "token_budget": (int, False),
}
_LOSS: dict[str, tuple[Any, bool]] = {
    "kl_weight": (_NUM, False), "ce_weight": (_NUM, False), "temperature": (_NUM, False),
    "kl_direction": (str, False), "kl_reduction": (str, False),
}
_NAME_RE = re.compile(r"HyLo-(Llama|Qwen)-(\d+)MLA(\d+)(GDN|M2)-(\d+)K-SFT")


class RecipeError(ValueError):
    """A recipe name that does not exist, or a recipe file with a bad field (file, key and expectation named)."""


@dataclass(kw_only=True, slots=True)
class RecipeStage:
    """One training stage (training-recipe.md §2.3, §3.3). ``kind`` is ``"ild"`` or ``"kd"``; lr in 1/step units."""

    kind: str
    seq_len_tokens: int
    lr: float
    data_fraction: float = 1.0
    epochs: float = 1.0
    global_batch_sequences: int | None = None  # not published for stage I
    per_device_batch_sequences: int | None = None
    token_budget: int | None = None  # tokens; unset = the data's size (one epoch), i.e. --tokens-per-stage


@dataclass(kw_only=True, slots=True)
class Recipe:
    """A HyLo recipe (``hylo_bench/recipes/<name>.yaml``); field meanings are in the YAML comments.

    ``base_architecture`` holds the backbone's HF ``config.json`` fields needed to build the hybrid offline.
    ``mla`` / ``gdn`` / ``mamba2`` hold the mixer dims (checkpoint-format.md §3.3); ``rope_scaling`` the MLA
    YaRN dict for the trained context (§3.3; None = plain RoPE).
    """

    name: str
    released: bool
    hub_id: str | None
    backbone: str
    teacher: str
    layout: str
    linear_type: str
    trained_context_tokens: int
    base_architecture: dict
    mla_layers: list[int]
    mla: dict
    rope_scaling: dict | None
    stages: list[RecipeStage]
    gdn: dict | None = None
    mamba2: dict | None = None
    paper_kv_cache_pct: float | None = None
    paper_params_rounded: str | None = None
    loss: dict = field(default_factory=dict)
    optimizer: dict = field(default_factory=dict)
    precision: str = "bf16"
    seed: int = 42
    data: dict | None = None  # the training mixture (hylo_bench.config.mixture format; AMD's dataset_mixer)
    chat_template: str | None = None  # renders conversational data (None: the backbone tokenizer's)
    source: str = ""  # the file it was read from

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def num_layers(self) -> int:
        return int(self.base_architecture["num_hidden_layers"])

    def stage(self, kind: str) -> RecipeStage:
        """The last stage of ``kind`` (``"ild"`` / ``"kd"``).

        Raises:
            RecipeError: when the recipe has no such stage.
        """
        found = [s for s in self.stages if s.kind == kind]
        if not found:
            raise RecipeError(f"{self.source}: recipe {self.name} has no {kind!r} stage")
        return found[-1]


def recipes_dir() -> Path:
    """Directory of the shipped recipe YAML files (``hylo_bench/recipes``)."""
    return Path(str(resources.files("hylo_bench") / "recipes"))


def list_recipes() -> list[str]:
    """Names of the shipped recipes (file stems), sorted."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def find_recipe(name: str) -> Path | None:
    """Path of recipe ``name`` (a shipped name, ``amd/<name>``, or a path to a ``.yaml`` file); None if unknown."""
    p = Path(name).expanduser()
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    stem = name.removeprefix("amd/").removesuffix(".yaml")
    candidate = recipes_dir() / f"{stem}.yaml"
    return candidate if candidate.is_file() else None


def unknown_recipe_message(name: str) -> str:
    """Error text for an unknown recipe name, with close matches."""
    names = list_recipes()
    close = difflib.get_close_matches(name.removeprefix("amd/"), names, n=4, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return (f"unknown recipe {name!r}{hint} ({len(names)} shipped recipes in {recipes_dir()}: "
            f"`python -c 'from hylo_bench.config.recipes import list_recipes; print(list_recipes())'`)")


def load_recipe(name: str, overrides: dict[str, Any] | None = None) -> Recipe:
    """Load and validate a recipe by name (or YAML path), applying dotted-key ``overrides`` first.

    Args:
        name: e.g. ``HyLo-Qwen-7MLA21GDN-8K-SFT``, ``amd/HyLo-Qwen-7MLA21GDN-8K-SFT`` or ``path/to/x.yaml``.
        overrides: ``{"mla.kv_lora_rank": 64, "stages.1.lr": 1e-4}``; each key must exist in the recipe
            (``gdn.*`` / ``mamba2.*`` / ``rope_scaling.*`` may be added).

    Raises:
        RecipeError: unknown name (close matches listed), unreadable YAML, or a bad field (file, key, expected
            and found value named).
    """
    path = find_recipe(name)
    if path is None:
        raise RecipeError(unknown_recipe_message(name))
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML ({e})") from e
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value, path)
    return recipe_from_dict(raw, source=str(path))


def _set_dotted(raw: dict, key: str, value: Any, path: Path) -> None:
    parts = key.split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"{path}: override {key!r}: {'.'.join(parts[:i + 1])} is not an index of a "
                                  f"{len(node)}-item list")
            node = node[int(part)]
        elif isinstance(node, dict) and (part in node or part in ("gdn", "mamba2", "rope_scaling")):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        else:
            raise RecipeError(f"{path}: override {key!r}: no key {part!r} (known: {_keys(node)})")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise RecipeError(f"{path}: override {key!r}: {last!r} is not an index of a {len(node)}-item list")
        node[int(last)] = value
    elif isinstance(node, dict):
        if len(parts) == 1 and last not in _TOP:
            raise RecipeError(f"{path}: override {key!r}: unknown recipe key (known: {sorted(_TOP)})")
        node[last] = value
    else:
        raise RecipeError(f"{path}: override {key!r}: {'.'.join(parts[:-1])} is not a mapping")


def _keys(node: Any) -> list[str]:
    return sorted(node) if isinstance(node, dict) else []


def _type_name(typ: Any) -> str:
    types = typ if isinstance(typ, tuple) else (typ,)
    names = {int: "int", float: "number", str: "string", bool: "true/false", dict: "mapping", list: "list",
             type(None): "null"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


def _check_block(block: dict, schema: dict[str, tuple[Any, bool]], where: str, source: str) -> None:
    unknown = [k for k in block if k not in schema]
    if unknown:
        raise RecipeError(f"{source}: unknown key(s) {[f'{where}{k}' for k in unknown]}; expected keys of "
                          f"{where.rstrip('.') or 'the recipe'}: {sorted(schema)}")
    for key, (typ, required) in schema.items():
        if key not in block:
            if required:
                raise RecipeError(f"{source}: missing required key '{where}{key}' ({_type_name(typ)})")
            continue
        value = block[key]
        types = typ if isinstance(typ, tuple) else (typ,)
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise RecipeError(f"{source}: key '{where}{key}' should be {_type_name(typ)}, got "
                              f"{type(value).__name__} ({value!r})")


def recipe_from_dict(raw: dict, source: str = "<memory>") -> Recipe:
    """Validate a parsed recipe mapping and build a :class:`Recipe`.

    Raises:
        RecipeError: naming ``source``, the key, what was expected and what was found.
    """
    raw = copy.deepcopy(raw)
    _check_block(raw, _TOP, "", source)
    _check_block(raw["base_architecture"], _BASE, "base_architecture.", source)
    _check_block(raw["mla"], _MLA, "mla.", source)
    for i, st in enumerate(raw["stages"]):
        if not isinstance(st, dict):
            raise RecipeError(f"{source}: key 'stages.{i}' should be a mapping, got {type(st).__name__}")
        _check_block(st, _STAGE, f"stages.{i}.", source)
        if st["kind"] not in ("ild", "kd"):
            raise RecipeError(f"{source}: key 'stages.{i}.kind' should be 'ild' or 'kd', got {st['kind']!r}")
    if raw.get("loss"):
        _check_block(raw["loss"], _LOSS, "loss.", source)
    lt = raw["linear_type"]
    if lt not in ("gdn", "mamba"):
        raise RecipeError(f"{source}: key 'linear_type' should be 'gdn' or 'mamba', got {lt!r}")
    block, schema = ("gdn", _GDN) if lt == "gdn" else ("mamba2", _MAMBA2)
    if not isinstance(raw.get(block), dict):
        raise RecipeError(f"{source}: linear_type {lt!r} needs a '{block}' mapping with keys {sorted(schema)}")
    _check_block(raw[block], schema, f"{block}.", source)
    other = "mamba2" if lt == "gdn" else "gdn"
    if raw.get(other):
        raise RecipeError(f"{source}: key '{other}' is set but linear_type is {lt!r}; remove one")
    n_layer = raw["base_architecture"]["num_hidden_layers"]
    mla = raw["mla_layers"]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layer for i in mla) \
            or len(set(mla)) != len(mla):
        raise RecipeError(f"{source}: key 'mla_layers' should be distinct layer indices in [0, {n_layer}) "
                          f"(base_architecture.num_hidden_layers), got {mla!r}")
    m = re.fullmatch(r"(\d+)MLA(\d+)(GDN|M2)", raw["layout"])
    if not m or int(m.group(1)) != len(mla) or int(m.group(1)) + int(m.group(2)) != n_layer \
            or (m.group(3) == "GDN") != (lt == "gdn"):
        raise RecipeError(f"{source}: key 'layout' = {raw['layout']!r} disagrees with mla_layers ({len(mla)} of "
                          f"{n_layer} layers) and linear_type {lt!r}; expected "
                          f"'{len(mla)}MLA{n_layer - len(mla)}{'GDN' if lt == 'gdn' else 'M2'}'")
    if raw.get("data") is not None:
        try:
            parse_mixture(raw["data"], f"{source}: data")
        except ValueError as e:
            raise RecipeError(str(e)) from None
    rs = raw["rope_scaling"]
    if rs is not None and not isinstance(rs.get("factor"), _NUM):
        raise RecipeError(f"{source}: key 'rope_scaling.factor' should be a number, got {rs.get('factor')!r}")
    stages = [RecipeStage(**st) for st in raw.pop("stages")]
    return Recipe(**raw, stages=stages, source=source)


def check_name_matches(recipe: Recipe) -> None:
    """A shipped recipe's name must encode its layout and trained context (``HyLo-Qwen-7MLA21GDN-8K-SFT``).

    Raises:
        RecipeError: when name, layout and ``trained_context_tokens`` disagree.
    """
    m = _NAME_RE.fullmatch(recipe.name)
    ok = m is not None and f"{m.group(2)}MLA{m.group(3)}{m.group(4)}" == recipe.layout \
        and int(m.group(5)) * 1024 == recipe.trained_context_tokens
    if not ok:
        raise RecipeError(f"{recipe.source}: name {recipe.name!r} does not match layout {recipe.layout!r} and "
                          f"trained_context_tokens {recipe.trained_context_tokens}")


def base_config_for(recipe: Recipe):
    """The backbone's HF config (``LlamaConfig`` / ``Qwen3Config``) from ``base_architecture``; no download.

    Raises:
        RecipeError: for a ``model_type`` other than llama / qwen3.
    """
    from transformers import LlamaConfig, Qwen3Config

    arch = dict(recipe.base_architecture)
    classes = {"llama": LlamaConfig, "qwen3": Qwen3Config}
    model_type = arch.pop("model_type")
    if model_type not in classes:
        raise RecipeError(f"{recipe.source}: key 'base_architecture.model_type' should be one of "
                          f"{sorted(classes)}, got {model_type!r}")
    return classes[model_type](**arch)


def mixer_dims(recipe: Recipe) -> dict[str, Any]:
    """``HyLoConfig`` keyword arguments for the mixers and the MLA RoPE (the recipe's ``mla``, ``gdn`` /
    ``mamba2`` and ``rope_scaling`` blocks, renamed to hybrid_config.json keys)."""
    mla = recipe.mla
    dims: dict[str, Any] = {k: mla[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                                 "qk_nope_head_dim", "v_head_dim")}
    if recipe.linear_type == "gdn":
        g = recipe.gdn or {}
        dims.update(gdn_num_heads=g["num_heads"], gdn_head_dim=g["head_dim"], gdn_expand_v=g.get("expand_v", 2),
                    gdn_conv_size=g.get("conv_size", 4))
    else:
        mb = recipe.mamba2 or {}
        dims.update(d_inner=mb["d_inner"], d_xb=mb["d_xb"], ssm_cfg=dict(mb["ssm_cfg"]))
    dims["rope_scaling"] = copy.deepcopy(recipe.rope_scaling)
    return dims


class ArchitectureConfig:
    """The recipe's ``base_architecture`` as a read-only config object (attribute per key, None when absent,
    ``to_dict``), standing in for the HF config where importing transformers' model configs is too slow
    (``hylo-bench info``: ``LlamaConfig`` pulls in scikit-learn through transformers' generation utils)."""

    def __init__(self, arch: dict[str, Any]) -> None:
        self._arch = copy.deepcopy(dict(arch))

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        return self._arch.get(key)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._arch)


def recipe_hybrid_config(recipe: Recipe, *, hf_base: bool = True):
    """The ``HyLoConfig`` of a recipe, built offline through the same path as upcycling a real backbone
    (:func:`hylo_bench.config.student.hybrid_config_for`).

    Args:
        hf_base: build the backbone config with transformers (``base_config`` then holds every HF default);
            False uses the recipe's ``base_architecture`` keys alone (:class:`ArchitectureConfig`) and returns a
            :class:`hylo_bench.config.hybrid.HybridSpec` (the same fields, no transformers or torch import; what
            ``info`` / ``kv`` use).

    Raises:
        RecipeError: when the recipe's MLA KV-head count or q/k-norm switch disagrees with its backbone, or
            the backbone ``model_type`` is not llama / qwen3.
        ValueError: from ``HyLoConfig`` validation (bad ranks, indices).
    """
    from hylo_bench.config.hybrid import HybridSpec
    from hylo_bench.config.student import hybrid_config_for

    if hf_base:
        base = base_config_for(recipe)
    else:
        if recipe.base_architecture.get("model_type") not in ("llama", "qwen3"):
            raise RecipeError(f"{recipe.source}: key 'base_architecture.model_type' should be one of "
                              f"['llama', 'qwen3'], got {recipe.base_architecture.get('model_type')!r}")
        base = ArchitectureConfig(recipe.base_architecture)
    n_kv = base.num_key_value_heads or base.num_attention_heads
    if recipe.mla["num_key_value_heads"] != n_kv:
        raise RecipeError(f"{recipe.source}: key 'mla.num_key_value_heads' = {recipe.mla['num_key_value_heads']} "
                          f"but the backbone has {n_kv} KV heads (released layouts keep "
                          f"n_kvm = n_kv, checkpoint-format.md §4.3 (c))")
    if recipe.mla["use_qk_norm"] != (base.model_type == "qwen3"):
        raise RecipeError(f"{recipe.source}: key 'mla.use_qk_norm' = {recipe.mla['use_qk_norm']} but the "
                          f"backbone is {base.model_type!r} (q/k norms exactly for Qwen3, §4.3 (d))")
    return hybrid_config_for(base, list(recipe.mla_layers), recipe.linear_type,
                             config_cls=None if hf_base else HybridSpec, **mixer_dims(recipe))


def stages_spec(recipe: Recipe) -> str:
    """The recipe's stages as a ``--stages`` string, e.g. ``"2k:ild,8k:kd"`` (``@TOKENS`` when budgeted)."""
    items = []
    for s in recipe.stages:
        item = f"{format_length(s.seq_len_tokens)}:{s.kind}"
        items.append(item + (f"@{s.token_budget}" if s.token_budget else ""))
    return ",".join(items)
