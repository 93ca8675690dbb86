"""RULER QA tasks from local fixture files in the SQuAD v2 / HotpotQA formats: parsing, sizing, golds, seeds,
file lookup and its errors, scoring end to end."""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

import pytest

from hylo_bench.tasks.ruler import (
    TASKS,
    evaluate_model,
    generate_sample,
    load_qa,
    locate_qa_file,
    qa,
    sampling,
    select_tasks,
)
from hylo_bench.text.haystack import default_haystack_text, essay_words
from tests.tasks.test_ruler_generation import build_tokenizer
from tests.tasks.test_ruler_runner import INFO, _cfg, _quiet, _scripted

SEED = 42
QA_TASKS = ["ruler_qa_squad", "ruler_qa_hotpot"]


def _paragraphs(count: int, words: int, offset: int = 0) -> list[str]:
    """``count`` distinct paragraphs of ``words`` essay words each."""
    essay = essay_words(default_haystack_text())
    start = offset * words
    return [" ".join(essay[start + i * words : start + (i + 1) * words]) for i in range(count)]


def squad_fixture() -> dict:
    """8 articles x 40 paragraphs (~22K tokens with the test tokenizer); articles 0-2 carry questions: two answerable
    per article (answers are words of their paragraph, the first one with a duplicated and a second answer) and one
    impossible question."""
    paras = _paragraphs(320, 50)
    data = []
    for a in range(8):
        paragraphs = [{"context": p, "qas": []} for p in paras[a * 40 : (a + 1) * 40]]
        if a < 3:
            for j in (0, 7):
                words = paragraphs[j]["context"].split()
                answers = [{"text": f"{words[3]} {words[4]}", "answer_start": 0}]
                if j == 0:
                    answers += [{"text": f"{words[3]} {words[4]}", "answer_start": 0}, {"text": words[10]}]
                paragraphs[j]["qas"].append({"question": f"Q{a}-{j}: what follows {words[2]}?", "id": f"{a}{j}",
                                             "answers": answers, "is_impossible": False})
            paragraphs[3]["qas"].append({"question": f"Q{a}: unanswerable?", "id": f"{a}x", "answers": [],
                                         "plausible_answers": [{"text": "x"}], "is_impossible": True})
        data.append({"title": f"Article_{a}", "paragraphs": paragraphs})
    return {"version": "v2.0", "data": data}


def hotpot_fixture(num_questions: int = 30) -> list[dict]:
    """``num_questions`` questions x 10 paragraphs (2 gold + 8 distractors) of 3 sentences; consecutive questions
    share one distractor (so unique documents < 10 x questions)."""
    paras = _paragraphs(10 * num_questions, 45, offset=400)
    out = []
    for q in range(num_questions):
        ctx = []
        for k in range(10):
            idx = q * 10 + k if k < 9 or q == 0 else (q - 1) * 10 + 5  # last paragraph repeats one of q-1
            words = paras[idx].split()
            sents = [" ".join(words[:15]), " " + " ".join(words[15:30]), " " + " ".join(words[30:])]
            ctx.append([f"Title {idx}", sents])
        answer = ctx[0][1][1].split()[2]
        out.append({"_id": f"h{q}", "question": f"H{q}: which word?", "answer": answer, "type": "bridge",
                    "supporting_facts": [[ctx[0][0], 1], [ctx[1][0], 0]], "context": ctx})
    return out


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def qa_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("qa")
    (d / "dev-v2.0.json").write_text(json.dumps(squad_fixture()))
    (d / "hotpot_dev_distractor_v1.json").write_text(json.dumps(hotpot_fixture()))
    return {"ruler_qa_squad": d / "dev-v2.0.json", "ruler_qa_hotpot": d / "hotpot_dev_distractor_v1.json"}


@pytest.fixture(scope="module")
def samples(tok, qa_files):
    memo: dict = {}

    def get(task: str, length: int, flavor: str = "nvidia") -> list[dict]:
        if (task, length, flavor) not in memo:
            memo[task, length, flavor] = [
                generate_sample(task, tok, length, i, SEED, flavor=flavor, qa_path=qa_files[task]) for i in range(2)
            ]
        return memo[task, length, flavor]

    return get


