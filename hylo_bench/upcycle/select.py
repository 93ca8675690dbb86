"""Automatic MLA layer placement (``--layout auto:7MLA21GDN``): score each attention layer, keep the most needed.

Legend: B batch, T tokens, D hidden, L layers.

Score of layer l: the forward KL(p_base || p_l) in nats/token, where p_l is the base model with layer l's
attention ALONE replaced by its linear stage-0 init (GDN: checkpoint-format.md §7.4; Mamba-2: §7.3, the same
functions the student init uses), averaged over every position of a few calibration windows from ``--data``.
A high score means the layer's attention is hard to replace, so it stays attention (as MLA).

Selection rule (greedy with a spread constraint): visit layers by descending score (ties: lower index first)
and keep a layer when it is at least ``min_gap = max(1, floor(L / (2 * n_mla)))`` layers away from every
layer kept so far; stop at ``n_mla``. This always fills ``n_mla`` slots: each kept layer blocks at most
``2 * min_gap - 1 <= L / n_mla - 1`` positions, so fewer than ``n_mla`` kept layers never block all L. No layer
is forced in (the released lists keep layer 0 or 1; this rule does not).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import nn

from hylo_bench.io_utils import atomic_write_json

logger = logging.getLogger(__name__)

AUTO_PREFIX = "auto:"
SELECTION_FILE = "layer_selection.json"


def auto_layout(layout: str | None) -> str | None:
    """``"auto:7MLA21GDN"`` -> ``"7MLA21GDN"``; any other value (a plain layout, None) -> None."""
    if layout is not None and layout.strip().lower().startswith(AUTO_PREFIX):
        return layout.strip()[len(AUTO_PREFIX):].strip()
    return None


def min_gap(n_layer: int, n_mla: int) -> int:
    """Smallest allowed distance between two MLA layers: ``max(1, floor(n_layer / (2 * n_mla)))`` (layers)."""
    return max(1, n_layer // (2 * max(1, n_mla)))


def choose_layers(scores: list[float], n_mla: int) -> list[int]:
    """Greedy spread-constrained pick of ``n_mla`` layers by descending score (module docstring rule).

    Args:
        scores: one score per layer (higher = keep as attention). n_mla: how many to keep.

    Returns:
        Sorted layer indices, ``len == n_mla``.

    Raises:
        ValueError: when ``n_mla`` is not in ``[0, len(scores)]`` or a score is not finite.
    """
    n = len(scores)
    if not 0 <= n_mla <= n:
        raise ValueError(f"auto layout asks for {n_mla} MLA layers but the model has {n} layers")
    if not all(math.isfinite(s) for s in scores):
        raise ValueError(f"layer scores must be finite, got {scores}; the base model or the calibration data "
                         f"produce NaN/inf logits")
    gap = min_gap(n, n_mla)
    chosen: list[int] = []
    for i in sorted(range(n), key=lambda j: (-scores[j], j)):
        if len(chosen) == n_mla:
            break
        if all(abs(i - j) >= gap for j in chosen):
            chosen.append(i)
    assert len(chosen) == n_mla, (scores, n_mla, gap)  # guaranteed by the gap bound (module docstring)
    return sorted(chosen)


class _MixerAsAttention(nn.Module):
    """Stands in for an HF ``self_attn``: runs a linear mixer on the (already normed) input, no cache."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        out, _ = self.mixer(hidden_states, attention_mask=None, state=None, use_cache=False)
        return out, None


def linear_layer_for(base: nn.Module, linear_config, layer_idx: int, seed: int) -> nn.Module:
    """The linear mixer that replaces base layer ``layer_idx``, initialised from its attention (stage 0).

    The mixer-specific random parameters come from ``torch.manual_seed(seed + layer_idx)`` (the global RNG is
    restored afterwards).

    Args:
        base: HF Llama / Qwen3 causal LM. linear_config: ``HyLoConfig`` with no MLA layers (all linear).

    Returns:
        The mixer module (GDN or Mamba-2) on the base model's device and dtype.
    """
    from hylo_bench.config.student import base_dims
    from hylo_bench.models.hybrid import HyLoDecoderLayer
    from hylo_bench.upcycle.transfer import init_mixer_from_attention

    p = next(base.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + layer_idx)
        layer = HyLoDecoderLayer(linear_config, layer_idx)
    assert layer.mixer_type != "mla", "linear_config must have no MLA layers"
    init_mixer_from_attention(layer, base.model.layers[layer_idx].self_attn, linear_config,
                              base_dims(base.config), layer_idx=layer_idx)
    return layer.mixer.to(device=p.device, dtype=p.dtype).eval()


