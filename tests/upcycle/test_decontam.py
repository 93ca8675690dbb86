"""13-gram decontamination of distillation documents against local eval sets."""

from __future__ import annotations

import json

import pytest

from hylo_bench.upcycle.decontam import (
    EvalIndex,
    decontaminate,
    decontaminate_documents,
    load_eval_texts,
    normalize_words,
    word_ngrams,
)
from hylo_bench.upcycle.documents import load_documents_with_ids

# 20 words; the planted training doc repeats words 3..15 (13 words) with other case and punctuation
EVAL_CTX = ("A man is sitting on a roof. He starts pulling up roofing on a roof while his friend holds the "
            "ladder steady below")
EVAL_WORDS = EVAL_CTX.lower().replace(".", "").split()


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def eval_dir(tmp_path):
    d = tmp_path / "evalsets"
    _write_jsonl(d / "hellaswag" / "validation.jsonl", [
        {"ctx": "Completely unrelated context about baking bread in a small oven for the whole family today",
         "endings": ["x"], "label": 0},
        {"ctx": EVAL_CTX, "endings": ["he falls", "he waves"], "label": "1"},
    ])
    _write_jsonl(d / "gsm8k" / "test.jsonl", [
        {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
         "answer": "72"}])
    (d / "notes").mkdir()
    (d / "notes" / "extra.txt").write_text("first block is short\n\n"
                                           "the quick brown fox jumps over the lazy dog while seven sleepy cats "
                                           "watch from the warm windowsill\n")
    return d


def test_normalisation():
    assert normalize_words("Don't STOP -- 3.14, ok?") == ["don", "t", "stop", "3", "14", "ok"]
    assert normalize_words("Élan  café\tNaïve") == ["élan", "café", "naïve"]
    assert word_ngrams(list("abcd"), 3) == ["a b c", "b c d"] and word_ngrams(["a"], 3) == []


def test_eval_texts_layout(eval_dir):
    texts = load_eval_texts(eval_dir)
    sources = {s for s, _, _ in texts}
    assert sources == {"hellaswag/validation", "gsm8k/test", "notes/extra.txt"}
    # each string field is its own text (nested lists included); non-strings are skipped
    hs = [(r, t) for s, r, t in texts if s == "hellaswag/validation"]
    assert ("line 2", EVAL_CTX) in hs and ("line 2", "he waves") in hs and ("line 2", "1") in hs
    assert ("line 1", "x") in hs and not any(t == 0 for _, t in hs)
    with pytest.raises(FileNotFoundError, match="DIR/<task>/<split>.jsonl"):
        load_eval_texts(eval_dir / "missing")


def test_planted_13gram_dropped_12gram_kept(eval_dir, tmp_path):
    planted_13 = "Intro text here. " + " ".join(w.upper() for w in EVAL_WORDS[3:16]) + "!!! and then more words"
    near_12 = "Intro text here, " + ", ".join(EVAL_WORDS[3:15]) + " -- but the thirteenth word differs here"
    docs = [
        ("train.jsonl:1", "An ordinary training document about rivers, mountains and the weather in spring."),
        ("train.jsonl:2", planted_13),
        ("train.jsonl:3", near_12),
        ("train.jsonl:4", "The quick brown fox jumps over the lazy dog while seven sleepy dogs watch from a roof"),
        ("train.jsonl:5", "x " + "the quick brown fox jumps over the lazy dog while seven sleepy cats watch"),
    ]
    assert len(normalize_words(" ".join(EVAL_WORDS[3:16]))) == 13
    kept, report = decontaminate_documents(docs, [str(eval_dir)], out_dir=tmp_path / "out")
    assert [i for i, _ in kept] == ["train.jsonl:1", "train.jsonl:3", "train.jsonl:4"]
    assert report["num_docs"] == 5 and report["num_dropped"] == 2
    assert report["dropped"] == [
        {"doc_id": "train.jsonl:2", "eval_source": "hellaswag/validation", "eval_row": "line 2",
         "ngram": " ".join(EVAL_WORDS[3:16])},
        {"doc_id": "train.jsonl:5", "eval_source": "notes/extra.txt", "eval_row": "block 2",
         "ngram": "the quick brown fox jumps over the lazy dog while seven sleepy cats"},
    ]
    assert report["dropped_by_source"] == {"hellaswag/validation": 1, "notes/extra.txt": 1}
    assert json.loads((tmp_path / "out" / "decontamination.json").read_text()) == report
    # the short eval strings ("x", "1", "72", "first block is short") give no 13-gram
    assert report["eval_sources"]["gsm8k/test"] == {"texts": 2, "texts_under_13_words": 1}


