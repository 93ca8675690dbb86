"""``hylo-bench info`` / ``kv`` targets: resolve a recipe name or checkpoint directory to its ``HyLoConfig``
(configs only, no weights), count parameters on the meta device, and describe the layout and its memory.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hylo_bench.config import units as U
from hylo_bench.models import memory as M
from hylo_bench.models.params import parameter_counts

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class Target:
    """What ``info`` / ``kv`` describe: a recipe (``kind="recipe"``) or a checkpoint directory."""

    name: str
    kind: str
    config: Any  # HybridSpec (plain Python, hylo_bench.config.hybrid)
    path: str
    trained_context_tokens: int | None
    stored_dtype: str | None
    recipe: Any = None  # Recipe when kind == "recipe"


def resolve_target(spec: str) -> Target:
    """A checkpoint directory (``config.json`` + ``hybrid_config.json``), a recipe name / ``amd/<name>`` /
    recipe YAML path. Reads config files only.

    Raises:
        FileNotFoundError: a directory without ``hybrid_config.json``.
        ValueError: neither a directory nor a known recipe (close recipe names listed); bad config values.
    """
    from hylo_bench.config import recipes as R
    from hylo_bench.config.hybrid import HYBRID_CONFIG_NAME, HybridSpec

    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / HYBRID_CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{p}: no {HYBRID_CONFIG_NAME}; `info`/`kv` describe HyLo hybrids (a recipe "
                                    f"name or a hybrid checkpoint directory)")
        cfg = HybridSpec.from_directory(p)
        base = cfg.base_config or {}
        return Target(name=p.name, kind="checkpoint", config=cfg, path=str(p),
                      trained_context_tokens=_checkpoint_context(p),
                      stored_dtype=base.get("dtype") or base.get("torch_dtype"))
    if R.find_recipe(spec) is None:
        raise R.RecipeError(f"{spec!r} is not a checkpoint directory, and {R.unknown_recipe_message(spec)}")
    recipe = R.load_recipe(spec)
    return Target(name=recipe.name, kind="recipe", config=R.recipe_hybrid_config(recipe, hf_base=False),
                  path=recipe.source,
                  trained_context_tokens=recipe.trained_context_tokens, stored_dtype="float32", recipe=recipe)


def _checkpoint_context(d: Path) -> int | None:
    """Trained context of a checkpoint: the longest stage of our ``manifest.json``, else the ``-8K-``/``-64K-``
    tag of a released name in the path; None when neither says."""
    man = d / "manifest.json"
    if man.is_file():
        try:
            stages = json.loads(man.read_text()).get("stages", [])
            lens = [s["seq_len_tokens"] for s in stages if isinstance(s, dict) and "seq_len_tokens" in s]
            if lens:
                return max(lens)
        except (json.JSONDecodeError, TypeError, KeyError):
            logger.warning("%s: unreadable manifest.json; trained context unknown", man)
    m = re.search(r"HyLo-[A-Za-z]+-\d+MLA\d+(?:GDN|M2)-(\d+)K-SFT", str(d.resolve()))
    return int(m.group(1)) * 1024 if m else None


def rope_info(cfg) -> dict[str, Any]:
    """MLA RoPE settings: base, scaling dict, the cos/sin multiplier the model applies (``yarn_mscale``:
    :func:`hylo_bench.config.hybrid.yarn_attention_factor`, 0.1 ln F + 1 for the released configs;
    checkpoint-format.md §5.3), the softmax-scale multiplier (``softmax_mscale2``: yarn_mscale(F,
    mscale_all_dim)^2, 1 unless ``mscale_all_dim`` is set) and the context YaRN targets (F x L0 tokens)."""
    from hylo_bench.config.hybrid import mla_softmax_mscale2, yarn_attention_factor

    rs = cfg.mla_rope_scaling or None
    factor = float(rs.get("factor", 1.0)) if rs else 1.0
    yarn = bool(rs) and rs.get("rope_type", "yarn") == "yarn"
    out = {"rope_theta": cfg.mla_rope_theta, "rope_scaling": rs, "yarn_active": yarn and factor > 1.0,
           "yarn_mscale": round(yarn_attention_factor(rs), 4),
           "softmax_mscale2": round(mla_softmax_mscale2(rs), 4)}
    if rs and factor > 1.0:
        out["yarn_target_context_tokens"] = int(factor * rs.get("original_max_position_embeddings", 4096))
    return out


def describe(spec: str) -> dict[str, Any]:
    """The ``hylo-bench info --json`` object for a recipe name or checkpoint directory.

    Keys: ``name``, ``kind``, ``layout``, ``layers`` (per layer: index, mixer, params, mixer_params,
    kv_cache_bytes_per_token, state_bytes_per_sequence), ``params`` (int), ``params_detail``,
    ``kv_cache_bytes_per_token`` (bf16, int), ``backbone_kv_cache_bytes_per_token``, ``kv_cache_pct_of_base``
    (float, %), ``state_bytes_per_sequence`` (+ ``state_dtype``), ``trained_context_tokens``, ``rope``, ``dtype``.

    Raises:
        See :func:`resolve_target`.
    """
    if _is_transformer_target(spec):
        return describe_transformer(spec)
    t = resolve_target(spec)
    cfg = t.config
    counts = parameter_counts(cfg)
    per_lin = M.linear_layer_state_bytes(cfg)
    layers = []
    for i, kind in enumerate(cfg.mixer_types):
        lay = {"index": i, "mixer": kind, **counts["per_layer"][i],
               "kv_cache_bytes_per_token": M.mla_latent_width(cfg) * M.BF16_BYTES if kind == "mla" else 0,
               "state_bytes_per_sequence": 0 if kind == "mla" else per_lin["recurrent"] + per_lin["conv"]}
        layers.append(lay)
    n_mla = len(cfg.mla_layers)
    suffix = "GDN" if cfg.linear_type == "gdn" else "M2"
    out = {
        "name": t.name, "kind": t.kind, "path": t.path,
        "released": getattr(t.recipe, "released", None), "hub_id": getattr(t.recipe, "hub_id", None),
        "backbone": getattr(t.recipe, "backbone", None) or (cfg.base_config or {}).get("_name_or_path"),
        "teacher": getattr(t.recipe, "teacher", None),
        "layout": f"{n_mla}MLA{cfg.n_layer - n_mla}{suffix}", "mla_layers": list(cfg.mla_layers),
        "linear_type": cfg.linear_type, "num_layers": cfg.n_layer, "layers": layers,
        "params": int(counts["total"]), "params_detail": {k: v for k, v in counts.items() if k != "per_layer"},
        "kv_cache_bytes_per_token": M.kv_cache_bytes_per_token(cfg),
        "backbone_kv_cache_bytes_per_token": M.backbone_kv_cache_bytes_per_token(cfg),
        "kv_cache_pct_of_base": round(M.kv_cache_pct_of_base(cfg), 4),
        "state_bytes_per_sequence": M.state_bytes_per_sequence(cfg),
        "state_bytes_per_linear_layer": per_lin,
        "state_dtype": {"recurrent": "float32", "conv": "bfloat16"},
        "trained_context_tokens": t.trained_context_tokens, "rope": rope_info(cfg),
        "dtype": {"compute": "bfloat16", "kv_cache": "bfloat16", "stored": t.stored_dtype},
        "mla_dims": {k: getattr(cfg, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                                   "qk_nope_head_dim", "v_head_dim", "num_key_value_heads",
                                                   "use_qk_norm")},
    }
    if cfg.linear_type == "gdn":
        out["linear_dims"] = {"gdn_num_heads": cfg.gdn_num_heads, "gdn_head_dim": cfg.gdn_head_dim,
                              "gdn_value_head_dim": cfg.gdn_value_head_dim, "gdn_conv_size": cfg.gdn_conv_size}
    else:
        out["linear_dims"] = M.mamba2_dims(cfg)
    if t.recipe is not None and t.recipe.paper_kv_cache_pct is not None:
        out["paper_kv_cache_pct"] = t.recipe.paper_kv_cache_pct
    base_tied = bool((cfg.base_config or {}).get("tie_word_embeddings", False))
    out["embeddings"] = {"base_tied": base_tied, "lm_head": "untied",
                         "note": ("the base ties lm_head to the embedding; the hybrid's lm_head is its own tensor, "
                                  "initialised as a copy of the embedding (released layout)") if base_tied else
                         "untied, as in the base"}
    return out


def _is_transformer_target(spec: str) -> bool:
    """``demo``, a ``.gguf`` file, a fetched known model, or a checkpoint folder without ``hybrid_config.json``."""
    from hylo_bench.config.hybrid import HYBRID_CONFIG_NAME
    from hylo_bench.models import gguf

    p = Path(spec).expanduser()
    if spec == "demo" or gguf.is_gguf_path(spec) and not p.is_dir() or (spec in gguf.KNOWN_MODELS and not p.exists()):
        return True
    return p.is_dir() and (p / "config.json").is_file() and not (p / HYBRID_CONFIG_NAME).is_file()


def describe_transformer(spec: str) -> dict[str, Any]:
    """``hylo-bench info`` of a plain transformer (a ``.gguf`` file is converted first, see
    :mod:`hylo_bench.models.gguf`): shape, parameters from the safetensors headers, tied embeddings, KV cache
    bytes per token in bf16 (2 x layers x KV heads x head_dim x 2 B) and what upcycling it would do to the head.

    Raises:
        FileNotFoundError / ValueError: unresolvable spec, bad GGUF file, unreadable ``config.json`` (named).
    """
    from hylo_bench.models.checkpoint import read_tensor_shapes, resolve_checkpoint_dir
    from hylo_bench.models.gguf import conversion_info

    d = resolve_checkpoint_dir(spec)
    try:
        c = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{d / 'config.json'}: unreadable ({e})") from None
    n_heads = c.get("num_attention_heads")
    head_dim = c.get("head_dim") or (c["hidden_size"] // n_heads if n_heads else None)
    n_kv = c.get("num_key_value_heads") or n_heads
    shapes = read_tensor_shapes(d)
    params = sum(math.prod(s) for s, _ in shapes.values())
    tied = bool(c.get("tie_word_embeddings", False))
    rope = c.get("rope_parameters") or {"rope_theta": c.get("rope_theta"), **(c.get("rope_scaling") or {})}
    return {"name": str(spec), "kind": "transformer", "path": str(d), "model_type": c.get("model_type"),
            "num_layers": c.get("num_hidden_layers"), "hidden_size": c.get("hidden_size"),
            "intermediate_size": c.get("intermediate_size"), "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv, "head_dim": head_dim, "vocab_size": c.get("vocab_size"), "params": params,
            "kv_cache_bytes_per_token": 2 * c.get("num_hidden_layers", 0) * n_kv * head_dim * M.BF16_BYTES,
            "max_position_embeddings": c.get("max_position_embeddings"), "rope": rope,
            "dtype": {"stored": c.get("dtype") or c.get("torch_dtype")},
            "embeddings": {"tied": tied, "upcycled_lm_head": "untied copy of the embedding" if tied else "copied"},
            "converted_from": conversion_info(d)}


def kv_report(spec: str, **kw) -> dict[str, Any]:
    """The ``hylo-bench kv --json`` object: :func:`hylo_bench.models.memory.estimate` for the target, with
    ``max_model_len`` defaulting to its trained context. Keyword arguments go to ``estimate``."""
    t = resolve_target(spec)
    counts = parameter_counts(t.config)
    kw.setdefault("max_model_len", None)
    if kw["max_model_len"] is None:
        kw["max_model_len"] = t.trained_context_tokens
    est = M.estimate(t.config, weight_params=counts["total"], fp32_params=counts["fp32_params"], **kw)
    n_mla = len(t.config.mla_layers)
    return {"name": t.name, "kind": t.kind,
            "layout": f"{n_mla}MLA{t.config.n_layer - n_mla}{'GDN' if t.config.linear_type == 'gdn' else 'M2'}",
            "trained_context_tokens": t.trained_context_tokens, **est}


def render_info(d: dict[str, Any]) -> list:
    """Rich renderables for ``hylo-bench info`` (summary, per-component parameters, layer plan)."""
    from rich.table import Table

    if d["kind"] == "transformer":
        return [_render_transformer(d)]

    summary = Table(title=f"{d['name']} ({d['kind']})", show_header=False)
    ctx = d["trained_context_tokens"]
    rope = d["rope"]
    rs = rope["rope_scaling"]
    yarn = (f"YaRN factor {rs.get('factor')}, original {rs.get('original_max_position_embeddings')}, cos/sin x "
            f"{rope['yarn_mscale']}" if rope["yarn_active"] else "plain RoPE (no interpolation)")
    if rope.get("softmax_mscale2", 1.0) != 1.0:
        yarn += f", softmax scale x {rope['softmax_mscale2']} (mscale_all_dim)"
    rows = [("layout", f"{d['layout']}  (MLA layers {d['mla_layers']})"),
            ("backbone / teacher", f"{d['backbone'] or '-'} / {d['teacher'] or '-'}"),
            ("parameters", f"{d['params']:,}  ({d['params_detail']['source']})"),
            ("KV cache / token", f"{d['kv_cache_bytes_per_token']:,} B bf16 = {d['kv_cache_pct_of_base']:.2f}% of "
                                 f"the backbone's {d['backbone_kv_cache_bytes_per_token']:,} B"),
            ("state / sequence", f"{d['state_bytes_per_sequence']:,} B ({U.format_bytes(d['state_bytes_per_sequence'])}"
                                 f"; recurrent fp32, conv bf16)"),
            ("trained context", f"{ctx:,} tokens" if ctx else "unknown"),
            ("MLA RoPE", f"theta {rope['rope_theta']:g}; {yarn}"),
            ("dtype", f"compute {d['dtype']['compute']}, stored {d['dtype']['stored'] or 'unknown'}"),
            ("lm_head", d["embeddings"]["note"])]
    for k, v in rows:
        summary.add_row(k, v)
    comp = Table(title="parameters by component")
    comp.add_column("component")
    comp.add_column("params", justify="right")
    for k, v in d["params_detail"]["by_component"].items():
        comp.add_row(k, f"{v:,}")
    layers = Table(title="layers")
    for col in ("layer", "mixer", "params", "mixer params", "KV B/token", "state B/seq"):
        layers.add_column(col, justify="right")
    for lay in d["layers"]:
        layers.add_row(str(lay["index"]), lay["mixer"], f"{lay['params']:,}", f"{lay['mixer_params']:,}",
                       f"{lay['kv_cache_bytes_per_token']:,}", f"{lay['state_bytes_per_sequence']:,}")
    return [summary, comp, layers]


def _render_transformer(d: dict[str, Any]):
    from rich.table import Table

    t = Table(title=f"{d['name']} (transformer)", show_header=False)
    src = d.get("converted_from")
    rows = [("architecture", f"{d['model_type']}: {d['num_layers']} layers, hidden {d['hidden_size']}, "
                             f"{d['num_attention_heads']} heads / {d['num_key_value_heads']} KV heads of "
                             f"{d['head_dim']}, vocab {d['vocab_size']:,}"),
            ("parameters", f"{d['params']:,}"),
            ("KV cache / token", f"{d['kv_cache_bytes_per_token']:,} B bf16"),
            ("context", f"{d['max_position_embeddings']:,} tokens; RoPE {d['rope']}"),
            ("embeddings", ("tied (lm_head = embedding); an upcycled hybrid gets an untied lm_head, a copy of "
                            "the embedding") if d["embeddings"]["tied"] else "untied"),
            ("weights", f"{d['path']} ({d['dtype']['stored'] or 'unknown dtype'})")]
    if src:
        rows.append(("converted from", f"{src['source']} (GGUF v{src['gguf_version']}, "
                                       f"{', '.join(f'{k} x{v}' for k, v in src['quantization'].items())}; "
                                       f"sha256 {src['sha256'][:16]}...)"))
    for k, v in rows:
        t.add_row(k, v)
    return t


def render_kv(d: dict[str, Any]) -> list:
    """Rich renderables for ``hylo-bench kv``."""
    from rich.table import Table

    t = Table(title=f"memory model: {d['name']} ({d['layout']})", show_header=False)
    fb = U.format_bytes
    rows = [("KV cache / token", f"{d['kv_cache_bytes_per_token']:,} B (backbone "
                                 f"{d['backbone']['kv_cache_bytes_per_token']:,} B; {d['kv_cache_pct_of_base']:.2f}%)"),
            ("state / sequence", f"{d['state_bytes_per_sequence']:,} B ({fb(d['state_bytes_per_sequence'])})"),
            ("weights (bf16)", f"{d['weight_bytes']:,} B ({fb(d['weight_bytes'])}); backbone "
                               f"{fb(d['backbone']['weight_bytes'])}")]
    if "max_context_tokens" in d:
        mc = d["max_context_tokens"]
        rows.append(("largest context / GPU", f"hybrid {mc['hybrid']:,} tokens; backbone {mc['backbone']:,} tokens "
                                              f"(budget {fb(d['gpu']['budget_bytes'])}, batch 1)"
                     if mc["hybrid"] is not None else f"hybrid unbounded by KV; backbone {mc['backbone']:,}"))
    p = d["vllm"]["page"]
    rows.append(("vLLM page", f"block {p['block_size_tokens']:,} tokens, page {p['page_bytes']:,} B (state "
                              f"{p['state_page_bytes']:,} B, padding {p['padding_pct']}%), groups {p['mla_groups']} "
                              f"MLA + {p['linear_groups']} linear of {p['group_size']} ({p['padding_layers']} pad)"))
    cap = d["vllm"].get("capacity")
    if cap:
        rows.append(("vLLM capacity", f"{cap['num_blocks']:,} blocks; {cap['blocks_per_request']} per "
                                      f"{cap['max_model_len']:,}-token request; "
                                      f"concurrency {cap['max_concurrency']:.2f}x; "
                                      f"KV cache size {cap['kv_cache_size_tokens']:,} tokens; max model len "
                                      f"{cap['max_model_len_tokens']:,}"))
    for k, v in rows:
        t.add_row(k, v)
    return [t]
