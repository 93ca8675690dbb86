"""``ruler --backend lm-eval``: lm-eval 0.4.13's own ruler tasks through the ``hylo`` model class, offline.

One module-scoped run (tiny tokenizer, a model whose ``generate`` reads the answer out of the prompt) feeds most
checks: importing lm-eval's ``prepare_niah`` alone sorts 6.2M word pairs, so it is paid once per session.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hylo_bench.tasks.lm_eval_bridge import HyLoLM
from hylo_bench.tasks.ruler import RulerConfig, render_tables
from hylo_bench.tasks.ruler import lm_eval_backend as LB
from tests.tasks.test_ruler_runner import _quiet, build_small_tokenizer

INFO = {"name": "tiny/llama", "path": "/nowhere", "hash": "abc123", "layout": "transformer", "kind": "transformer"}
LENGTH = 2048  # lm-eval's VT few-shot example alone is sized to ~500 tokens; 1K does not fit VT with this tokenizer
TASKS = ["niah_single_1", "niah_single_2", "ruler_vt"]
SAMPLES = 3

_NEEDLE = re.compile(r"One of the special magic \w+ for (\S+?) is: (\S+?)\.")
_NIAH_QUERY = re.compile(r"What (?:is|are all) the special magic \w+ for (.+?) mentioned in the provided text\?")
_VT_QUERY = re.compile(r"Find all variables that are assigned the value (\d+) in the text above\.")


def oracle_answer(prompt: str) -> str:
    """The gold answer of a RULER prompt, read from the prompt itself (NIAH needles, VT assignment chains)."""
    if queries := _NIAH_QUERY.findall(prompt):
        keys = set(re.split(r", and |, ", queries[-1]))
        return " ".join(v for k, v in _NEEDLE.findall(prompt) if k in keys)
    if queries := _VT_QUERY.findall(prompt):
        found = set(re.findall(rf"VAR (\w+) = {queries[-1]}\b", prompt))
        while True:
            more = {a for a, b in re.findall(r"VAR (\w+) = VAR (\w+)", prompt) if b in found} - found
            if not more:
                return " ".join(sorted(found))
            found |= more
    raise AssertionError(f"not a NIAH / VT prompt: {prompt[-300:]!r}")


def _right(prompt: str) -> bool:
    return hashlib.sha256(prompt.encode()).digest()[0] % 2 == 0


class OracleLlama(LlamaForCausalLM):
    """A tiny Llama whose ``generate`` answers from the prompt: ``mode`` ``oracle`` (always right), ``empty``
    (EOS at once) or ``half`` (right when a prompt hash is even, else a wrong number); logs what it answered."""

    def __init__(self, config: LlamaConfig, tokenizer, mode: str = "oracle"):
        super().__init__(config)
        self.tok, self.mode, self.seen, self.answer = tokenizer, mode, [], oracle_answer

    def generate(self, input_ids, max_new_tokens, pad_token_id, attention_mask=None, **kwargs):
        rows = []
        for ids in input_ids:
            prompt = self.tok.decode(ids, skip_special_tokens=True)
            right = self.mode == "oracle" or (self.mode == "half" and _right(prompt))
            answer = self.answer(prompt) if right else ("" if self.mode == "empty" else "0000000")
            self.seen.append((prompt, right))
            new = self.tok(" " + answer, add_special_tokens=False).input_ids if answer else []
            rows.append(new[: max_new_tokens - 1] + [self.tok.eos_token_id])
        width = max(len(r) for r in rows)
        new_BT = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new_BT], dim=1)


@pytest.fixture(scope="module")
def tok():
    return build_small_tokenizer()


def _lm(tok, mode: str, batch_size: int = 2) -> HyLoLM:
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return HyLoLM(pretrained=OracleLlama(config, tok, mode), tokenizer=tok, batch_size=batch_size,
                  max_length=LENGTH + 1024)


def _cfg(tmp_path, **kw) -> RulerConfig:
    base = {"model": "tiny", "lengths": [LENGTH], "tasks": TASKS, "samples": SAMPLES, "results_dir": tmp_path,
            "seed": 0, "backend": "lm-eval", "flavor": "lm-eval"}
    return RulerConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def oracle_run(tok, tmp_path_factory):
    from hylo_bench.reports import store

    out = tmp_path_factory.mktemp("lmeval-oracle")
    lm = _lm(tok, "oracle")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYLO_BENCH_DB", str(out / "store.sqlite"))
        summary = LB.evaluate_lm_eval(lm, INFO, _cfg(out), console=_quiet(), on_result=store.recorder(None, out))
    return summary, lm


def test_oracle_scores_100_in_the_native_shape(oracle_run):
    summary, lm = oracle_run
    assert set(summary) == {"model", "flavor", "backend", "scores", "mean", "avg", "weighted_avg_inc",
                            "weighted_avg_dec", "results_path"}
    assert summary["backend"] == "lm-eval" and summary["flavor"] == "lm-eval" and summary["model"] == INFO["name"]
    assert summary["scores"] == {t: {str(LENGTH): 100.0} for t in TASKS}
    assert summary["mean"] == {str(LENGTH): 100.0} and summary["avg"] == 100.0
    assert json.loads(json.dumps(summary)) == summary  # what --json prints
    # every sample reached the model through lm-eval: SAMPLES per task, the NIAH prompts end in lm-eval's gen prefix
    assert len(lm.model.seen) == SAMPLES * len(TASKS)
    niah = [p for p, _ in lm.model.seen if "special magic number for" in p]
    assert len(niah) == 2 * SAMPLES and all(p.rstrip().endswith("mentioned in the provided text is") for p in niah)
    assert sum("VAR " in p for p, _ in lm.model.seen) == SAMPLES
    assert render_tables(summary)[-1].title.endswith("(lm-eval flavor via lm-eval)")


def test_results_file_records_backend_and_goes_to_the_store(oracle_run, tok):
    from hylo_bench.reports import store
    from hylo_bench.reports.results import parse_ruler_run

    summary, _ = oracle_run
    path = Path(summary["results_path"])
    doc = json.loads(path.read_text())
    assert doc["kind"] == "ruler" and doc["backend"] == "lm-eval" and doc["flavor"] == "lm-eval"
    prov = doc["provenance"]
    assert prov["backend"] == "lm-eval" and prov["lm_eval_version"] == "0.4.13" and prov["seed"] == 0
    assert prov["sentence_splitter"] and prov["max_length"] == LENGTH + 1024
    assert len(parse_ruler_run(doc, path.name)) == len(TASKS)  # the store's validation of RULER files
    for rec in doc["records"]:
        assert rec["backend"] == "lm-eval" and rec["lm_eval_task"] == rec["task"] and rec["n"] == SAMPLES
        assert rec["score"] == 100.0 and rec["nulls"] == 0 and rec["seq_len"] == LENGTH
        assert 0 < rec["prompt_tokens_min"] <= rec["prompt_tokens_max"] <= LENGTH + 100
    rows = [json.loads(line) for line in (path.parent / "lm-eval-ruler" / path.stem / f"ruler_vt-{LENGTH}.jsonl")
            .read_text().splitlines()]
    assert len(rows) == SAMPLES and all(set(r["outputs"]) <= set(r["prediction"].split()) for r in rows)
    engine = store.open_store(path.parent / "store.sqlite", create=False)  # store.record ran after every task
    df = store.metrics_frame(engine)
    assert sorted(df["task"]) == sorted(TASKS) and set(df["value"]) == {100.0} and set(df["flavor"]) == {"lm-eval"}
    assert store.table_counts(engine)["runs"] == 1
    assert json.loads(store.runs_frame(engine)["config_json"][0])["backend"] == "lm-eval"


def test_lm_eval_scorer_is_used_half_right_and_empty(tok, tmp_path):
    """A model right on about half the prompts scores exactly the fraction it got right (lm-eval's
    string_match_all, x100), and one that outputs nothing scores 0 with every prediction counted as null."""
    lm = _lm(tok, "half")
    summary = LB.evaluate_lm_eval(lm, INFO, _cfg(tmp_path / "half", tasks=["niah_single_1"], samples=6),
                                  console=_quiet())
    right = [r for _, r in lm.model.seen]
    assert len(right) == 6 and 0 < sum(right) < 6  # the hash split is not degenerate on these prompts
    assert summary["scores"]["niah_single_1"][str(LENGTH)] == pytest.approx(100.0 * sum(right) / 6)

    lm = _lm(tok, "empty")
    summary = LB.evaluate_lm_eval(lm, INFO, _cfg(tmp_path / "empty", tasks=["niah_single_1"]), console=_quiet())
    assert summary["scores"] == {"niah_single_1": {str(LENGTH): 0.0}}
    doc = json.loads(Path(summary["results_path"]).read_text())
    assert doc["records"][0]["nulls"] == SAMPLES


def test_qa_uses_lm_evals_part_match_on_local_squad(tok, tmp_path):
    """SQuAD from a local file through lm-eval's QA generator; answering only the first gold answer scores lm-eval's
    fraction of golds found (2 of the 3 listed for question Q0-0, one of them a duplicate; 1 of 1 for Q0-7), not the
    any-match of NVIDIA's metric (which would give 100)."""
    from tests.tasks.test_ruler_qa import squad_fixture

    fixture = squad_fixture()
    golds = {q["question"].split(":")[0]: [a["text"] for a in q["answers"]]
             for art in fixture["data"] for p in art["paragraphs"] for q in p["qas"] if not q["is_impossible"]}
    squad = tmp_path / "dev-v2.0.json"
    squad.write_text(json.dumps(fixture))
    lm = _lm(tok, "oracle")
    lm.model.answer = lambda prompt: golds[re.findall(r"Question: (Q\d+-\d+):", prompt)[-1]][0]
    summary = LB.evaluate_lm_eval(lm, INFO, _cfg(tmp_path, tasks=["ruler_qa_squad"], samples=2, squad_path=squad),
                                  console=_quiet())
    assert sorted(re.findall(r"Question: (Q\d+-\d+):", p)[-1] for p, _ in lm.model.seen) == ["Q0-0", "Q0-7"]
    assert summary["scores"]["ruler_qa_squad"][str(LENGTH)] == pytest.approx(100.0 * (2 / 3 + 1) / 2)
    doc = json.loads(Path(summary["results_path"]).read_text())
    assert doc["provenance"]["qa_data_sha256"]["ruler_qa_squad"] == hashlib.sha256(squad.read_bytes()).hexdigest()


