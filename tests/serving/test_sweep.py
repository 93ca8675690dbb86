"""``hylo-bench sweep``: real worker subprocesses on a tiny checkpoint write valid records; a simulated OOM is
recorded and the sweep goes on; --find-max bisects; the JSON goes into the results store, re-import is a no-op;
a time budget estimates the points whose full run would not fit and skips those it cannot start."""

from __future__ import annotations

import json

import pytest
import torch

from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.reports import store
from hylo_bench.serving import sweep as S
from hylo_bench.serving import sweep_worker
from tests.conftest import make_base, tiny_hybrid_config

REQUIRED = ("layout", "seq_len", "batch_size", "ttft_s", "tpot_s", "tokens_per_s", "bound_tpot_s", "fraction_of_bound",
            "mode", "peak_memory_gib", "status")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("sweep")
    torch.manual_seed(0)
    HyLoForCausalLM(tiny_hybrid_config(vocab_size=120)).save_pretrained(d / "hylo")
    make_base("llama", vocab_size=120).save_pretrained(d / "llama")
    return d


def _cfg(ckpts, tmp_path, **kw):
    kw = dict(model=str(ckpts / "hylo"), contexts_tokens=[16, 24], batch_sizes=[1], out=tmp_path / "sweep.json",
              decode_steps=3, prefill_chunk_tokens=8, device="cpu") | kw
    return S.SweepConfig(**kw)


def _in_process(monkeypatch):
    """Run workers in this process (same code path as the subprocess, minus the interpreter start)."""
    def fake(spec, timeout_s):
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "s.json").write_text(json.dumps(spec))
            sweep_worker.main([str(Path(d) / "s.json"), str(Path(d) / "r.json")])
            return json.loads((Path(d) / "r.json").read_text())

    monkeypatch.setattr(S, "run_worker", fake)


def test_cpu_sweep_in_worker_processes_writes_valid_records_and_store(ckpts, tmp_path, monkeypatch):
    monkeypatch.setenv(sweep_worker.OOM_HOOK_ENV, "24")  # the second context "runs out of memory" in its worker
    cfg = _cfg(ckpts, tmp_path, contexts_tokens=[16, 24], baseline=str(ckpts / "llama"))
    seen = []
    db = tmp_path / "store.sqlite"
    env = S.run(cfg, on_record=seen.append, on_result=store.recorder(db))
    saved = json.loads(cfg.out.read_text())
    assert saved == env and saved["kind"] == "sweep" and saved["benchmark"] == "sweep"
    assert {"git_sha", "device", "versions", "records"} <= saved.keys() and saved["device"] == "cpu"
    recs = saved["records"]
    assert [(r["series"], r["seq_len"], r["status"]) for r in recs] == [
        ("model", 16, "ok"), ("model", 24, "oom"), ("baseline", 16, "ok"), ("baseline", 24, "oom"),
        ("baseline-static", 16, "ok"), ("baseline-static", 24, "oom")]
    assert len(seen) == 6 and S.points_total(cfg) == 6
    for r in (recs[0], recs[2], recs[4]):
        assert all(r[k] is not None for k in REQUIRED)
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] / r["tpot_s"], rel=0.5)
        assert r["prompt_tokens"] == 16 and r["new_tokens"] == 3 and r["peak_memory_source"] == "rss"
        assert r["mode"] == "full" and r["bandwidth_source"] == "measured"
        assert r["fraction_of_bound"] == pytest.approx(r["bound_tpot_s"] / r["tpot_s"])
        assert r["bound_tpot_s"] == pytest.approx(r["bound_bytes_per_step"] / r["copy_bandwidth_B_per_s"])
    assert [recs[k]["engine"] for k in (0, 2, 4)] == ["Engine", "TransformerEngine", "transformers-static"]
    assert recs[0]["layout"] == "2MLA2GDN" and recs[2]["layout"] == recs[4]["layout"] == "transformer"
    # the baseline's KV cache read per step: 4 layers x 2 (K, V) x 2 KV heads x 16 dims x 4 bytes x 16 tokens
    assert recs[2]["bound_cache_bytes"] == recs[4]["bound_cache_bytes"] == 4 * 2 * 2 * 16 * 4 * 16
    assert "simulated" in recs[1]["error"]
    # KV cache of the hybrid: 2 MLA layers x (32 + 8) fp32 per token x (16 + 3) slots, plus 2 GDN states
    gdn = HyLoForCausalLM(tiny_hybrid_config(vocab_size=120)).model.layers[0].gdn
    want = 2 * 40 * 4 * 19 + 2 * gdn.state_bytes_per_sequence()
    assert recs[0]["kv_cache_gib"] * 2 ** 30 == pytest.approx(want)
    assert all(not isinstance(v, (dict, list)) for r in recs for v in r.values())  # flat records

    engine = store.open_store(db, create=False)
    pts = store.points_frame(engine)
    assert len(pts) == 6 and list(pts["status"]) == ["ok", "oom"] * 3
    before = store.table_counts(engine)
    out = store.import_files(engine, [cfg.out])
    assert out[0].status == "unchanged" and store.table_counts(engine) == before


