"""Recipes: the 14 released layouts (+ paper-only Mamba-2 ones) build exactly the architecture that
checkpoint-format.md specifies; KV-cache sizes match the paper; the recipe loader's errors; --recipe overrides.

Expected values are written from the spec's tables (checkpoint-format.md §1, §3.3, §3.4, §4.1-4.5, §6) with
explicit formulas below, not computed by the code under test.
"""

from __future__ import annotations

import time

import pytest
import torch
import yaml

from hylo_bench.config import recipes as R
from hylo_bench.config.upcycle import resolve_upcycle_cli

# checkpoint-format.md §1: the 14 released checkpoints.
RELEASED = sorted(
    f"HyLo-{fam}-{lay}-{ctx}-SFT"
    for fam, lays in (("Llama", ("4MLA12GDN", "8MLA8GDN", "6MLA22GDN", "14MLA14GDN")),
                      ("Qwen", ("7MLA21GDN", "14MLA14GDN", "14MLA14M2")))
    for lay in lays for ctx in ("8K", "64K"))
# §1: the Llama Mamba-2 models of the paper are not released; paper Table 4 also reports Qwen 7MLA21M2.
PAPER_ONLY = sorted(
    [f"HyLo-Llama-{lay}-{ctx}-SFT" for lay in ("4MLA12M2", "8MLA8M2", "6MLA22M2", "14MLA14M2") for ctx in ("8K", "64K")]
    + [f"HyLo-Qwen-7MLA21M2-{ctx}-SFT" for ctx in ("8K", "64K")])

# checkpoint-format.md §3.3 (per backbone) + vocab sizes (training-recipe.md §4.1: Llama-3 128,256, Qwen3
# 151,936) + base n_h / n_kv / d_h (public HF configs; §3.3 num_attention_heads, §5.1 d_qk = d_h).
SPEC = {
    "Llama-1B": dict(V=128256, H=2048, I=8192, L=16, n_h=32, n_kv=8, d_h=64, rq=1344, rkv=128, dR=32, dN=32, dV=64,
                     theta=500000.0, eps=1e-5, gdn_h=6, m2=(2048, 512, 32, 64), qwen=False,
                     yarn={8192: (4.0, 2048), 65536: (32.0, 2048)}),
    "Llama-3B": dict(V=128256, H=3072, I=8192, L=28, n_h=24, n_kv=8, d_h=128, rq=1536, rkv=128, dR=64, dN=64, dV=128,
                     theta=500000.0, eps=1e-5, gdn_h=9, m2=(3072, 1024, 24, 128), qwen=False,
                     yarn={8192: (4.0, 2048), 65536: (32.0, 2048)}),
    "Qwen": dict(V=151936, H=2048, I=6144, L=28, n_h=16, n_kv=8, d_h=128, rq=1344, rkv=256, dR=64, dN=64, dV=128,
                 theta=1000000.0, eps=1e-6, gdn_h=6, m2=(2048, 1024, 16, 128), qwen=True,
                 yarn={8192: (1.0, None), 65536: (2.0, 32768)}),
}
# §3.4 MLA layer lists.
MLA_LAYERS = {
    ("Llama-1B", 4): [1, 5, 10, 14], ("Llama-1B", 8): [0, 2, 4, 6, 8, 10, 12, 14],
    ("Llama-3B", 6): [0, 5, 10, 16, 21, 26], ("Llama-3B", 14): list(range(0, 28, 2)),
    ("Qwen", 7): [1, 5, 9, 13, 17, 21, 25], ("Qwen", 14): list(range(0, 28, 2)),
}
# §6 table (bf16 bytes per token, MLA only) and paper Tables 2-4 "KV cache %".
KV_BYTES = {("Llama-1B", 4): 1280, ("Llama-1B", 8): 2560, ("Llama-3B", 6): 2304, ("Llama-3B", 14): 5376,
            ("Qwen", 7): 4480, ("Qwen", 14): 8960}
PAPER_KV_PCT = {("Llama-1B", 4): 3.9, ("Llama-1B", 8): 7.8, ("Llama-3B", 6): 2.0, ("Llama-3B", 14): 4.7,
                ("Qwen", 7): 3.9, ("Qwen", 14): 7.8}
