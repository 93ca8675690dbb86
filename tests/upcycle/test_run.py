"""End-to-end upcycling on a tiny Llama: init, ILD, KD, manifest, per-stage checkpoints, resume."""

from __future__ import annotations

import json
import os

import pytest
import torch

from hylo_bench.config.student import hybrid_config_for
from hylo_bench.config.upcycle import UpcycleConfig
from hylo_bench.models.hybrid import load_hylo
from hylo_bench.upcycle.run import run
from hylo_bench.upcycle.stages import parse_stages
from hylo_bench.upcycle.train import trainer as trainer_mod
from hylo_bench.upcycle.transfer import init_student


def _cfg(base_dir, out, **kw):
    return UpcycleConfig(out=str(out), base=str(base_dir), data="demo", allow_demo_data=True,
                         stages="128:ild@2k,512@4k",
                         batch_size=2, ild_lr=2e-4, kd_lr=1e-3, eval_windows=2, device="cpu", save_every=2, **kw)


def test_parse_stages():
    st = parse_stages("2k:ild@20M,8k,64k@1B", default_budget=10 ** 5)
    assert [(s.kind, s.seq_len_tokens, s.token_budget) for s in st] == [
        ("ild", 2048, 20_000_000), ("kd", 8192, 10 ** 5), ("kd", 65536, 10 ** 9)]
    with pytest.raises(ValueError, match="ILD stages must come before"):
        parse_stages("8k,2k:ild", 10 ** 6)
    with pytest.raises(ValueError, match="kind 'foo'"):
        parse_stages("2k:foo", 10 ** 6)
    with pytest.raises(ValueError, match="less than one sequence"):
        parse_stages("8k@1000", 10 ** 6)
    with pytest.raises(ValueError, match="--stages is empty"):
        parse_stages(" , ", 10 ** 6)


def test_init_copies_base_weights_and_mixers(tiny_base_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_base_dir)
    cfg = hybrid_config_for(base.config, [1, 3], kv_lora_rank=64, q_lora_rank=64)
    student = init_student(base, cfg)
    s, b = student.state_dict(), base.state_dict()
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
              "model.layers.2.mlp.down_proj.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert torch.equal(s[k], b[k]), k
    assert torch.equal(s["model.layers.1.mla.out_proj.weight"], b["model.layers.1.self_attn.o_proj.weight"])
    # full-rank q path rebuilds W_Q (hidden 64 = n_h * d_h, rank 64)
    qb, qa = s["model.layers.3.mla.q_b_proj.weight"], s["model.layers.3.mla.q_a_proj.weight"]
    wq = b["model.layers.3.self_attn.q_proj.weight"]
    assert torch.allclose(qb @ qa, wq, atol=1e-4)
    assert s["lm_head.weight"].data_ptr() != s["model.embed_tokens.weight"].data_ptr()


def test_doc_boundaries_default_is_kd_except_for_the_demo_book():
    assert UpcycleConfig(out="o").doc_boundaries_mode() == "off"  # --data demo: paragraphs of one book
    assert UpcycleConfig(out="o", data="corpus.jsonl").doc_boundaries_mode() == "kd"
    assert UpcycleConfig(out="o", doc_boundaries="all").doc_boundaries_mode() == "all"


def test_upcycle_run_writes_manifest_and_checkpoints(tiny_base_dir, tmp_path):
    from hylo_bench.reports import store

    manifest = run(_cfg(tiny_base_dir, tmp_path / "out", doc_boundaries="kd"), on_result=store.recorder())
    out = tmp_path / "out"
    assert [s["status"] for s in manifest["stages"]] == ["done", "done"]
    assert [s["name"] for s in manifest["stages"]] == ["ild-128", "kd-512"]
    assert manifest["stages"][0]["tokens_seen"] == 7 * 2 * 128
    assert manifest["stages"][1]["steps"] == 3  # budgets are decimal: 2k = 2000 tokens = 7 whole steps
    assert json.loads((out / "manifest.json").read_text())["stages"][1]["status"] == "done"
    assert (out / "stages" / "0-ild-128" / "model.safetensors").is_file()
    student = load_hylo(out, dtype=None)
    assert student.config.mla_layers == [1, 3] and student.config.mixer_types == ["gdn", "mla", "gdn", "mla"]
    assert not (out / "resume.pt").exists()
    assert 0 < manifest["stages"][1]["kl_after"] < 1 and 0 < manifest["kl_init"] < 1  # nats/token, recorded
    # --doc-boundaries kd: the KD stage trains on packed documents with boundaries, ILD on plain windows
    assert manifest["settings"]["doc_boundaries"] == "kd"
    ild_pack, kd_pack = manifest["stages"][0]["packing"], manifest["stages"][1]["packing"]
    assert (ild_pack["doc_boundaries"], kd_pack["doc_boundaries"]) == (False, True)
    assert kd_pack["rows"] == 3 * 2 and kd_pack["seq_len"] == 512 and kd_pack["segments"] > kd_pack["rows"]
    # the training log went to on_result, the results store (this test's $HYLO_BENCH_DB), after every stage, once
    # per step
    engine = store.open_store(os.environ["HYLO_BENCH_DB"], create=False)
    assert store.table_counts(engine)["runs"] == 1
    log = store.train_log_frame(engine)
    want = [(s["name"], row["step"], row["loss"]) for s in manifest["stages"] for row in s["losses"]]
    assert list(zip(log["stage"], log["step"], log["loss"])) == want and len(want) >= 2


def test_interrupted_run_resumes_to_the_same_weights(tiny_base_dir, tmp_path, monkeypatch):
    run(_cfg(tiny_base_dir, tmp_path / "ref"))
    ref = load_hylo(tmp_path / "ref", dtype=None).state_dict()

    calls = {"n": 0}
    real = trainer_mod._save_resume

    def save_then_die(*a, **k):
        real(*a, **k)
        calls["n"] += 1
        if calls["n"] == 2:  # die in the KD stage after its first mid-stage save
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "_save_resume", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(_cfg(tiny_base_dir, tmp_path / "cut"))
    monkeypatch.setattr(trainer_mod, "_save_resume", real)
    assert (tmp_path / "cut" / "resume.pt").is_file()
    manifest = run(_cfg(tiny_base_dir, tmp_path / "cut"))
    assert manifest["stages"][1]["steps"] == 3
    resumed = load_hylo(tmp_path / "cut", dtype=None).state_dict()
    for k, v in ref.items():
        assert torch.equal(v, resumed[k]), k


def test_changed_settings_refuse_to_mix_runs(tiny_base_dir, tmp_path):
    run(_cfg(tiny_base_dir, tmp_path / "o"))
    bad = _cfg(tiny_base_dir, tmp_path / "o")
    bad.stages = "128@2k"
    with pytest.raises(ValueError, match=r"other settings \(stages: "):
        run(bad)


def test_seeded_runs_are_reproducible(tiny_base_dir, tmp_path):
    a = run(_cfg(tiny_base_dir, tmp_path / "a"))
    b = run(_cfg(tiny_base_dir, tmp_path / "b"))
    assert a["kl_init"] == b["kl_init"]
    sa, sb = load_hylo(tmp_path / "a", dtype=None).state_dict(), load_hylo(tmp_path / "b", dtype=None).state_dict()
    assert all(torch.equal(v, sb[k]) for k, v in sa.items())