def test_sample_cap_keeps_lm_evals_first_samples(tok):
    """Generating min(500, N) samples gives exactly the first N of lm-eval's 500 (checked on VT at 1K-ish, where
    lm-eval's full 500 are cheap)."""
    import random

    import numpy as np
    from lm_eval.tasks.ruler.common_utils import get_tokenizer

    def gen(cap):
        random.seed(0)
        np.random.seed(1234)
        with LB.offline_hooks(["ruler_vt"], "unused essay text", {}, sample_cap=cap):
            vt = LB._load_task_module("vt_utils")
            return vt.get_vt_dataset(max_seq_lengths=[LENGTH], tokenizer=tok_dir)["test"].to_list()

    with LB.tokenizer_dir(tok, None) as tok_dir:
        get_tokenizer(tok_dir)
        full, capped = gen(None), gen(4)
    assert len(full) == LB.LM_EVAL_SAMPLES_PER_LENGTH and capped == full[:4]


def test_too_short_length_is_a_clear_error_not_a_hang(tok, tmp_path):
    with pytest.raises(ValueError, match=r"lm-eval's ruler_vt cannot fit a prompt into 700 tokens"):
        LB.evaluate_lm_eval(_lm(tok, "oracle"), INFO, _cfg(tmp_path, lengths=[700], tasks=["ruler_vt"]),
                            console=_quiet())