def test_squad_parsing(qa_files):
    data = load_qa("ruler_qa_squad", qa_files["ruler_qa_squad"])
    assert len(data.docs) == 320 and list(data.docs) == sorted(data.docs)
    assert len(data.questions) == 6  # 3 articles x 2 answerable; the impossible ones are dropped
    first = data.questions[0]
    para = squad_fixture()["data"][0]["paragraphs"][0]["context"]
    words = para.split()
    assert first.outputs == (f"{words[3]} {words[4]}", f"{words[3]} {words[4]}", words[10])  # duplicates kept
    assert data.docs[first.context[0]] == para and len(first.context) == 1
    article = {p["context"] for p in squad_fixture()["data"][0]["paragraphs"]} - {para}
    assert {data.docs[i] for i in first.more_context} == article and len(first.more_context) == 39
    assert load_qa("ruler_qa_squad", qa_files["ruler_qa_squad"]) is data  # parsed once per file version
    assert len(data.sha256) == 64


def test_hotpot_parsing(qa_files):
    data = load_qa("ruler_qa_hotpot", qa_files["ruler_qa_hotpot"])
    raw = hotpot_fixture()
    assert len(data.docs) == 30 * 10 - 29 and list(data.docs) == sorted(data.docs)  # shared distractors deduplicated
    q = data.questions[3]
    title, sents = raw[3]["context"][0]
    assert data.docs[q.context[0]] == f"{title}\n{''.join(sents)}" and "  " not in data.docs[q.context[0]]
    assert len(q.context) == 10 and q.outputs == (raw[3]["answer"],) and q.more_context == ()


@pytest.mark.parametrize("flavor", ["nvidia", "lm-eval"])
@pytest.mark.parametrize("length", [4096, 8192, 16384])
@pytest.mark.parametrize("task", QA_TASKS)
def test_qa_prompt_fits_budget_and_holds_the_gold(tok, samples, qa_files, task, length, flavor):
    data = load_qa(task, qa_files[task])
    for s in samples(task, length, flavor):
        total = len(tok(s["prompt"], add_special_tokens=flavor != "nvidia").input_ids) + 32  # nvidia: no BOS
        assert s["length"] == total and 0.98 * length <= total <= length, (task, length, flavor, total)
        item = data.questions[s["index"]]
        assert s["question_index"] == s["index"] and s["outputs"] == list(item.outputs)
        doc_re = r"Document (\d+):\n(.*?)(?=\n\nDocument \d+:\n|\n\nAnswer the question)"
        docs = re.findall(doc_re, s["input"], re.DOTALL)
        assert [int(i) for i, _ in docs] == list(range(1, s["num_docs"] + 1))
        texts = [t for _, t in docs]
        assert all(t in data.docs for t in texts) and len(set(texts)) == len(texts)  # no repeats below the corpus
        for own in item.context:
            assert data.docs[own] in texts  # the gold paragraph(s) are in the context ...
        assert any(g in data.docs[item.context[0]] for g in s["outputs"])  # ... and hold the answer
        if task == "ruler_qa_squad":
            same_article = {data.docs[i] for i in item.more_context}
            assert same_article <= set(texts)  # the article's paragraphs fit at >= 4K, so all of them are in
        assert s["input"].startswith(
            "Answer the question based on the given documents. Only give me the answer and do not output any other "
            "words.\n\nThe following are given documents.\n\nDocument 1:\n"
        )
        assert s["input"].endswith(
            "\n\nAnswer the question based on the given documents. Only give me the answer and do not output any "
            f"other words.\n\nQuestion: {item.query}"
        )
        assert s["gen_prefix"] == "Answer:" and s["prompt"] == s["input"] + " Answer:"


def test_qa_document_positions_depend_only_on_the_count(tok, qa_files):
    """The fixed Random(42) shuffle of a list that starts with the question's paragraphs (ruler.md 3.5)."""
    data = load_qa("ruler_qa_hotpot", qa_files["ruler_qa_hotpot"])
    positions = []
    for index in range(3):
        item = data.questions[index]
        text = qa.qa_text(data, item, qa.select_docs(data, item, 40, random.Random(index), "nvidia"))
        found = [re.search(rf"Document (\d+):\n{re.escape(data.docs[i])}", text) for i in item.context]
        positions.append([int(m[1]) for m in found])
    assert positions[0] == positions[1] == positions[2] and len(set(positions[0])) == 10


def test_qa_samples_are_deterministic_and_independent_of_other_tasks(tok, qa_files):
    def gen(task, index, flavor="nvidia"):
        return generate_sample(task, tok, 4096, index, SEED, flavor=flavor, qa_path=qa_files[task])

    sampling.fitted_size.cache_clear()
    first = [gen("ruler_qa_squad", 1), gen("ruler_qa_hotpot", 2)]
    sampling.fitted_size.cache_clear()
    generate_sample("niah_single_1", tok, 4096, 0, SEED)
    gen("ruler_qa_hotpot", 0)
    second = [gen("ruler_qa_squad", 1), gen("ruler_qa_hotpot", 2)]
    assert first == second
    other_seed = generate_sample("ruler_qa_squad", tok, 4096, 1, SEED + 1, qa_path=qa_files["ruler_qa_squad"])
    assert other_seed["outputs"] == first[0]["outputs"] and other_seed["input"] != first[0]["input"]
    assert gen("ruler_qa_squad", 1, "lm-eval")["outputs"] == first[0]["outputs"]