# Paper Table 7 rounded "# Act. Params" (billions), §3.4.
PAPER_PARAMS_B = {("Llama-1B", 4, "M2"): 1.5, ("Llama-1B", 4, "GDN"): 1.7, ("Llama-1B", 8, "M2"): 1.5,
                  ("Llama-1B", 8, "GDN"): 1.6, ("Llama-3B", 6, "M2"): 3.8, ("Llama-3B", 6, "GDN"): 4.3,
                  ("Llama-3B", 14, "M2"): 3.7, ("Llama-3B", 14, "GDN"): 4.0, ("Qwen", 7, "M2"): 2.1,
                  ("Qwen", 7, "GDN"): 2.3, ("Qwen", 14, "M2"): 2.1, ("Qwen", 14, "GDN"): 2.2}


def _parse(name: str) -> tuple[str, int, str, int]:
    """(backbone key, #MLA, 'GDN'|'M2', trained context) from a released-style name."""
    _, fam, lay, ctx, _ = name.split("-")
    n_mla = int(lay.split("MLA")[0])
    kind = "GDN" if lay.endswith("GDN") else "M2"
    n_layer = int(lay.split("MLA")[0]) + int(lay.split("MLA")[1].removesuffix(kind))
    backbone = "Qwen" if fam == "Qwen" else ("Llama-1B" if n_layer == 16 else "Llama-3B")
    return backbone, n_mla, kind, int(ctx.removesuffix("K")) * 1024


def expected_state_dict(backbone: str, mla_layers: list[int], kind: str) -> dict[str, tuple[int, ...]]:
    """checkpoint-format.md §4.1 (whole model, untied head), §4.2 (MLA), §4.4 (GDN, fla layout), §4.5 (Mamba-2)."""
    s = SPEC[backbone]
    V, H, I, L, n_h, n_kv = s["V"], s["H"], s["I"], s["L"], s["n_h"], s["n_kv"]
    sd = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                   p + "mlp.down_proj.weight": (H, I)})
        if i in mla_layers:
            d_qk = s["dN"] + s["dR"]
            sd.update({p + "mla.q_a_proj.weight": (s["rq"], H), p + "mla.q_b_proj.weight": (n_h * d_qk, s["rq"]),
                       p + "mla.kv_a_proj_with_mqa.weight": (s["rkv"] + s["dR"], H),
                       p + "mla.kv_b_proj.weight": (n_kv * (s["dN"] + s["dV"]), s["rkv"]),
                       p + "mla.out_proj.weight": (H, n_h * s["dV"])})
            if s["qwen"]:
                sd.update({p + "mla.q_norm.weight": (128,), p + "mla.k_norm.weight": (128,)})
        elif kind == "GDN":
            h, K, Vd = s["gdn_h"], 256, 512
            sd.update({p + "gdn.q_proj.weight": (h * K, H), p + "gdn.k_proj.weight": (h * K, H),
                       p + "gdn.v_proj.weight": (h * Vd, H), p + "gdn.g_proj.weight": (h * Vd, H),
                       p + "gdn.o_proj.weight": (H, h * Vd), p + "gdn.a_proj.weight": (h, H),
                       p + "gdn.b_proj.weight": (h, H), p + "gdn.A_log": (h,), p + "gdn.dt_bias": (h,),
                       p + "gdn.q_conv1d.weight": (h * K, 1, 4), p + "gdn.k_conv1d.weight": (h * K, 1, 4),
                       p + "gdn.v_conv1d.weight": (h * Vd, 1, 4), p + "gdn.o_norm.weight": (Vd,)})
        else:
            di, dxb, nh, _ = s["m2"]
            sd.update({p + "mamba.in_proj.weight": (2 * di + 2 * dxb + nh, H),
                       p + "mamba.conv1d.weight": (di + 2 * dxb, 1, 4), p + "mamba.conv1d.bias": (di + 2 * dxb,),
                       p + "mamba.dt_bias": (nh,), p + "mamba.A_log": (nh,), p + "mamba.D": (nh,),
                       p + "mamba.norm.weight": (di,), p + "mamba.out_proj.weight": (H, di)})
    return sd


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_spec_formulas_reproduce_the_spec_literal_shapes_and_counts():
    # Guards the formulas above against the literal tables of checkpoint-format.md §4.2, §4.4, §4.5.
    sd = expected_state_dict("Llama-1B", [1], "GDN")
    assert [sd[f"model.layers.1.mla.{k}.weight"] for k in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                          "out_proj")] == [
        (1344, 2048), (2048, 1344), (160, 2048), (768, 128), (2048, 2048)]
    sd3 = expected_state_dict("Llama-3B", [1], "GDN")
    assert sd3["model.layers.1.mla.kv_b_proj.weight"] == (1536, 128) and sd3["model.layers.0.gdn.v_proj.weight"] == \
        (4608, 3072)
    sdq = expected_state_dict("Qwen", [1], "M2")
    assert sdq["model.layers.1.mla.kv_a_proj_with_mqa.weight"] == (320, 2048)
    assert sdq["model.layers.1.mla.kv_b_proj.weight"] == (1536, 256)
    assert sdq["model.layers.0.mamba.in_proj.weight"] == (6160, 2048)
    assert expected_state_dict("Llama-1B", [], "M2")["model.layers.0.mamba.in_proj.weight"] == (5152, 2048)
    assert expected_state_dict("Llama-3B", [], "M2")["model.layers.0.mamba.in_proj.weight"] == (8216, 3072)
    gdn_1b = sum(_numel(v) for k, v in sd.items() if ".layers.0.gdn." in k)
    gdn_3b = sum(_numel(v) for k, v in sd3.items() if ".layers.0.gdn." in k)
    assert (gdn_1b, gdn_3b) == (25_215_500, 56_715_794)  # §4.4 exact per-mixer counts


