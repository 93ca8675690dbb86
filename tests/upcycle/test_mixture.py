"""Data mixtures: YAML parsing, local / Hub sources, ranges, draw ratios, resumable sampling, the run wiring."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from hylo_bench.config.mixture import parse_mixture
from hylo_bench.upcycle.mixture import MixtureSampler, load_mixture, mixture_windows


def _jsonl(path, texts, field="text"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))


def _yaml(path, doc):
    import yaml

    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def sources(tmp_path):
    _jsonl(tmp_path / "a.jsonl", [f"alpha document {i}" for i in range(10)])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "b.txt").write_text("\n\n".join(f"beta block {i}" for i in range(4)))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": [f"gamma row {i}" for i in range(6)]}), tmp_path / "c.parquet")
    return tmp_path


def test_parse_errors():
    with pytest.raises(ValueError, match="non-empty 'sources'"):
        parse_mixture({"sources": []})
    with pytest.raises(ValueError, match="exactly one of 'path'"):
        parse_mixture({"sources": [{"name": "a", "weight": 1}]})
    with pytest.raises(ValueError, match="weight must be a positive"):
        parse_mixture({"sources": [{"name": "a", "path": "x", "weight": 0}]})
    with pytest.raises(ValueError, match="unknown keys \\['ratio'\\]"):
        parse_mixture({"sources": [{"name": "a", "path": "x", "weight": 1, "ratio": 2}]})
    with pytest.raises(ValueError, match="range must be"):
        parse_mixture({"sources": [{"name": "a", "path": "x", "weight": 1, "range": [0.5, 0.2]}]})
    with pytest.raises(ValueError, match="unique"):
        parse_mixture({"sources": [{"name": "a", "path": "x", "weight": 1}, {"name": "a", "path": "y", "weight": 1}]})


def test_local_sources_and_ranges(sources):
    path = _yaml(sources / "mix.yaml", {"seed": 3, "sources": [
        {"name": "a", "path": "a.jsonl", "weight": 2, "range": [0.0, 0.3]},
        {"name": "a_rest", "path": "a.jsonl", "weight": 1, "range": [0.3, 1.0]},
        {"name": "b", "path": "b", "weight": 1},
        {"name": "c", "path": "c.parquet", "weight": 1, "text_field": "content"}]})
    mix = load_mixture(path)
    assert [len(d) for d in mix.docs] == [3, 7, 4, 6]
    a_texts = {t for _, t in mix.docs[0]} | {t for _, t in mix.docs[1]}
    assert a_texts == {f"alpha document {i}" for i in range(10)}  # disjoint ranges cover the source
    assert not {t for _, t in mix.docs[0]} & {t for _, t in mix.docs[1]}
    assert sorted(t for _, t in mix.docs[3]) == sorted(f"gamma row {i}" for i in range(6))
    assert mix.docs[2][0][0].startswith("b/b.txt#") and mix.docs[3][0][0].startswith("c/c.parquet:")
    assert mix.probabilities == pytest.approx([0.4, 0.2, 0.2, 0.2])
    assert load_mixture(path).docs == mix.docs  # the split shuffle is seeded


def test_ratios_hold_over_many_draws(sources):
    mix = load_mixture(_yaml(sources / "mix.yaml", {"sources": [
        {"name": "a", "path": "a.jsonl", "weight": 0.6}, {"name": "b", "path": "b", "weight": 0.3},
        {"name": "c", "path": "c.parquet", "weight": 0.1, "text_field": "content"}]}))
    s = MixtureSampler(mix)
    n = 30_000
    drawn = [s.next_document()[0] for _ in range(n)]
    shares = [drawn.count(i) / n for i in range(3)]
    # binomial sd at n = 30k is <= 0.003; allow 4 sd
    assert shares == pytest.approx([0.6, 0.3, 0.1], abs=0.012)
    assert s.counts == [drawn.count(i) for i in range(3)]
    # within a source every document comes once per epoch
    s2 = MixtureSampler(mix)
    b_docs = [d for i, d, _ in (s2.next_document() for _ in range(2000)) if i == 1][:8]
    assert sorted(b_docs[:4]) == sorted(b_docs[4:8]) == sorted(d for d, _ in mix.docs[1])


def test_resumed_sampler_continues_the_same_sequence(sources):
    mix = load_mixture(_yaml(sources / "mix.yaml", {"sources": [
        {"name": "a", "path": "a.jsonl", "weight": 1}, {"name": "b", "path": "b", "weight": 1}]}))
    s = MixtureSampler(mix, seed=11)
    head = [s.next_document() for _ in range(37)]  # past the end of source b's first epoch
    state = json.loads(json.dumps(s.state_dict()))
    tail = [s.next_document() for _ in range(60)]
    r = MixtureSampler(mix, seed=11)
    r.load_state_dict(state)
    assert [r.next_document() for _ in range(60)] == tail
    fresh = MixtureSampler(mix, seed=11)
    assert [fresh.next_document() for _ in range(97)] == head + tail
    with pytest.raises(ValueError, match="does not match this mixture"):
        MixtureSampler(mix, seed=12).load_state_dict(state)


def test_hub_source_reads_through_datasets(tmp_path, monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"problem": f"hub row {i}"} for i in range(5)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    mix = load_mixture(_yaml(tmp_path / "m.yaml", {"sources": [
        {"name": "math", "hub": "org/set", "hub_config": "main", "split": "train", "text_field": "problem",
         "weight": 1}]}))
    assert calls == [("org/set", "main", "train")]
    assert sorted(t for _, t in mix.docs[0]) == [f"hub row {i}" for i in range(5)]
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="pip install datasets"):
        load_mixture(tmp_path / "m.yaml")


def test_windows_record_draws(sources, tiny_tokenizer):
    mix = load_mixture(_yaml(sources / "mix.yaml", {"sources": [
        {"name": "a", "path": "a.jsonl", "weight": 1}, {"name": "b", "path": "b", "weight": 1}]}))
    s = MixtureSampler(mix)
    w, drawn = mixture_windows(s, tiny_tokenizer, 16, 5)
    assert w.shape == (5, 16) and sum(drawn["tokens"]) == 80 and sum(drawn["docs"]) == s.draws
    ref = MixtureSampler(mix)
    ids = []
    for _ in range(s.draws):
        ids += tiny_tokenizer(ref.next_document()[2], add_special_tokens=False).input_ids + [1]
    assert torch.equal(w.flatten(), torch.tensor(ids[:80]))


def test_upcycle_with_mixture_resumes_the_stream(tiny_base_dir, tmp_path, monkeypatch):
    from hylo_bench.config.upcycle import UpcycleConfig
    from hylo_bench.models.hybrid import load_hylo
    from hylo_bench.upcycle.documents import shipped_text, split_documents
    from hylo_bench.upcycle.run import run
    from hylo_bench.upcycle.train import trainer as trainer_mod

    docs = split_documents(shipped_text())
    _jsonl(tmp_path / "d" / "one.jsonl", docs[:60])
    _jsonl(tmp_path / "d" / "two.jsonl", docs[60:120])
    mix = _yaml(tmp_path / "d" / "mix.yaml", {"sources": [{"name": "one", "path": "one.jsonl", "weight": 3},
                                                         {"name": "two", "path": "two.jsonl", "weight": 1}]})

    def cfg(out):
        return UpcycleConfig(out=str(tmp_path / out), base=str(tiny_base_dir), data=str(mix),
                             stages="64:ild@512,64@512", batch_size=2, eval_windows=1, device="cpu", save_every=2,
                             tensorboard=False)

    ref = run(cfg("ref"))
    st = ref["stages"]
    assert st[1]["sampler_state"] == st[0]["sampler_state_end"] != st[0]["sampler_state"]
    assert sum(v["tokens"] for v in st[0]["mixture_draws"].values()) == 4 * 2 * 64
    assert ref["mixture"]["sources"][0]["num_docs"] == 60
    saved = json.loads((tmp_path / "ref" / "stages" / "1-kd-64" / "sampler_state.json").read_text())
    assert saved == st[1]["sampler_state_end"]

    real, calls = trainer_mod._save_resume, {"n": 0}

    def save_then_die(*a, **k):
        real(*a, **k)
        calls["n"] += 1
        if calls["n"] == 2:  # the KD stage's first mid-stage save
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "_save_resume", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run(cfg("cut"))
    monkeypatch.setattr(trainer_mod, "_save_resume", real)
    resumed = run(cfg("cut"))
    assert [e["sampler_state_end"] for e in resumed["stages"]] == [e["sampler_state_end"] for e in st]
    a, b = load_hylo(tmp_path / "ref", dtype=None).state_dict(), load_hylo(tmp_path / "cut", dtype=None).state_dict()
    assert all(torch.equal(v, b[k]) for k, v in a.items())


def test_broken_yaml_names_the_file_and_line(tmp_path):
    from hylo_bench.upcycle.mixture import load_mixture

    bad = tmp_path / "mix.yaml"
    bad.write_text("sources:\n  - path: a.txt\n    weight: [\n")
    with pytest.raises(ValueError, match=r"--data .*mix.yaml: not valid YAML \(line \d+, column \d+\)"):
        load_mixture(bad)
