"""Models for serving sweeps: a checkpoint (``demo``, a directory, a hub id) or a random-weight build of a recipe's
real-size shapes, directly on the target device and dtype (no weights needed: speed and memory do not depend on
weight values). ``backbone:<recipe>`` builds the recipe's Llama / Qwen3 backbone the same way (the baseline).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BACKBONE_PREFIX = "backbone:"


def init_random_(model: torch.nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Fill every parameter in place: matrices / conv kernels N(0, std), norm weights and Mamba-2 D 1, other
    vectors 0; GDN / Mamba-2 gate parameters (A_log, dt_bias) by their modules' own initialisers."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif "norm" in name or name.endswith(".D"):
                p.fill_(1.0)
            else:
                p.zero_()
        for m in model.modules():
            for hook in ("_reset_gate_parameters", "reset_special_parameters"):
                if hasattr(m, hook):
                    getattr(m, hook)()


def _materialise(model: torch.nn.Module, device: str, dtype: torch.dtype, keep_fp32: tuple[str, ...]) -> None:
    """Meta-device model -> ``device`` with random values (``keep_fp32`` names stay float32). Buffers computed at
    construction (transformers' rotary ``inv_freq``) are rebuilt, since ``to_empty`` leaves them uninitialised."""
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):  # to_empty makes new Parameters per module, which unties tied heads
        model.tie_weights()
    for name, m in model.named_modules():
        if name and isinstance(getattr(m, "inv_freq", None), torch.Tensor) and hasattr(m, "config"):
            fresh = type(m)(m.config)
            with torch.no_grad():
                for buf_name, buf in fresh.named_buffers():
                    getattr(m, buf_name).copy_(buf)
    for name, p in model.named_parameters():
        target = torch.float32 if name.endswith(keep_fp32) else dtype
        p.data = p.data.to(target)
    init_random_(model)


def build_model(spec: str, device: str, dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
    """Load or build the model named by ``spec``.

    Args:
        spec: ``demo``, a checkpoint directory or hub id (weights loaded), a recipe name (random weights, the
            recipe's hybrid config) or ``backbone:<recipe>`` (random weights, the recipe's backbone config).
        device: ``cpu`` / ``cuda``.
        dtype: parameter dtype (GDN / Mamba-2 ``A_log`` and ``dt_bias`` stay fp32, as when loading).

    Returns:
        (model in eval mode, info with ``name``, ``kind`` ("hybrid" | "transformer"), ``layout``, ``weights``
        ("checkpoint" | "random"), ``config`` (the HyLoConfig or the HF backbone config)).

    Raises:
        ValueError: an unknown recipe (close names listed) or a bad checkpoint (file and key named; a checkpoint
        loads through :func:`hylo_bench.models.loading.load_causal_lm`, plain models with sdpa attention).
        FileNotFoundError: missing files.
    """
    from hylo_bench.config import recipes as R
    from hylo_bench.models.loading import layout_name, load_causal_lm

    name = spec.removeprefix(BACKBONE_PREFIX)
    is_recipe = not Path(name).expanduser().exists() and name != "demo" and R.find_recipe(name) is not None
    if spec.startswith(BACKBONE_PREFIX) and not is_recipe:
        raise ValueError(f"{spec!r}: 'backbone:' needs a recipe name, e.g. backbone:HyLo-Qwen-7MLA21GDN-8K-SFT; "
                         f"{R.unknown_recipe_message(name)}")
    if not is_recipe:  # weights only: the engine works on token ids, no tokenizer needed
        model, loaded = load_causal_lm(spec, device, dtype, attn_implementation="sdpa")
        return model, {"name": loaded["name"], "kind": loaded["kind"], "layout": loaded["layout"],
                       "weights": "checkpoint", "config": model.config}
    recipe = R.load_recipe(name)
    if spec.startswith(BACKBONE_PREFIX):
        from transformers import AutoModelForCausalLM

        cfg = R.base_config_for(recipe)
        cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        _materialise(model, device, dtype, ())
        return model.eval(), {"name": f"{recipe.backbone} (shape, random)", "kind": "transformer",
                              "layout": "transformer", "weights": "random", "config": cfg}
    from hylo_bench.models.hybrid import HyLoForCausalLM

    cfg = R.recipe_hybrid_config(recipe)
    with torch.device("meta"):
        model = HyLoForCausalLM(cfg)
    _materialise(model, device, dtype, ("A_log", "dt_bias"))
    return model.eval(), {"name": f"{recipe.name} (shape, random)", "kind": "hybrid", "layout": layout_name(model),
                          "weights": "random", "config": cfg}
