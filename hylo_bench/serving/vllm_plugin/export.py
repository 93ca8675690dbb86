"""``hylo-bench export-vllm CKPT OUT``: a HyLo checkpoint laid out for vLLM (no vLLM import here).

vLLM reads the architecture from ``config.json``; a HyLo checkpoint's ``config.json`` is the base model's
(checkpoint-format.md sec. 2), so OUT gets a new one:

- ``"architectures": ["HyLoForCausalLM"]`` (served by :mod:`hylo_bench.serving.vllm_plugin.model`);
- ``"model_type": "deepseek_v2"``: vLLM switches MLA sizing on by ``model_type`` plus ``kv_lora_rank``
  (vllm.md sec. 3); any other type silently gets ordinary attention sizing;
- DeepSeek-V2 MLA keys with ``num_key_value_heads = num_attention_heads`` (the plugin expands HyLo's n_kvm
  ``kv_b_proj`` heads to n_h at load, vllm.md sec. 4) and a dense MLP on every layer
  (``first_k_dense_replace = n_layer``, no experts);
- Qwen3-Next-style GDN keys (``linear_num_key_heads`` ... ``linear_conv_kernel_dim``) read by vLLM's
  ``QwenGatedDeltaNetAttention`` and by the plugin's ``IsHybrid`` classmethods, with HyLo's value head
  (expand_v * K) written as expand_v value heads of K dims (exact, see ``model.HyLoGatedDeltaNet``);
- for Mamba-2 layouts (``linear_type = "mamba"``), the sizes vLLM's ``MambaMixer2`` is built with and its
  ``IsHybrid`` classmethods read, in NemotronH names (vllm.md sec. 5.1): ``mamba_num_heads`` H,
  ``mamba_head_dim`` = ``ssm_state_size`` N, ``n_groups`` = H, ``conv_kernel`` W, ``chunk_size``,
  ``use_conv_bias``; plus ``hylo_mamba_d_xb`` (HyLo's x / B width, repeated to H heads at load, see
  ``model.HyLoForCausalLM._load_mamba``) and ``hylo_mamba_norm_eps``;
- ``hylo_layer_types`` (``"mla"`` / ``"gdn"`` / ``"mamba"`` per layer), ``hylo_linear_type``,
  ``hylo_num_kv_groups`` (n_kvm), ``hylo_gdn_norm_eps``, ``hylo_mla_rope_scaling``.

Weights and tokenizer files are hard-linked (copied across file systems); the weight names stay HyLo's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from hylo_bench.io_utils import atomic_write_text

_SKIP = {"config.json"}
MAMBA_NORM_EPS = 1e-5  # hylo_bench.models.mamba2.Mamba2's gated-norm eps (Zebra-Llama; hybrid.py keeps the default)
MAMBA_CHUNK_SIZE = 256  # vLLM's SSD chunk (mamba_ssm default); the CPU scan ignores it
_LINK_SUFFIXES = (".safetensors", ".bin", ".model", ".txt", ".jinja")


def vllm_config_dict(spec) -> dict[str, Any]:
    """The ``config.json`` vLLM needs for a HyLo hybrid.

    Args:
        spec: a :class:`hylo_bench.config.hybrid.HybridSpec` (or ``HyLoConfig``).

    Returns:
        JSON-serialisable dict (keys described in the module docstring).

    Raises:
        ValueError: for layouts the plugin cannot serve: Qwen3 q/k norms inside MLA (they act on the
            decompressed key, which the absorbed MLA decode never forms; checkpoint-format.md sec. 4.3 (d)),
            attention biases, a linear type other than ``gdn`` / ``mamba``, Mamba-2 dims that break
            ``HybridSpec.mamba_dims``' rules, a YaRN ``attention_factor``, or Mamba-2 ``ssm_cfg`` options
            vLLM's ``MambaMixer2`` does not have (``norm_before_gate``, ``dt_limit``).
    """
    if spec.linear_type not in ("gdn", "mamba") and len(spec.mla_layers) < spec.n_layer:
        raise ValueError(f"linear_type {spec.linear_type!r}: the vLLM plugin serves MLA + GDN / Mamba-2 hybrids")
    if spec.mla_layers and spec.use_qk_norm:
        raise ValueError("use_qk_norm = true (Qwen3 q/k norms in MLA layers) cannot be served by vLLM's MLA: "
                         "the norm acts on the decompressed key, which the absorbed decode never forms")
    if spec.mla_layers and getattr(spec, "layer_rank_list", None):
        raise ValueError("layer_rank_list gives the MLA layers different ranks; vLLM's DeepSeek-V2 sizing has one "
                         "kv_lora_rank / q_lora_rank for all layers")
    if spec.mla_layers and spec.attention_bias:
        raise ValueError("attention_bias = true is not supported by the vLLM plugin (no released layout uses it)")
    types = spec.mixer_types
    expand_v = spec.gdn_value_head_dim // spec.gdn_head_dim if "gdn" in types else 1
    if "gdn" in types and expand_v * spec.gdn_head_dim != spec.gdn_value_head_dim:
        raise ValueError(f"gdn_expand_v = {spec.gdn_expand_v}: the vLLM plugin needs a whole number (the value "
                         "head is served as expand_v heads of the key head dim)")
    rope_scaling = spec.mla_rope_scaling
    if spec.mla_layers and rope_scaling and rope_scaling.get("attention_factor") is not None:
        raise ValueError("rope_scaling.attention_factor is not mapped to vLLM's deepseek_yarn rotary embedding (it "
                         "takes the cos/sin scale from mscale / mscale_all_dim only); remove it or serve with "
                         "hylo-bench's own engine")
    cfg: dict[str, Any] = {
        "architectures": ["HyLoForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.intermediate_size,
        "hidden_act": spec.hidden_act,
        "num_hidden_layers": spec.n_layer,
        "rms_norm_eps": spec.rms_norm_eps,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # MLA (DeepSeek-V2 names)
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,
        "kv_lora_rank": spec.kv_lora_rank,
        "q_lora_rank": spec.q_lora_rank,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "rope_theta": spec.mla_rope_theta,
        "attention_bias": False,
        "n_routed_experts": 0,
        "n_shared_experts": 0,
        "num_experts_per_tok": 0,
        "first_k_dense_replace": spec.n_layer,
        "moe_layer_freq": 1,
        # GDN (Qwen3-Next names). HyLo's value head (expand_v * K) is served as expand_v value heads of K
        # dims per q/k head (exact; see model.HyLoGatedDeltaNet); same state bytes.
        "linear_num_key_heads": spec.gdn_num_heads,
        "linear_num_value_heads": spec.gdn_num_heads * expand_v,
        "linear_key_head_dim": spec.gdn_head_dim,
        "linear_value_head_dim": spec.gdn_head_dim,
        "linear_conv_kernel_dim": spec.gdn_conv_size,
        # HyLo specifics read by the plugin
        "hylo_layer_types": types,
        "hylo_linear_type": spec.linear_type,
        "hylo_num_kv_groups": spec.num_key_value_heads,
        "hylo_gdn_norm_eps": spec.gdn_norm_eps,
        "hylo_use_lora_layer_norm": bool(spec.use_lora_layer_norm),
        "hylo_mla_rope_scaling": rope_scaling,
    }
    if "mamba" in types:
        # vLLM MambaMixer2 sizes: HyLo's H heads of N dims with n_groups = H (C is per head; x / B of width
        # d_xb are repeated to H heads at load), so vLLM's gated-norm group (E / n_groups = N) is HyLo's.
        m = spec.mamba_dims()
        opts = spec.mamba_options()
        if opts["norm_before_gate"] or opts["dt_limit"] != (0.0, float("inf")):
            raise ValueError(f"ssm_cfg norm_before_gate = {opts['norm_before_gate']}, dt_limit = {opts['dt_limit']}: "
                             "vLLM's MambaMixer2 gates before its norm and does not clamp dt; the plugin serves "
                             "only the Zebra-Llama defaults (false, [0, inf])")
        cfg.update({
            "mamba_num_heads": m["ngroups"], "mamba_head_dim": m["d_state"], "ssm_state_size": m["d_state"],
            "n_groups": m["ngroups"], "conv_kernel": m["d_conv"], "chunk_size": MAMBA_CHUNK_SIZE,
            "use_conv_bias": True,
            "hylo_mamba_d_xb": m["d_xb"], "hylo_mamba_norm_eps": MAMBA_NORM_EPS,
        })
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(spec, k, None) is not None:
            cfg[k] = getattr(spec, k)
    return cfg


def export_vllm(ckpt: str | Path, out: str | Path) -> Path:
    """Write ``OUT/config.json`` for vLLM and link the checkpoint's weights and tokenizer files into OUT.

    Args:
        ckpt: a HyLo checkpoint directory (``config.json`` + ``hybrid_config.json`` + weights).
        out: output directory (created; must not be ``ckpt`` itself, whose ``config.json`` is the base's).

    Returns:
        The path of the written ``config.json``.

    Raises:
        FileNotFoundError: a missing config file or no weight file in ``ckpt``.
        ValueError: ``out`` is ``ckpt``, or the layout cannot be served (see :func:`vllm_config_dict`).
    """
    from hylo_bench.config.hybrid import HybridSpec

    src, dst = Path(ckpt), Path(out)
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"{dst}: the output directory must differ from the checkpoint (its config.json is the "
                         "base model's and is read by hylo-bench)")
    spec = HybridSpec.from_directory(src)
    cfg = vllm_config_dict(spec)
    files = [p for p in sorted(src.iterdir()) if p.is_file() and p.name not in _SKIP
             and (p.suffix in _LINK_SUFFIXES or p.suffix == ".json")]
    if not any(p.suffix in (".safetensors", ".bin") for p in files):
        raise FileNotFoundError(f"{src}: no weight file (model.safetensors, shards or pytorch_model.bin)")
    dst.mkdir(parents=True, exist_ok=True)
    for p in files:
        target = dst / p.name
        if target.exists():
            target.unlink()
        try:
            os.link(p, target)
        except OSError:
            shutil.copy2(p, target)
    path = dst / "config.json"
    atomic_write_text(path, json.dumps(cfg, indent=2) + "\n")
    return path