def test_lm_eval_stops_at_the_corpus_end_nvidia_repeats_it(tok, tmp_path):
    small = squad_fixture()
    small["data"] = small["data"][:2]  # 80 paragraphs, ~5.5K tokens
    path = tmp_path / "dev-v2.0.json"
    path.write_text(json.dumps(small))
    lm = generate_sample("ruler_qa_squad", tok, 16384, 0, SEED, flavor="lm-eval", qa_path=path)
    assert lm["num_docs"] == 80 and lm["prompt_tokens"] + 32 < 0.5 * 16384
    nv = generate_sample("ruler_qa_squad", tok, 16384, 0, SEED, flavor="nvidia", qa_path=path)
    assert nv["num_docs"] > 160 and 0.98 * 16384 <= nv["prompt_tokens"] + 32 <= 16384


def test_qa_index_past_the_questions_is_actionable(tok, qa_files):
    with pytest.raises(ValueError, match=r"holds 6 usable questions for ruler_qa_squad; sample 6 .* at most 6"):
        generate_sample("ruler_qa_squad", tok, 4096, 6, SEED, qa_path=qa_files["ruler_qa_squad"])


def test_missing_qa_file_names_file_flag_env_and_url(tok, tmp_path, monkeypatch):
    monkeypatch.delenv("HYLO_BENCH_SQUAD", raising=False)
    monkeypatch.delenv("HYLO_BENCH_HOTPOTQA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError) as err:
        generate_sample("ruler_qa_squad", tok, 4096, 0, SEED)
    msg = str(err.value)
    for part in ("dev-v2.0.json", "--squad PATH", "HYLO_BENCH_SQUAD=PATH",
                 "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json",
                 str(tmp_path / "cache" / "hylo_bench" / "ruler" / "dev-v2.0.json")):
        assert part in msg, part
    _, reason = locate_qa_file("ruler_qa_hotpot", tmp_path / "nope.json")
    assert "hotpot_dev_distractor_v1.json" in reason and "--hotpotqa nope" not in reason
    assert f"--hotpotqa {tmp_path / 'nope.json'}" in reason and "HYLO_BENCH_HOTPOTQA=PATH" in reason
    assert "huggingface.co/datasets/namlh2004/hotpotqa/resolve/" in reason
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"qas": []}]}]}))
    with pytest.raises(ValueError, match=r"bad.json: data\[0\].paragraphs\[0\]: missing key 'context'"):
        load_qa("ruler_qa_squad", bad)


