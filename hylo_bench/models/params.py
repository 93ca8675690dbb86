"""Parameter counts of a hybrid config: total, per component, per mixer type, per layer, per mixer tensor.

From the shape tables of checkpoint-format.md §4 when they cover the config (pure Python: ``hylo-bench info``
stays torch-free), else from ``HyLoForCausalLM`` built on the meta device (torch imported then). Used by ``info``
and by the training-memory model (``upcycle.train.memory``).
"""

from __future__ import annotations

from typing import Any

from hylo_bench.models import memory as M


def _tables_cover(cfg) -> bool:
    """True when the checkpoint-format.md shape tables describe every tensor of this config's model (the
    released layouts: LoRA q path, no LoRA norms, no biases)."""
    return (cfg.q_lora_rank is not None and not cfg.use_lora_layer_norm and not cfg.attention_bias
            and not getattr(cfg, "mlp_bias", False))


def parameter_counts(cfg, *, meta_model: bool = False) -> dict[str, Any]:
    """Parameter counts of the hybrid: total, per component, per mixer type, per layer, per mixer tensor.

    Computed from the shape tables of checkpoint-format.md §4 when they cover the config (no torch model, no
    transformers modeling import: ``info`` stays fast; tests/test_info.py checks they equal the meta-device
    model for every recipe), else (or with ``meta_model``) from ``HyLoForCausalLM`` built on the meta device
    (no memory, no init compute). ``source`` says which. ``fp32_params``: GDN ``A_log`` / ``dt_bias``.
    """
    if meta_model or not _tables_cover(cfg):
        import torch

        from hylo_bench.config.hylo_config import HyLoConfig
        from hylo_bench.models.hybrid import HyLoForCausalLM

        hcfg = HyLoConfig.from_spec(cfg)
        with torch.device("meta"):
            model = HyLoForCausalLM(hcfg)
        named, source = {k: v.numel() for k, v in model.named_parameters()}, "meta-device model"
    else:
        named, source = _analytic_named(cfg), "shape tables (checkpoint-format.md §4)"
    fp32 = sum(n for k, n in named.items() if k.endswith(("A_log", "dt_bias")) and cfg.linear_type == "gdn")
    return _aggregate(cfg, named, source) | {"fp32_params": fp32}


def _analytic_named(cfg) -> dict[str, int]:
    """Parameter name -> element count from the shape tables (``M.analytic_mixer_params`` for the mixers)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    named = {"model.embed_tokens.weight": cfg.vocab_size * H, "model.norm.weight": H,
             "lm_head.weight": cfg.vocab_size * H}
    for i, kind in enumerate(cfg.mixer_types):
        pre = f"model.layers.{i}."
        named.update({pre + k: n for k, n in M.analytic_mixer_params(cfg, kind).items()})
        named.update({pre + "mlp.gate_proj.weight": I * H, pre + "mlp.up_proj.weight": I * H,
                      pre + "mlp.down_proj.weight": H * I, pre + "input_layernorm.weight": H,
                      pre + "post_attention_layernorm.weight": H})
    return named


def _aggregate(cfg, named: dict[str, int], source: str) -> dict[str, Any]:
    comp = {"embed_tokens": 0, "lm_head": 0, "final_norm": 0, "mlp": 0, "layer_norms": 0}
    mixers: dict[str, int] = {}
    per_layer = [{"mixer_params": 0, "params": 0} for _ in range(cfg.n_layer)]
    per_tensor: dict[str, dict[str, int]] = {}
    for key, n in named.items():
        parts = key.split(".")
        if key.startswith("model.embed_tokens."):
            comp["embed_tokens"] += n
        elif key.startswith("lm_head."):
            comp["lm_head"] += n
        elif key.startswith("model.norm."):
            comp["final_norm"] += n
        elif parts[:2] == ["model", "layers"]:
            i, attr = int(parts[2]), parts[3]
            per_layer[i]["params"] += n
            if attr == "mlp":
                comp["mlp"] += n
            elif attr.endswith("layernorm"):
                comp["layer_norms"] += n
            else:
                kind = cfg.mixer_types[i]
                mixers[kind] = mixers.get(kind, 0) + n
                per_layer[i]["mixer_params"] += n
                if i == cfg.mixer_types.index(kind):  # one layer of each type is enough
                    per_tensor.setdefault(kind, {})[".".join(parts[3:])] = n
        else:
            comp.setdefault("other", 0)
            comp["other"] += n
    return {"total": sum(named.values()), "by_component": comp | {f"mixer_{k}": v for k, v in mixers.items()},
            "by_mixer_type": mixers, "per_layer": per_layer, "per_mixer_tensor": per_tensor, "source": source}
