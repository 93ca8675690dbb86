"""``hylo-bench info`` / ``kv`` through the CLI: recipe names, checkpoint directories (configs only), errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hylo_bench.cli import app
from tests.conftest import tiny_hybrid_config

runner = CliRunner()
GIB = 2 ** 30


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny hybrid checkpoint directory holding only config.json + hybrid_config.json (+ a manifest)."""
    d = tmp_path_factory.mktemp("tiny_hybrid")
    tiny_hybrid_config().save_files(d)
    (d / "manifest.json").write_text(json.dumps({"stages": [{"seq_len_tokens": 512}, {"seq_len_tokens": 1024}]}))
    return d


def test_info_json_for_a_recipe_name():
    res = runner.invoke(app, ["info", "HyLo-Qwen-7MLA21GDN-8K-SFT", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    # Qwen3-1.7B 7MLA21GDN: 7 x (256 + 64) x 2 bytes; backbone 28 x 2 x 8 x 128 x 2 (checkpoint-format.md §6)
    assert d["kv_cache_bytes_per_token"] == 4480 and d["backbone_kv_cache_bytes_per_token"] == 114_688
    assert isinstance(d["params"], int) and round(d["params"] / 1e9, 1) == 2.3  # paper Table 7
    assert d["kv_cache_pct_of_base"] == pytest.approx(3.90625, abs=1e-4)
    assert [lay["index"] for lay in d["layers"] if lay["mixer"] == "mla"] == [1, 5, 9, 13, 17, 21, 25]
    assert d["trained_context_tokens"] == 8192 and d["rope"]["yarn_active"] is False
    assert d["params_detail"]["by_component"]["lm_head"] == 151_936 * 2048  # untied head (§4.3 (a))


def test_info_reports_yarn_of_the_64k_recipe():
    d = json.loads(runner.invoke(app, ["info", "HyLo-Llama-4MLA12GDN-64K-SFT", "--json"]).stdout)
    assert d["rope"]["rope_scaling"]["factor"] == 32.0 and d["rope"]["yarn_mscale"] == 1.3466  # §5.3 table
    assert d["rope"]["yarn_target_context_tokens"] == 65536 and d["trained_context_tokens"] == 65536


def test_info_json_for_a_checkpoint_dir_reads_configs_only(tiny_ckpt):
    from hylo_bench.models.hybrid import HyLoForCausalLM

    assert not list(tiny_ckpt.glob("*.safetensors"))
    res = runner.invoke(app, ["info", str(tiny_ckpt), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    real = sum(p.numel() for p in HyLoForCausalLM(tiny_hybrid_config()).parameters())
    assert d["params"] == real
    assert d["kv_cache_bytes_per_token"] == 2 * (32 + 8) * 2  # 2 MLA layers x (r_kv + d_R) x bf16
    assert d["kv_cache_pct_of_base"] == pytest.approx(100 * 160 / (4 * 2 * 2 * 16 * 2))
    assert [lay["mixer"] for lay in d["layers"]] == ["gdn", "mla", "gdn", "mla"]
    assert d["state_bytes_per_sequence"] == 2 * (2 * 16 * 32 * 4 + (2 * 2 * 16 + 2 * 32) * 3 * 2)
    assert d["trained_context_tokens"] == 1024 and d["kind"] == "checkpoint"


def test_info_human_output_names_the_layout():
    res = runner.invoke(app, ["info", "HyLo-Llama-6MLA22GDN-8K-SFT"])
    assert res.exit_code == 0, res.output
    assert "6MLA22GDN" in res.stdout and "2.01% of" in res.stdout


@pytest.mark.parametrize("cmd", ["info", "kv"])
def test_unknown_target_fails_with_close_matches(cmd):
    res = runner.invoke(app, [cmd, "HyLo-Qwen-7MLA21GDN-8k-SFT", "--json"])
    assert res.exit_code != 0
    assert "did you mean HyLo-Qwen-7MLA21GDN-8K-SFT" in " ".join(res.output.split())


def test_dir_without_hybrid_config_is_rejected(tmp_path):
    res = runner.invoke(app, ["info", str(tmp_path)])
    assert res.exit_code != 0 and "hybrid_config.json" in res.output


def test_kv_json_for_a_recipe_with_gpu_mem():
    res = runner.invoke(app, ["kv", "HyLo-Qwen-7MLA21GDN-64K-SFT", "--gpu-mem", "141GiB", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["kv_cache_bytes_per_token"] == 4480
    h, n_lin = 6, 21  # GDN 6 x 256 heads: fp32 recurrent + 3 bf16 conv columns per linear layer (§4.4)
    assert d["state_bytes_per_sequence"] == n_lin * (h * 256 * 512 * 4 + (2 * h * 256 + h * 512) * 3 * 2)
    assert d["weight_bytes"] == 2 * d["params"] + 2 * (2 * h * n_lin)  # bf16, A_log / dt_bias kept fp32
    budget = int(141 * GIB * 0.92)
    assert d["max_context_tokens"]["hybrid"] == (budget - d["weight_bytes"] - d["state_bytes_per_sequence"]) // 4480
    # Qwen3-1.7B, tied head: 28 layers x 50,336,000 (1.4B non-embedding, Qwen card) + 151,936 x 2048 + 2048
    assert d["backbone"]["params"] == 1_720_574_976
    assert d["max_context_tokens"]["backbone"] == (budget - 2 * 1_720_574_976) // 114_688
    assert d["max_context_tokens"]["hybrid"] > 20 * d["max_context_tokens"]["backbone"]
    cap = d["vllm"]["capacity"]
    assert cap["max_model_len"] == 65536 and cap["blocks_per_request"] == 29  # vllm.md §6.3
    assert cap["num_blocks"] == (budget - d["weight_bytes"]) // (7 * 1_638_400)


def test_kv_json_for_a_checkpoint_dir_without_gpu_mem(tiny_ckpt):
    res = runner.invoke(app, ["kv", str(tiny_ckpt), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert {"kv_cache_bytes_per_token", "state_bytes_per_sequence", "weight_bytes"} <= set(d)
    assert "max_context_tokens" not in d and d["kv_cache_bytes_per_token"] == 160
    res = runner.invoke(app, ["kv", str(tiny_ckpt), "--gpu-mem", "1GiB", "--gpu-util", "1", "--json"])
    d = json.loads(res.stdout)
    assert d["max_context_tokens"]["hybrid"] == (GIB - d["weight_bytes"] - d["state_bytes_per_sequence"]) // 160
    res = runner.invoke(app, ["kv", str(tiny_ckpt), "--gpu-mem", "lots"])
    assert res.exit_code != 0 and "141GiB" in res.output


def test_upcycle_recipe_flag_overrides_recipe(monkeypatch, tmp_path):
    import hylo_bench.upcycle.run as run_mod

    seen = {}

    def fake_run(cfg, on_result=None):
        seen["cfg"] = cfg
        return {"kl_init": None, "stages": [{}]}

    monkeypatch.setattr(run_mod, "run", fake_run)
    res = runner.invoke(app, ["upcycle", "--recipe", "HyLo-Llama-6MLA22GDN-64K-SFT", "--out", str(tmp_path / "o"),
                              "--kd-lr", "1e-4", "--set", "mla.kv_lora_rank=64", "--kv-lora-rank", "96",
                              "--set", "stages.0.lr=1e-4"])
    assert res.exit_code == 0, res.output
    cfg = seen["cfg"]
    assert cfg.kd_lr == 1e-4 and cfg.ild_lr == 1e-4  # flag / --set over recipe
    assert cfg.base == "meta-llama/Llama-3.2-3B-Instruct" and cfg.stages == "2k:ild,64k:kd"
    assert (cfg.batch_size, cfg.grad_accum) == (1, 8)  # 64K: 8 sequences, 1 per device (training-recipe §3.3)
    assert cfg.mixer_overrides["kv_lora_rank"] == 96 and cfg.mixer_overrides["rope_scaling"]["factor"] == 32.0
    res = runner.invoke(app, ["upcycle", "--recipe", "HyLo-Nope", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "unknown recipe 'HyLo-Nope'" in res.output
    res = runner.invoke(app, ["upcycle", "--recipe", "HyLo-Llama-6MLA22GDN-64K-SFT", "--out", str(tmp_path / "o"),
                              "--set", "mla.kv_lora_rank=big"])
    assert res.exit_code == 2 and "'mla.kv_lora_rank' should be int" in " ".join(res.output.split())


def test_fast_recipe_path_equals_the_meta_device_model_for_every_recipe(monkeypatch):
    """``info`` on a recipe skips transformers' model configs and the torch model (speed); the result must be
    what the HF-config + meta-device path gives: every count, per tensor, and every KV / state number."""
    from hylo_bench import info as I
    from hylo_bench.config import recipes as R
    from hylo_bench.models.params import parameter_counts

    for name in R.list_recipes():
        fast = I.describe(name)
        cfg = R.recipe_hybrid_config(R.load_recipe(name))  # HF LlamaConfig / Qwen3Config base
        assert fast["params_detail"]["source"].startswith("shape tables"), name
        meta = parameter_counts(cfg, meta_model=True)
        assert meta["source"] == "meta-device model"
        for key in ("total", "by_component", "by_mixer_type", "per_mixer_tensor", "fp32_params"):
            assert fast["params_detail"][key] == meta[key], (name, key)
        assert [{k: lay[k] for k in ("params", "mixer_params")} for lay in fast["layers"]] == meta["per_layer"]
        with monkeypatch.context() as m:
            m.setattr(R, "recipe_hybrid_config", lambda recipe, hf_base=True: cfg)
            m.setattr(I, "parameter_counts", lambda c, meta_model=False: meta)
            slow = I.describe(name)
        assert {k: v for k, v in slow.items() if k != "params_detail"} == \
            {k: v for k, v in fast.items() if k != "params_detail"}, name


def test_info_imports_neither_torch_nor_transformers(tiny_ckpt):
    """``info`` / ``kv`` on every recipe and on a checkpoint dir read configs through the plain-Python
    ``HybridSpec``: importing torch alone takes ~2.5 s on our CPU machines, and the issue asks for < 2 s."""
    import subprocess
    import sys

    from hylo_bench.config import recipes as R

    names = R.list_recipes()
    code = ("import sys, json, io, contextlib; from hylo_bench.cli import app\n"
            "outs = []\n"
            f"for argv in {[['info', n, '--json'] for n in names] + [['kv', str(tiny_ckpt), '--json']]!r}:\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf):\n"
            "        try:\n            app(argv)\n"
            "        except SystemExit as e:\n            assert not e.code, argv\n"
            "    outs.append(json.loads(buf.getvalue()))\n"
            "bad = [m for m in ('torch', 'transformers', 'sklearn', 'hylo_bench.models.hybrid') if m in sys.modules]\n"
            "print(json.dumps({'loaded': bad, 'kv': [o['kv_cache_bytes_per_token'] for o in outs]}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["loaded"] == []
    assert out["kv"][names.index("HyLo-Qwen-7MLA21GDN-8K-SFT")] == 4480


def test_hybrid_spec_equals_hylo_config_for_every_recipe():
    """The torch-free ``HybridSpec`` and its transformers binding ``HyLoConfig`` (a subclass); built from the
    same recipe they must write identical hybrid_config.json / config.json and
    agree on the derived values the memory model reads."""
    from hylo_bench.config import recipes as R
    from hylo_bench.config.hybrid import HybridSpec
    from hylo_bench.config.hylo_config import HyLoConfig

    for name in R.list_recipes():
        recipe = R.load_recipe(name)
        spec = R.recipe_hybrid_config(recipe, hf_base=False)
        assert type(spec) is HybridSpec
        hf = R.recipe_hybrid_config(recipe)  # transformers LlamaConfig / Qwen3Config base
        assert isinstance(hf, HyLoConfig)
        assert spec.to_hybrid_dict() == hf.to_hybrid_dict(), name
        for attr in ("mixer_types", "qk_head_dim", "base_head_dim", "base_num_key_value_heads", "vocab_size",
                     "gdn_value_head_dim", "bos_token_id", "eos_token_id"):
            assert getattr(spec, attr) == getattr(hf, attr), (name, attr)
        if spec.linear_type == "mamba":
            assert spec.mamba_dims() == hf.mamba_dims()
        back = HyLoConfig.from_spec(spec)
        assert back.to_hybrid_dict() == hf.to_hybrid_dict() and back.vocab_size == hf.vocab_size


def test_hybrid_spec_rejects_what_hylo_config_rejects(tmp_path):
    from hylo_bench.config.hybrid import HybridSpec
    from hylo_bench.config.hylo_config import HyLoConfig

    base = {"model_type": "llama", "vocab_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    hybrid = {"hidden_size": 32, "n_layer": 2, "mla_layers": [1], "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "kv_lora_rank": 12, "q_lora_rank": 16, "qk_rope_head_dim": 4,
              "qk_nope_head_dim": 4, "v_head_dim": 8, "gdn_num_heads": 2, "gdn_head_dim": 8}
    for cls in (HybridSpec, HyLoConfig):
        with pytest.raises(ValueError, match="'kv_lora_rank' = 12 must be a multiple of qkv_rank_divisor = 8"):
            cls.from_dicts(base, hybrid, source="ck")
        with pytest.raises(ValueError, match="ck: hybrid_config.json key 'n_layer' should be int"):
            cls.from_dicts(base, hybrid | {"n_layer": "2", "kv_lora_rank": 16}, source="ck")
    ok = HybridSpec.from_dicts(base, hybrid | {"kv_lora_rank": 16})
    assert ok.mixer_types == ["gdn", "mla"] and HyLoConfig.from_spec(ok).mixer_types == ["gdn", "mla"]