def test_bad_input_is_actionable(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--backend lm-eval: no lm-eval 0.4.13 ruler task for 'niah_single_9'"):
        _cfg(tmp_path, tasks=["niah_single_9"])
    with pytest.raises(ValueError, match="flavor 'nvidia'"):
        _cfg(tmp_path, flavor="nvidia")
    with pytest.raises(ValueError, match=r"--resume.*--engine native"):
        _cfg(tmp_path, resume=True, engine="native")
    with pytest.raises(ValueError, match="backend must be one of"):
        _cfg(tmp_path, backend="vllm")
    with pytest.raises(ValueError, match=r"--prefill-chunk \(the native engine's.*--no-prefix-sharing"):
        _cfg(tmp_path, prefill_chunk=4096, prefix_sharing=False)
    monkeypatch.delenv("HYLO_BENCH_SQUAD", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    with pytest.raises(FileNotFoundError, match=r"dev-v2\.0\.json.*rajpurkar.*--squad.*HYLO_BENCH_SQUAD"):
        _cfg(tmp_path, tasks=["ruler_qa_squad"])


def test_offline_qa_hook_reads_the_local_file_and_names_a_missing_one(tmp_path):
    squad = tmp_path / "dev-v2.0.json"
    squad.write_text(json.dumps({"version": "v2.0", "data": [{"title": "t", "paragraphs": [
        {"context": "Denver won.", "qas": [{"question": "Who won?", "id": "1", "is_impossible": False,
                                            "answers": [{"text": "Denver", "answer_start": 0}]}]}]}]}))
    original = LB._load_task_module("qa_utils").download_json
    with LB.offline_hooks(["ruler_qa_squad"], "essay", {"ruler_qa_squad": squad}):
        qa = LB._load_task_module("qa_utils")
        assert qa.download_json is not original
        qas, docs = qa.read_squad()
        assert docs == ["Denver won."] and qas[0]["outputs"] == ["Denver"]
        with pytest.raises(FileNotFoundError, match="hotpot_dev_distractor_v1.json"):
            qa.read_hotpotqa()
    assert LB._load_task_module("qa_utils").download_json is original  # restored on exit