@torch.no_grad()
def score_layers(base: nn.Module, linear_config, windows: torch.Tensor, *, seed: int, batch_size: int = 4,
                 chunk_size: int = 2048) -> list[float]:
    """Per-layer forward KL(p_base || p_l) of the base model with layer l alone replaced by its linear init.

    Args:
        base: HF Llama / Qwen3 causal LM (left unchanged: each replacement is undone).
        linear_config: all-linear ``HyLoConfig`` for ``base`` (``hybrid_config_for(base.config, [], type)``).
        windows: [N, T] int64 calibration token windows (every position counts).
        seed: per-layer init seed base (:func:`linear_layer_for`). batch_size: windows per forward.
        chunk_size: rows per chunk of the logit-free KL (``hylo_bench.kernels.kl.chunked_kl_div``).

    Returns:
        L scores in nats/token (token-mean forward KL, training-recipe.md §3.2), layer order.
    """
    from hylo_bench.kernels.kl import chunked_kl_div

    device = next(base.parameters()).device
    layers = base.model.layers
    head = base.lm_head.weight
    sums = [0.0] * len(layers)
    n_tok = 0
    teacher_hidden = []
    for b0 in range(0, len(windows), batch_size):
        x = windows[b0:b0 + batch_size].to(device)
        teacher_hidden.append(base.model(input_ids=x, use_cache=False).last_hidden_state.flatten(0, 1))
        n_tok += x.numel()
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        layer.self_attn = _MixerAsAttention(linear_layer_for(base, linear_config, i, seed))
        try:
            for k, b0 in enumerate(range(0, len(windows), batch_size)):
                x = windows[b0:b0 + batch_size].to(device)
                h = base.model(input_ids=x, use_cache=False).last_hidden_state.flatten(0, 1)
                kl = chunked_kl_div(h, head, teacher_hidden[k], head, chunk_size=chunk_size)
                sums[i] += kl.item() * x.numel()
        finally:
            layer.self_attn = attn
    return [s / n_tok for s in sums]


def select_layers(base: nn.Module, windows: torch.Tensor, layout: str, *, seed: int,
                  mixer_overrides: dict | None = None, calibration: dict | None = None) -> dict:
    """Score every layer and choose the MLA layers for ``layout`` (``"7MLA21GDN"``, without ``auto:``).

    Args:
        base: HF Llama / Qwen3 causal LM. windows: [N, T] calibration windows. seed: init seed base.
        mixer_overrides: GDN / Mamba-2 dim overrides (as for ``hybrid_config_for``).
        calibration: description of the windows recorded in the result (data source, seed, ...).

    Returns:
        ``{"layout", "linear_type", "n_layer", "n_mla", "metric", "scores", "rank", "min_gap", "mla_layers",
        "rule", "calibration"}``; ``rank[l]`` is 1 for the highest score.

    Raises:
        ValueError: malformed layout or a count that does not match the model.
    """
    from hylo_bench.config.hybrid import parse_layout
    from hylo_bench.config.student import hybrid_config_for

    n_layer = base.config.num_hidden_layers
    default, linear_type = parse_layout(layout, n_layer)
    overrides = {k: v for k, v in (mixer_overrides or {}).items() if v is not None}
    linear_config = hybrid_config_for(base.config, [], linear_type, **overrides)
    scores = score_layers(base, linear_config, windows, seed=seed)
    order = sorted(range(n_layer), key=lambda j: (-scores[j], j))
    rank = [0] * n_layer
    for r, j in enumerate(order, 1):
        rank[j] = r
    n_mla = len(default)
    return {"layout": f"{AUTO_PREFIX}{layout}", "linear_type": linear_type, "n_layer": n_layer, "n_mla": n_mla,
            "metric": "forward KL(p_base || p_base with this layer's attention replaced by its linear init), "
                      "nats/token",
            "scores": scores, "rank": rank, "min_gap": min_gap(n_layer, n_mla),
            "mla_layers": choose_layers(scores, n_mla),
            "rule": "greedy by descending score (ties: lower index), keeping a layer only when it is at least "
                    "min_gap = max(1, floor(n_layer / (2 * n_mla))) layers from every kept layer",
            "calibration": dict(calibration or {}) | {"num_windows": int(windows.shape[0]),
                                                       "seq_len_tokens": int(windows.shape[1])}}


def save_selection(out_dir: str | Path, result: dict) -> Path:
    """Write ``result`` to ``out_dir/layer_selection.json`` (atomic); returns the path."""
    path = Path(out_dir) / SELECTION_FILE
    atomic_write_json(path, result)
    return path


def render_selection(result: dict):
    """A rich ``Table``: layer, score (nats/token), rank, and the chosen mixer of each layer."""
    from rich.table import Table

    lin = "GDN" if result["linear_type"] == "gdn" else "M2"
    table = Table(title=f"layer selection {result['layout']} (min gap {result['min_gap']})")
    table.add_column("layer", justify="right")
    table.add_column("KL if linear (nats/token)", justify="right")
    table.add_column("rank", justify="right")
    table.add_column("mixer")
    chosen = set(result["mla_layers"])
    for i, (s, r) in enumerate(zip(result["scores"], result["rank"])):
        table.add_row(str(i), f"{s:.5f}", str(r), "[bold green]MLA[/]" if i in chosen else lin)
    return table
