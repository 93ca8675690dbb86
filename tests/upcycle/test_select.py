"""Automatic MLA layer placement: per-layer KL scores, the spread-constrained pick, the run wiring."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import torch.nn.functional as F

from hylo_bench.config.student import hybrid_config_for
from hylo_bench.upcycle.select import (
    auto_layout,
    choose_layers,
    linear_layer_for,
    min_gap,
    score_layers,
    select_layers,
)
from tests.conftest import make_base


def _peaked_base(important: int | None = None, vocab_size: int = 400):
    """Tiny Llama with peaked logits (lm_head x10). With ``important``, every other layer gets a zero
    ``input_layernorm`` weight: its mixer input is 0, so attention and any linear replacement both output
    exactly 0 there (no biases; GDN and Mamba-2 gate by silu(z(0)) = 0), and only ``important`` can score > 0."""
    base = make_base(vocab_size=vocab_size)
    with torch.no_grad():
        base.lm_head.weight.mul_(10)
        for j, layer in enumerate(base.model.layers):
            if important is not None and j != important:
                layer.input_layernorm.weight.zero_()
    return base


def _windows(n=3, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n, t), generator=g)


def test_auto_layout_parsing():
    assert auto_layout("auto:7MLA21GDN") == "7MLA21GDN"
    assert auto_layout(" AUTO: 14MLA14M2") == "14MLA14M2"
    assert auto_layout("7MLA21GDN") is None and auto_layout(None) is None


@pytest.mark.parametrize("linear_type", ["gdn", "mamba"])
def test_scores_match_a_model_with_that_layer_replaced(linear_type):
    """Reference: a forward hook swaps the attention output of one layer for the linear mixer's, full [N, V]
    logits, and torch's kl_div; the scorer instead swaps the module and uses the logit-free chunked KL."""
    base = _peaked_base()
    x = _windows()
    cfg = hybrid_config_for(base.config, [], linear_type)
    scores = score_layers(base, cfg, x, seed=5, batch_size=2)
    with torch.no_grad():
        p_log = F.log_softmax(base(x).logits.float(), -1)
        for i, layer in enumerate(base.model.layers):
            mixer = linear_layer_for(base, cfg, i, seed=5)

            def swap(module, args, kwargs, output, mixer=mixer):
                return mixer(kwargs["hidden_states"], attention_mask=None)[0], None

            h = layer.self_attn.register_forward_hook(swap, with_kwargs=True)
            try:
                q_log = F.log_softmax(base(x).logits.float(), -1)
            finally:
                h.remove()
            ref = F.kl_div(q_log.flatten(0, 1), p_log.flatten(0, 1), log_target=True, reduction="sum") / x.numel()
            assert scores[i] == pytest.approx(ref.item(), rel=1e-4, abs=1e-6), i
    assert min(scores) > 0.05  # every layer matters in this model: a non-trivial comparison
    # the base model is left unchanged
    assert type(base.model.layers[0].self_attn).__name__ == "LlamaAttention"


def test_linear_init_copies_the_attention_weights():
    base = _peaked_base()
    cfg = hybrid_config_for(base.config, [], "mamba")
    mixer = linear_layer_for(base, cfg, 1, seed=0)
    att = base.model.layers[1].self_attn
    assert torch.equal(mixer.out_proj.weight, att.o_proj.weight)
    d_inner, d_xb = cfg.mamba_dims()["d_inner"], cfg.mamba_dims()["d_xb"]
    assert torch.equal(mixer.in_proj.weight[d_inner:d_inner + d_xb], att.v_proj.weight)


def test_auto_selection_picks_the_important_layer():
    base = _peaked_base(important=1)
    res = select_layers(base, _windows(), "1MLA3GDN", seed=0)
    assert res["mla_layers"] == [1] and res["rank"][1] == 1
    assert res["scores"][1] > 0.5 and [res["scores"][j] for j in (0, 2, 3)] == [0.0, 0.0, 0.0]
    assert res["linear_type"] == "gdn" and res["n_mla"] == 1 and len(res["scores"]) == 4
    m2 = select_layers(base, _windows(), "1MLA3M2", seed=0)
    assert m2["mla_layers"] == [1] and m2["linear_type"] == "mamba" and m2["scores"][1] > 0.5


def test_choose_layers_greedy_with_spread():
    # top two scores are adjacent (5, 6); with 8 layers and 2 MLA the gap is floor(8 / 4) = 2
    scores = [0.1, 0.2, 0.3, 0.1, 0.2, 0.9, 0.8, 0.5]
    assert min_gap(8, 2) == 2
    assert choose_layers(scores, 2) == [5, 7]
    assert choose_layers(scores, 1) == [5]
    assert choose_layers(scores, 0) == []
    assert choose_layers([1.0] * 8, 2) == [0, 2] and choose_layers([1.0] * 4, 2) == [0, 1]  # ties: lower index
    with pytest.raises(ValueError, match="asks for 5 MLA layers"):
        choose_layers([0.0] * 4, 5)
    with pytest.raises(ValueError, match="finite"):
        choose_layers([0.0, float("nan")], 1)


def test_spread_constraint_holds_for_random_scores():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 40)
        k = rng.randint(0, n)
        scores = [rng.random() for _ in range(n)]
        chosen = choose_layers(scores, k)
        assert len(chosen) == k == len(set(chosen))
        gap = min_gap(n, k)
        assert all(b - a >= gap for a, b in itertools.pairwise(chosen))
        if k:  # the best layer is always kept
            assert scores.index(max(scores)) in chosen


def test_upcycle_auto_layout_writes_selection(tmp_path, tiny_tokenizer):
    from hylo_bench.config.upcycle import UpcycleConfig
    from hylo_bench.models.hybrid import load_hylo
    from hylo_bench.upcycle.run import run

    base_dir = tmp_path / "base"
    base = _peaked_base(important=3, vocab_size=len(tiny_tokenizer))
    base.save_pretrained(base_dir)
    tiny_tokenizer.save_pretrained(base_dir)
    cfg = UpcycleConfig(out=str(tmp_path / "out"), base=str(base_dir), data="demo", allow_demo_data=True,
                        stages="64:ild@256",
                        layout="auto:1MLA3GDN", batch_size=2, eval_windows=0, select_windows=2, device="cpu")
    manifest = run(cfg)
    sel = json.loads((tmp_path / "out" / "layer_selection.json").read_text())
    assert sel["mla_layers"] == [3] and manifest["layer_selection"] == sel
    assert sel["calibration"] == {"data": "demo", "seed": 42 + 104_729, "num_windows": 2, "seq_len_tokens": 64}
    assert load_hylo(tmp_path / "out", dtype=None).config.mla_layers == [3]
    assert manifest["settings"]["layout"] == [3]
    with pytest.raises(ValueError, match="drop --mla-layers"):
        run(UpcycleConfig(out=str(tmp_path / "o2"), base=str(base_dir), layout="auto:1MLA3GDN", mla_layers=[0],
                          device="cpu", allow_demo_data=True))


def test_cli_auto_layout_with_bad_counts_names_the_flag(tiny_base_dir, tmp_path):
    from typer.testing import CliRunner

    from hylo_bench.cli import app

    res = CliRunner().invoke(app, ["upcycle", "--base", str(tiny_base_dir), "--out", str(tmp_path / "o"),
                                   "--layout", "auto:3MLA3GDN", "--device", "cpu", "--allow-demo-data"])
    assert res.exit_code == 2 and "--layout '3MLA3GDN' has 3+3=6 layers; the base model has 4" in res.output