def test_shipped_recipes_are_the_released_and_paper_only_layouts():
    assert R.list_recipes() == sorted(RELEASED + PAPER_ONLY)
    for name in R.list_recipes():
        r = R.load_recipe(name)
        R.check_name_matches(r)
        assert r.released == (name in RELEASED), name
        assert r.hub_id == (f"amd/{name}" if r.released else None)


@pytest.mark.parametrize("name", RELEASED + PAPER_ONLY)
def test_recipe_fields_match_the_spec(name):
    backbone, n_mla, kind, ctx = _parse(name)
    s = SPEC[backbone]
    r = R.load_recipe(name)
    assert r.mla_layers == MLA_LAYERS[(backbone, n_mla)]
    assert r.linear_type == ("gdn" if kind == "GDN" else "mamba") and r.trained_context_tokens == ctx
    a = r.base_architecture
    assert (a["vocab_size"], a["hidden_size"], a["intermediate_size"], a["num_hidden_layers"],
            a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"]) == \
        (s["V"], s["H"], s["I"], s["L"], s["n_h"], s["n_kv"], s["d_h"])
    assert a["rope_theta"] == s["theta"] and a["rms_norm_eps"] == s["eps"] and a["tie_word_embeddings"] is True
    assert (r.mla["q_lora_rank"], r.mla["kv_lora_rank"], r.mla["qk_rope_head_dim"], r.mla["qk_nope_head_dim"],
            r.mla["v_head_dim"]) == (s["rq"], s["rkv"], s["dR"], s["dN"], s["dV"])
    factor, original = s["yarn"][ctx]
    assert r.rope_scaling["factor"] == factor
    if original is not None:
        assert r.rope_scaling["original_max_position_embeddings"] == original
    # teachers (§1, training-recipe §5); stage II lr and global batch (training-recipe §3.3)
    assert r.teacher == ("Qwen/Qwen3-8B" if backbone == "Qwen" else "meta-llama/Llama-3.1-8B-Instruct")
    kd, ild = r.stage("kd"), r.stage("ild")
    assert (ild.seq_len_tokens, ild.lr, kd.seq_len_tokens) == (2048, 2e-4, ctx)
    assert kd.lr == (4e-5 if backbone == "Llama-3B" else 6e-5)
    batch_8k = 32 if backbone == "Llama-1B" or (backbone == "Qwen" and kind == "M2") else 16
    assert kd.global_batch_sequences == (batch_8k if ctx == 8192 else 8)
    if kind == "GDN":
        assert (r.gdn["num_heads"], r.gdn["head_dim"]) == (s["gdn_h"], 256)
    else:
        di, dxb, nh, d_state = s["m2"]
        assert (r.mamba2["d_inner"], r.mamba2["d_xb"], r.mamba2["ssm_cfg"]["ngroups"],
                r.mamba2["ssm_cfg"]["d_state"]) == (di, dxb, nh, d_state)


def _check_exact_architecture(name: str) -> None:
    from hylo_bench.models.hybrid import HyLoForCausalLM

    backbone, n_mla, kind, _ = _parse(name)
    cfg = R.recipe_hybrid_config(R.load_recipe(name))
    with torch.device("meta"):
        model = HyLoForCausalLM(cfg)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = expected_state_dict(backbone, MLA_LAYERS[(backbone, n_mla)], kind)
    assert sorted(set(got) - set(want)) == [] and sorted(set(want) - set(got)) == []
    assert {k: v for k, v in got.items() if want[k] != v} == {}
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(_numel(s) for s in want.values())
    assert round(total / 1e9, 1) == PAPER_PARAMS_B[(backbone, n_mla, kind)]


@pytest.mark.parametrize("name", [n for n in RELEASED + PAPER_ONLY if "GDN" in n])
def test_gdn_recipe_builds_exactly_the_released_architecture(name):
    _check_exact_architecture(name)


@pytest.mark.parametrize("name", [n for n in RELEASED + PAPER_ONLY if "M2" in n])
def test_mamba2_recipe_builds_exactly_the_released_architecture(name):
    _check_exact_architecture(name)


@pytest.mark.parametrize("name", RELEASED + PAPER_ONLY)
def test_info_params_and_kv_cache_match_spec_and_paper(name):
    from hylo_bench.info import describe

    backbone, n_mla, kind, _ = _parse(name)
    d = describe(name)
    want = expected_state_dict(backbone, MLA_LAYERS[(backbone, n_mla)], kind)
    assert d["params"] == sum(_numel(s) for s in want.values())  # meta model, or the §4 tables for M2 until merged
    assert d["kv_cache_bytes_per_token"] == KV_BYTES[(backbone, n_mla)]
    assert round(d["kv_cache_pct_of_base"], 1) == PAPER_KV_PCT[(backbone, n_mla)]
    s = SPEC[backbone]
    assert d["backbone_kv_cache_bytes_per_token"] == s["L"] * 2 * s["n_kv"] * s["d_h"] * 2
    assert [lay["mixer"] for lay in d["layers"]] == [
        "mla" if i in MLA_LAYERS[(backbone, n_mla)] else ("gdn" if kind == "GDN" else "mamba") for i in range(s["L"])]
    n_lin = s["L"] - n_mla
    if kind == "GDN":  # §4.4: h x 256 x 512 fp32 recurrent + (2 h 256 + h 512) x 3 bf16 conv, per linear layer
        h = s["gdn_h"]
        assert d["state_bytes_per_sequence"] == n_lin * (h * 256 * 512 * 4 + (2 * h * 256 + h * 512) * 3 * 2)
    else:  # §4.5: nh x d_h x d_state fp32 ssm + (d_inner + 2 d_xb) x 3 bf16 conv
        di, dxb, nh, d_state = s["m2"]
        assert d["state_bytes_per_sequence"] == n_lin * (nh * d_state * d_state * 4 + (di + 2 * dxb) * 3 * 2)


def test_info_is_fast_on_every_released_recipe():
    from hylo_bench.info import describe

    describe(RELEASED[0])  # imports
    for name in RELEASED:
        t0 = time.perf_counter()
        describe(name)
        assert time.perf_counter() - t0 < 2.0, name


def test_unknown_recipe_lists_close_matches():
    with pytest.raises(R.RecipeError, match="did you mean HyLo-Qwen-7MLA21GDN-8K-SFT"):
        R.load_recipe("HyLo-Qwen-7MLA21GDN-8k-SFT")


def _write(tmp_path, mutate):
    raw = yaml.safe_load(R.find_recipe("HyLo-Llama-4MLA12GDN-8K-SFT").read_text())
    mutate(raw)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r["mla"].update(kv_lora_rank="big"), r"key 'mla.kv_lora_rank' should be int, got str \('big'\)"),
    (lambda r: r.update(colour="red"), r"unknown key\(s\) \['colour'\]"),
    (lambda r: r["mla"].pop("v_head_dim"), r"missing required key 'mla.v_head_dim'"),
    (lambda r: r.update(mla_layers=[1, 5, 10, 99]), r"key 'mla_layers' should be distinct layer indices in \[0, 16\)"),
    (lambda r: r.update(layout="5MLA11GDN"), r"key 'layout' = '5MLA11GDN' disagrees"),
    (lambda r: r["stages"][0].update(kind="dpo"), r"key 'stages.0.kind' should be 'ild' or 'kd'"),
    (lambda r: r.update(linear_type="mamba"), r"linear_type 'mamba' needs a 'mamba2' mapping"),
])
def test_bad_recipe_fields_name_file_key_and_expectation(tmp_path, mutate, message):
    p = _write(tmp_path, mutate)
    with pytest.raises(R.RecipeError, match=message) as e:
        R.load_recipe(str(p))
    assert str(p) in str(e.value)