def test_qa_file_lookup_order(qa_files, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("HYLO_BENCH_SQUAD", raising=False)
    default = tmp_path / "hylo_bench" / "ruler" / "dev-v2.0.json"
    assert locate_qa_file("ruler_qa_squad")[0] is None
    default.parent.mkdir(parents=True)
    default.write_text(qa_files["ruler_qa_squad"].read_text())
    assert locate_qa_file("ruler_qa_squad") == (default, "")
    monkeypatch.setenv("HYLO_BENCH_SQUAD", str(qa_files["ruler_qa_squad"]))
    assert locate_qa_file("ruler_qa_squad") == (qa_files["ruler_qa_squad"], "")
    assert locate_qa_file("ruler_qa_squad", default) == (default, "")


def test_tasks_all_skips_qa_without_data(qa_files, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("HYLO_BENCH_SQUAD", raising=False)
    monkeypatch.delenv("HYLO_BENCH_HOTPOTQA", raising=False)
    with caplog.at_level(logging.WARNING):
        tasks = select_tasks("all")
    assert tasks == [t for t in TASKS if t not in QA_TASKS]
    assert "skipping ruler_qa_squad" in caplog.text and "skipping ruler_qa_hotpot" in caplog.text
    assert "--squad PATH" in caplog.text
    assert select_tasks("all", squad_path=qa_files["ruler_qa_squad"])[-1] == "ruler_qa_squad"
    monkeypatch.setenv("HYLO_BENCH_HOTPOTQA", str(qa_files["ruler_qa_hotpot"]))
    assert select_tasks("all", qa_files["ruler_qa_squad"]) == list(TASKS)
    assert select_tasks("ruler_qa_squad, niah_single_1") == ["ruler_qa_squad", "niah_single_1"]
    with pytest.raises(FileNotFoundError, match="--squad PATH"):
        _cfg(tmp_path, tasks=["ruler_qa_squad"])


def test_qa_end_to_end_records_both_metrics(tok, qa_files, tmp_path):
    cfg = _cfg(tmp_path, tasks=QA_TASKS, lengths=[4096], samples=2, squad_path=qa_files["ruler_qa_squad"],
               hotpotqa_path=qa_files["ruler_qa_hotpot"], flavor="lm-eval")
    out = evaluate_model(_scripted(tok, cfg, oracle=True), tok, INFO, cfg, console=_quiet())
    # the oracle prints every gold, so both metrics give full credit
    assert out["scores"] == {t: {"4096": 100.0} for t in QA_TASKS} and out["flavor"] == "lm-eval"
    doc = json.loads(Path(out["results_path"]).read_text())
    assert [r["score_by_flavor"] for r in doc["records"]] == [{"nvidia": 100.0, "lm-eval": 100.0}] * 2
    assert set(doc["provenance"]["qa_data_sha256"]) == set(QA_TASKS)
    assert doc["config"]["squad_path"] == str(qa_files["ruler_qa_squad"])
    assert all(TASKS[t].max_gen_toks == 32 for t in QA_TASKS)


def test_qa_gap_fill_reaches_the_window_with_large_documents(tok, tmp_path):
    """Whole ~260-token documents leave up to 6% of 4K unused; the gap fill adds shorter next-priority ones."""
    big, small = _paragraphs(60, 200), _paragraphs(60, 12, offset=1200)
    squad = squad_fixture()
    squad["data"].append({"title": "Mixed", "paragraphs": [{"context": p, "qas": []} for p in big + small]})
    for article in squad["data"][:3]:  # questions' own articles: one paragraph each, so selection is random
        article["paragraphs"] = [p for p in article["paragraphs"] if p["qas"]][:1]
    squad["data"] = squad["data"][:3] + squad["data"][-1:]
    path = tmp_path / "dev-v2.0.json"
    path.write_text(json.dumps(squad))
    filled = 0
    for index in range(3):
        s = generate_sample("ruler_qa_squad", tok, 4096, index, SEED, qa_path=path)
        assert 0.98 * 4096 <= s["prompt_tokens"] + 32 <= 4096, index
        filled += s["num_docs"] > s["haystack_units"]
    assert filled >= 1


def test_cli_flags_and_missing_file_error(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from hylo_bench.cli import app

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("HYLO_BENCH_SQUAD", raising=False)
    runner = CliRunner()
    res = runner.invoke(app, ["ruler", "--model", "demo", "--tasks", "ruler_qa_squad", "--results-dir", str(tmp_path)])
    assert res.exit_code == 2
    flat = " ".join(res.output.split())
    assert "dev-v2.0.json" in flat and "--squad PATH" in flat and "HYLO_BENCH_SQUAD" in flat
    res = runner.invoke(app, ["ruler", "--model", "demo", "--tasks", "niah_single_1", "--flavor", "original",
                              "--results-dir", str(tmp_path)])
    assert res.exit_code == 2 and "flavor must be one of nvidia, lm-eval" in " ".join(res.output.split())
    res = runner.invoke(app, ["ruler", "--help"])
    assert all(flag in res.output for flag in ("--flavor", "--squad", "--hotpotqa"))


def test_select_docs_priority_and_corpus_repeat():
    docs = tuple(f"doc {i:02d}" for i in range(12))
    data = qa.QAData(task="ruler_qa_squad", path="x", sha256="0" * 64, docs=docs, questions=())
    item = qa.QAItem(query="q", outputs=("a",), context=(5,), more_context=(1, 2, 2, 9))  # 2 listed twice
    assert qa.select_docs(data, item, 1, random.Random(0), "nvidia") == [5]
    some = qa.select_docs(data, item, 3, random.Random(0), "nvidia")
    assert some[0] == 5 and set(some[1:]) <= {1, 2, 9} and len(some) == 3
    full = qa.select_docs(data, item, 8, random.Random(0), "nvidia")
    assert full[:5] == [5, 1, 2, 2, 9] and len(set(full[5:]) - {1, 2, 5, 9}) == 3  # article order, then others
    assert qa.select_docs(data, item, 8, random.Random(0), "nvidia") == full  # same rng seed, same draw
    over = qa.select_docs(data, item, 30, random.Random(0), "nvidia")
    assert len(over) == 30 and set(over) == set(range(12))  # corpus used, then repeated
    assert qa.select_docs(data, item, 12, random.Random(0), "lm-eval") == list(range(12))
    nxt = qa.fill_candidates(data, item, 6, random.Random(0), 3)
    assert nxt == full[6:8] + [i for i in qa.select_docs(data, item, 9, random.Random(0), "nvidia")[8:]]