def test_grown_sweep_file_extends_its_run_and_conflicts_are_refused(tmp_path):
    engine = store.open_store(tmp_path / "s.sqlite")
    env = {"benchmark": "sweep", "kind": "sweep", "sweep_id": "x", "model": "m", "git_sha": "g", "device": None,
           "versions": {}, "records": [{"seq_len": 8, "status": "ok", "ttft_s": 0.1}]}
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(env))
    assert store.import_files(engine, [path])[0].status == "new"
    env["records"].append({"seq_len": 16, "status": "oom"})
    env["device"] = "cpu"
    path.write_text(json.dumps(env))
    res = store.import_files(engine, [path])[0]
    assert (res.status, res.num_points) == ("extended", 1)
    assert store.table_counts(engine)["runs"] == 1 and store.table_counts(engine)["points"] == 2
    env["records"][0]["ttft_s"] = 0.2
    path.write_text(json.dumps(env))
    with pytest.raises(ValueError, match="append-only"):
        store.import_files(engine, [path])


def test_find_max_doubles_then_bisects(ckpts, tmp_path, monkeypatch):
    _in_process(monkeypatch)
    monkeypatch.setenv(sweep_worker.OOM_HOOK_ENV, "40")  # fits below 40 tokens
    cfg = _cfg(ckpts, tmp_path, contexts_tokens=[16], find_max=True, find_max_resolution_tokens=4)
    recs = S.run(cfg)["records"]
    probes = [(r["seq_len"], r["status"]) for r in recs if r["point"] == "probe"]
    assert probes == [(32, "ok"), (64, "oom"), (48, "oom"), (40, "oom"), (36, "ok")]
    best = recs[-1]
    assert (best["point"], best["max_context_tokens"], best["first_failed_tokens"]) == ("max", 36, 40)


def test_stop_after_oom_skips_longer_contexts(ckpts, tmp_path, monkeypatch):
    _in_process(monkeypatch)
    monkeypatch.setenv(sweep_worker.OOM_HOOK_ENV, "1")
    recs = S.run(_cfg(ckpts, tmp_path, contexts_tokens=[16, 8]))["records"]
    assert [(r["seq_len"], r["status"]) for r in recs] == [(8, "oom"), (16, "skipped")]


def test_cli_sweep_stores_every_point_unless_no_store(ckpts, tmp_path, monkeypatch):
    """The library writes the JSON alone; ``hylo-bench sweep`` hands it the store's ``on_result``."""
    from typer.testing import CliRunner

    from hylo_bench.cli import app

    _in_process(monkeypatch)
    monkeypatch.setenv(sweep_worker.OOM_HOOK_ENV, "24")
    db = tmp_path / "cli.sqlite"
    args = ["sweep", str(ckpts / "hylo"), "--contexts", "16,24", "--decode-steps", "3", "--prefill-chunk", "8",
            "--device", "cpu", "--db", str(db)]
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a.json")])
    assert res.exit_code == 0, res.output
    pts = store.points_frame(store.open_store(db, create=False))
    assert sorted(zip(pts["seq_len"], pts["status"])) == [(16, "ok"), (24, "oom")]
    res = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b.json"), "--no-store"])
    assert res.exit_code == 0, res.output
    assert store.table_counts(store.open_store(db, create=False))["runs"] == 1  # the first sweep's run alone
    assert len(json.loads((tmp_path / "b.json").read_text())["records"]) == 2


def test_backend_and_baseline_errors(ckpts, tmp_path):
    with pytest.raises(ValueError, match="vLLM"):
        S.run(_cfg(ckpts, tmp_path, backend="vllm"))
    with pytest.raises(ValueError, match="backend"):
        _cfg(ckpts, tmp_path, backend="tgi")
    with pytest.raises(ValueError, match="recipe name"):
        S.resolve_baseline(str(ckpts / "hylo"), "backbone")
    assert S.resolve_baseline("HyLo-Qwen-7MLA21GDN-8K-SFT", "backbone") == "backbone:HyLo-Qwen-7MLA21GDN-8K-SFT"


def test_hf_backend_point_in_process(ckpts):
    spec = {"model": str(ckpts / "hylo"), "backend": "hf", "seq_len": 12, "batch_size": 2, "decode_steps": 3,
            "prefill_chunk": 4, "device": "cpu", "dtype": "fp32", "warmup": False}
    rec = sweep_worker.run_point(spec)
    assert rec["engine"] == "transformers-eager" and rec["prompt_tokens"] == 12 and rec["batch_size"] == 2
    assert rec["ttft_s"] > 0 and rec["tpot_s"] > 0 and "kv_cache_gib" not in rec