def test_index_counts_every_window():
    idx = EvalIndex.build([("t/s", "line 1", " ".join(f"w{i}" for i in range(20)))])
    assert len(idx.ngrams) == 20 - 13 + 1
    kept, report = decontaminate([("a", " ".join(f"w{i}" for i in range(7, 20)))], idx)
    assert kept == [] and report["dropped"][0]["ngram"] == " ".join(f"w{i}" for i in range(7, 20))


def test_document_ids(tmp_path):
    _write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "one"}, {"text": "two"}])
    (tmp_path / "d" / "a.txt").write_text("alpha\n\nbeta\n")
    assert load_documents_with_ids(tmp_path / "d") == [("a.txt#1", "alpha"), ("a.txt#2", "beta"),
                                                        ("b.jsonl:1", "one"), ("b.jsonl:2", "two")]
    assert load_documents_with_ids("demo")[0][0] == "demo#1"


def test_upcycle_drops_contaminated_documents(tiny_base_dir, tmp_path, eval_dir):
    from hylo_bench.config.upcycle import UpcycleConfig
    from hylo_bench.upcycle.documents import shipped_text, split_documents
    from hylo_bench.upcycle.run import run

    clean = split_documents(shipped_text())[:40]
    planted = clean[5] + " " + " ".join(EVAL_WORDS[2:15])
    _write_jsonl(tmp_path / "train.jsonl", [{"text": t} for t in clean[:5] + [planted] + clean[6:]])
    cfg = UpcycleConfig(out=str(tmp_path / "out"), base=str(tiny_base_dir), data=str(tmp_path / "train.jsonl"),
                        stages="64:ild@256", batch_size=2, eval_windows=0, device="cpu", tensorboard=False,
                        decontam=[str(eval_dir)])
    manifest = run(cfg)
    report = json.loads((tmp_path / "out" / "decontamination.json").read_text())
    assert [d["doc_id"] for d in report["dropped"]] == ["train.jsonl:6"] and report["num_docs"] == 40
    assert manifest["decontamination"]["dropped_doc_ids"] == ["train.jsonl:6"]
    assert manifest["settings"]["decontam"] == [str(eval_dir)]


def test_mixture_sources_are_decontaminated(tmp_path, eval_dir):
    import yaml

    from hylo_bench.upcycle.data import load_corpus

    _write_jsonl(tmp_path / "m" / "one.jsonl", [{"text": "clean text number one"},
                                                {"text": "leak: " + " ".join(EVAL_WORDS[0:13])}])
    _write_jsonl(tmp_path / "m" / "two.jsonl", [{"text": "clean text number two"}])
    (tmp_path / "m" / "mix.yaml").write_text(yaml.safe_dump({"sources": [
        {"name": "one", "path": "one.jsonl", "weight": 1}, {"name": "two", "path": "two.jsonl", "weight": 1}]}))
    corpus = load_corpus(str(tmp_path / "m" / "mix.yaml"), [str(eval_dir)])
    assert [[t for _, t in src] for src in corpus.mixture.docs] == [["clean text number one"],
                                                                   ["clean text number two"]]
    assert [d["doc_id"] for d in corpus.decontam_report["dropped"]] == ["one/one.jsonl:2"]