def test_recipe_mla_heads_must_match_backbone(tmp_path):
    p = _write(tmp_path, lambda r: r["mla"].update(num_key_value_heads=4))
    with pytest.raises(R.RecipeError, match="'mla.num_key_value_heads' = 4 but the backbone has 8"):
        R.recipe_hybrid_config(R.load_recipe(str(p)))


def test_recipe_resolves_upcycle_config_and_flags_override(tmp_path):
    name = "HyLo-Llama-4MLA12GDN-8K-SFT"
    none = dict(base=None, teacher=None, layout=None, mla_layers=None, stages=None, batch_size=None, grad_accum=None,
                ild_lr=None, kd_lr=None, kv_lora_rank=None, q_lora_rank=None, seed=None, tokens_per_stage=None)
    cfg = resolve_upcycle_cli(name, {}, str(tmp_path), none)
    assert (cfg.base, cfg.teacher) == ("meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.1-8B-Instruct")
    assert (cfg.mla_layers, cfg.linear_type, cfg.stages) == ([1, 5, 10, 14], "gdn", "2k:ild,8k:kd")
    assert (cfg.ild_lr, cfg.kd_lr, cfg.batch_size, cfg.grad_accum) == (2e-4, 6e-5, 4, 8)  # 32 = 4 x 8
    assert cfg.mixer_overrides["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 2048}
    assert cfg.mixer_overrides["kv_lora_rank"] == 128 and cfg.recipe == name
    flags = none | dict(kd_lr=1e-4, batch_size=2, kv_lora_rank=64, layout="8MLA8GDN", tokens_per_stage="20M")
    cfg = resolve_upcycle_cli(name, {"stages.1.seq_len_tokens": 4096, "mla.q_lora_rank": 1024}, str(tmp_path),
                                flags)
    assert (cfg.kd_lr, cfg.batch_size, cfg.grad_accum) == (1e-4, 2, 8)
    assert (cfg.layout, cfg.mla_layers, cfg.stages, cfg.tokens_per_stage) == ("8MLA8GDN", None, "2k:ild,4k:kd",
                                                                               20_000_000)
    assert (cfg.mixer_overrides["kv_lora_rank"], cfg.mixer_overrides["q_lora_rank"]) == (64, 1024)
    with pytest.raises(R.RecipeError, match=r"unknown key\(s\) \['mla.kv_rank'\]"):
        resolve_upcycle_cli(name, {"mla.kv_rank": 1}, str(tmp_path), none)
    with pytest.raises(R.RecipeError, match="needs --recipe"):
        resolve_upcycle_cli(None, {"mla.kv_lora_rank": 1}, str(tmp_path), none)


def test_recipe_file_round_trip_through_upcycle_and_info(tiny_base_dir, tmp_path):
    """A user recipe for the tiny base: upcycle --recipe writes the hybrid the recipe describes (same
    hybrid_config.json as the offline build), and info reads the result."""
    import json

    from typer.testing import CliRunner

    from hylo_bench.cli import app

    base = json.loads((tiny_base_dir / "config.json").read_text())
    raw = yaml.safe_load(R.find_recipe("HyLo-Llama-4MLA12GDN-8K-SFT").read_text())
    raw.update(name="tiny-2MLA2GDN", released=False, hub_id=None, backbone=str(tiny_base_dir),
               teacher=str(tiny_base_dir), layout="2MLA2GDN", trained_context_tokens=256, mla_layers=[1, 3],
               rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128})
    raw["base_architecture"] = {k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                      "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                      "head_dim", "hidden_act", "rms_norm_eps",
                                                      "tie_word_embeddings", "max_position_embeddings")
                                } | {"model_type": "llama", "rope_theta": 10000.0}
    raw["mla"].update(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                      num_key_value_heads=2)
    raw["gdn"] = {"num_heads": 2, "head_dim": 16, "expand_v": 2, "conv_size": 4}
    raw["stages"] = [{"kind": "ild", "seq_len_tokens": 128, "lr": 2e-4, "token_budget": 1024},
                     {"kind": "kd", "seq_len_tokens": 256, "lr": 1e-3, "token_budget": 2048,
                      "global_batch_sequences": 4, "per_device_batch_sequences": 2}]
    raw.pop("data")  # the released mixture is on the Hub
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["upcycle", "--recipe", str(path), "--out", str(out), "--device", "cpu",
                                   "--eval-windows", "0", "--no-stage-checkpoints", "--allow-demo-data"])
    assert res.exit_code == 0, res.output
    saved = json.loads((out / "hybrid_config.json").read_text())
    offline = R.recipe_hybrid_config(R.load_recipe(str(path))).to_hybrid_dict()
    assert saved == offline and saved["rope_scaling"]["factor"] == 2.0 and saved["mla_layers"] == [1, 3]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recipe"] == "tiny-2MLA2GDN" and manifest["config"]["grad_accum"] == 2
    res = CliRunner().invoke(app, ["info", str(out), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["trained_context_tokens"] == 256 and d["kv_cache_bytes_per_token"] == 2 * (16 + 8) * 2
