"""benchmarks/batched_decode.py in its --tiny CPU mode: the results envelope, one record per batch size with the
serving keys and a bound equal to a hand count, continuous-batching records with the scheduled step counts, and
the --max-seconds guard."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks import run_tiny

SERVING_KEYS = ("layout", "seq_len", "batch_size", "ttft_s", "tpot_s", "tokens_per_s", "bound_tpot_s",
                "fraction_of_bound", "mode", "status")


def _run(tmp_path: Path, *extra: str) -> dict:
    return run_tiny("batched_decode.py", tmp_path / "b.json", *extra)


def test_tiny_run_writes_the_envelope_and_flat_records(tmp_path):
    doc = _run(tmp_path)
    assert {"benchmark", "git_sha", "device", "versions", "records"} <= doc.keys()
    assert doc["benchmark"] == "batched_decode" and doc["device"] == "cpu" and doc["finished"] is True
    recs = doc["records"]
    assert all(not isinstance(v, (dict, list)) for r in recs for v in r.values())
    decode = [r for r in recs if r["benchmark"] == "batched_decode"]
    assert [(r["batch_size"], r["status"]) for r in decode] == [(1, "ok"), (2, "ok"), (4, "ok")]
    for r in decode:
        assert all(r[k] is not None for k in SERVING_KEYS), r
        assert r["mode"] == "estimated" and r["layout"] == "2MLA2GDN" and r["seq_len"] == 96
        B = r["batch_size"]
        # 2 MLA layers x (kv_lora_rank 32 + rope 8 + 2 key scales) fp32 x 96 tokens; 2 GDN layers x (2 x 16 x 32 fp32
        # state + 128 conv channels x 3 taps fp32) read and written
        assert r["bound_cache_bytes"] == B * 96 * 2 * 42 * 4
        assert r["bound_state_bytes"] == B * 2 * 2 * (2 * 16 * 32 * 4 + 128 * 3 * 4)
        assert r["bound_tpot_s"] == pytest.approx(r["bound_bytes_per_step"] / r["copy_bandwidth_B_per_s"])
        assert r["fraction_of_bound"] == pytest.approx(r["bound_tpot_s"] / r["tpot_s"])
    ruler = [r for r in recs if r["benchmark"] == "ruler_continuous_batching"]
    # 6 requests x 4 tokens on 3 slots: two rounds of 3 decode steps; 2 requests on 1 slot: 3 + 3 steps
    assert [(r["batch_size"], r["num_samples"], r["decode_steps"], r["status"]) for r in ruler] == [
        (3, 6, 6, "ok"), (1, 2, 6, "ok")]
    for r in ruler:
        assert "ruler" in r["benchmark"] and r["samples_per_s"] > 0 and r["all_full_length"] is True
        assert r["generated_tokens"] == 4 * r["num_samples"]
    (prefill,) = [r for r in recs if r["benchmark"] == "batched_decode_prefill"]
    assert prefill["status"] == "ok" and prefill["prefill_chunks"] == 3  # 96 tokens in chunks of 32
    assert prefill["ttft_s"] == pytest.approx(3 * (prefill["first_chunk_s"] + prefill["last_chunk_s"]) / 2)
    assert all(r["ttft_s"] == prefill["ttft_s"] for r in decode)
    (parity,) = [r for r in recs if r["benchmark"] == "batched_decode_parity"]
    assert parity["status"] == "ok" and parity["tokens_equal_batch1"] is True and parity["requests"] == 4


def test_max_seconds_guard_skips_points_and_still_writes(tmp_path):
    doc = _run(tmp_path, "--max-seconds", "0", "--grace-s", "600")  # a loaded machine builds slowly: no watchdog
    recs = doc["records"]
    assert len(recs) == 7 and {r["status"] for r in recs} == {"skipped"}
    assert all("--max-seconds" in r["error"] for r in recs)