def test_a_point_without_time_for_its_full_prefill_is_estimated(ckpts):
    spec = {"model": str(ckpts / "hylo"), "backend": "native", "seq_len": 24, "batch_size": 1, "decode_steps": 3,
            "prefill_chunk": 8, "device": "cpu", "dtype": "fp32", "warmup": False}
    est = sweep_worker.run_point(spec | {"time_left_s": 0.0})
    assert est["mode"] == "estimated" and est["ttft_s"] is None and est["tpot_s"] > 0
    assert "left in the budget" in est["why_estimated"] and est["prompt_tokens"] == 24
    # 3 chunks of 8: TTFT ~= 3 * (first + last) / 2
    assert est["ttft_estimated_s"] == pytest.approx(3 * (est["first_chunk_s"] + est["last_chunk_s"]) / 2)
    assert est["fraction_of_bound"] == pytest.approx(est["bound_tpot_s"] / est["tpot_s"])
    # 2 MLA layers x 2 FLOPs x (keys each causal query sees, summed) x (16 + 16) dims x 4 heads
    assert est["prefill_attention_flops"] == 2 * 2 * sum(t + 1 for t in range(24)) * 32 * 4
    assert est["prefill_chunk"] == 8
    full = sweep_worker.run_point(spec | {"time_left_s": 3600.0})
    assert full["mode"] == "full" and full["ttft_s"] > 0 and "why_estimated" not in full
    assert full["ttft_estimate_ratio"] == pytest.approx(full["ttft_estimated_s"] / full["ttft_s"])
    plain = sweep_worker.run_point(spec)  # no budget: no chunk timing
    assert plain["mode"] == "full" and "ttft_estimated_s" not in plain


def test_a_spent_budget_skips_points_and_stops_the_find_max_search(ckpts, tmp_path, monkeypatch):
    calls, spent = [], [False]

    def fake(spec, timeout_s):
        calls.append((spec["seq_len"], spec["time_left_s"], timeout_s))
        spent[0] = spec["seq_len"] == 64  # the budget runs out during the second probe
        return {"status": "ok" if spec["seq_len"] < 40 else "oom"}

    monkeypatch.setattr(S, "run_worker", fake)
    clock = S.SweepRun.left_s
    monkeypatch.setattr(S.SweepRun, "left_s", lambda self: -1.0 if spent[0] else 100.0)
    cfg = _cfg(ckpts, tmp_path, contexts_tokens=[16], find_max=True, find_max_resolution_tokens=4, budget_s=100,
               reserve_s=30)
    recs = S.run(cfg)["records"]
    assert calls == [(16, 70.0, 120.0), (32, 70.0, 120.0), (64, 70.0, 120.0)]  # 100 s left - 30 reserve; +20 grace
    assert [(r["point"], r["seq_len"], r["status"]) for r in recs] == [
        ("grid", 16, "ok"), ("probe", 32, "ok"), ("probe", 64, "oom"), ("probe", 48, "skipped"), ("max", 32, "ok")]
    assert recs[-1]["first_failed_tokens"] == 64 and "budget of 100 s is spent" in recs[-1]["error"]

    calls.clear()
    monkeypatch.setattr(S.SweepRun, "left_s", clock)
    recs = S.run(_cfg(ckpts, tmp_path, contexts_tokens=[16, 8], baseline=str(ckpts / "llama"), budget_s=0))["records"]
    assert calls == [] and len(recs) == 6 and {r["status"] for r in recs} == {"skipped"}
    assert all("budget" in r["error"] for r in recs)


def test_cli_sweep_errors_are_actionable(ckpts, tmp_path):
    from typer.testing import CliRunner

    from hylo_bench.cli import app

    runner = CliRunner()
    base = ["sweep", str(ckpts / "hylo"), "--out", str(tmp_path / "s.json"), "--no-store"]
    res = runner.invoke(app, [*base, "--contexts", "16", "--backend", "vllm"])
    assert res.exit_code == 2 and "vLLM" in res.output and "--backend native" in res.output
    res = runner.invoke(app, [*base, "--contexts", "16", "--baseline", "backbone"])
    assert res.exit_code == 2 and "recipe name" in res.output
    res = runner.invoke(app, [*base, "--contexts", "8q"])
    assert res.exit_code == 2 and "8q" in res.output
    res = runner.invoke(app, [*base, "--contexts", "16", "--budget-s", "-5"])
    assert res.exit_code == 2 and "--budget-s -5" in res.output
    assert not (tmp_path / "s.json").exists()


def test_static_cache_baseline_gives_the_eager_loops_tokens_and_one_time_per_token():
    model = make_base("qwen3")
    ids = torch.randint(3, 400, (2, 20), generator=torch.Generator().manual_seed(0))
    eager, _ = sweep_worker._hf_generate_timed(model, ids, 5)
    static, t = sweep_worker._hf_static_generate_timed(model, ids, 5, compile=False, warmup=True)
    assert torch.equal(static, eager) and static.shape == (2, 5)
    assert len(t.decode_step_s) == 4 and t.ttft_s > 0 and t.batch_size == 2 and t.prompt_tokens == 20
