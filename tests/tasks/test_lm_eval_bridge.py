"""The lm-eval bridge: ``hylo`` registration, log-likelihood parity with a direct forward pass, batched ==
unbatched, the 8 short tasks on local fixture files (forced answers score 100), and ``hylo-bench eval`` end to end.

CPU, offline: datasets come from JSONL files written by the tests (``lmeval_fixtures.py``).
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest
import torch

os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

from lm_eval.api.instance import Instance
from lm_eval.api.model import LM

from hylo_bench.tasks import lm_eval_bridge as B
from tests.conftest import make_base, tiny_hybrid_config
from tests.tasks.lmeval_fixtures import FIXTURES, GOLD_WORD, write_fixtures


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


class ForcedLM(LM):
    """Stub: a continuation scores 0 when it holds the gold word (or, for WinoGrande's partial scoring, when the
    context ends with it), else -10; GSM8K questions are answered with the right sum. Records every request."""

    def __init__(self):
        super().__init__()
        self.requests: list[tuple] = []

    def loglikelihood(self, requests):
        self.requests += [r.args for r in requests]
        return [(0.0 if GOLD_WORD in cont or ctx.rstrip().endswith(GOLD_WORD) else -10.0, False)
                for ctx, cont in (r.args for r in requests)]

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    def generate_until(self, requests):
        outs = []
        for r in requests:
            n = int(re.search(r"Tom has (\d+) apples", r.args[0]).group(1))
            outs.append(f" He has {n} + 2 = {n + 2} apples.\n#### {n + 2}")
        return outs


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return write_fixtures(tmp_path_factory.mktemp("lmeval_data"))


@pytest.fixture(scope="module")
def forced_run(fixture_dir, tmp_path_factory):
    lm = ForcedLM()
    cfg = B.EvalConfig(model="stub", tasks=list(B.PAPER_TASKS), output_dir=tmp_path_factory.mktemp("out"),
                       data_dir=fixture_dir)
    return lm, B.evaluate_lm(lm, cfg)


def test_forced_answers_score_100_on_all_8_tasks(forced_run):
    lm, res = forced_run
    scores = B.scores_from_results(res)
    assert set(scores) == set(B.PAPER_TASKS)
    for task in B.COMMONSENSE_TASKS:
        assert scores[task]["acc"] == 100.0, task
    for task in ("arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa"):
        assert scores[task]["acc_norm"] == 100.0, task
    assert scores["gsm8k"] == {"exact_match,strict-match": 100.0, "exact_match,flexible-extract": 100.0}
    assert res["n-shot"] == {t: 0 for t in B.PAPER_TASKS}
    assert {t: v["effective"] for t, v in res["n-samples"].items()} == {t: 4 for t in B.PAPER_TASKS}
    # one request per choice: 4 docs x (4 choices x 5 tasks + 2 piqa + 2 winogrande)
    assert len(lm.requests) == 4 * (4 * 5 + 2 + 2)


def test_fixture_prompts_follow_the_task_yamls(forced_run):
    _, res = forced_run
    args = {t: [s["arguments"] for s in res["samples"][t]] for t in B.PAPER_TASKS}
    assert args["arc_easy"][0][0][0] == "Question: Which answer is number 0?\nAnswer:"
    assert args["arc_easy"][0][0][1] == f" {GOLD_WORD} stripes"
    # hellaswag process_docs: "{activity_label}: {ctx_a} {ctx_b capitalised}", " [title]" -> ". ", brackets gone
    assert args["hellaswag"][0][0][0] == "Running: A person number 0 starts to run. They"
    assert args["hellaswag"][1][1][1] == " then it rains. hard."
    assert args["race"][0][0][0].startswith("Article: Story 0. An animal ran far across the field.\n\n"
                                            "Question: Who ran in story 0 part 0?\nAnswer: the zebra\n")
    assert args["winogrande"][1][0] == ("In scene 1 the stone", " ran away quickly.")
    assert args["gsm8k"][0][0][0] == ("Question: Tom has 0 apples and buys 2 more. How many apples does he have?"
                                      "\nAnswer:")
    assert args["gsm8k"][0][0][1]["until"] == ["Question:", "</s>", "<|im_end|>"]


def test_missing_local_file_names_the_expected_path(tmp_path):
    write_fixtures(tmp_path / "data", tasks=["piqa"])
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "data" / "race" / "test.jsonl"))):
        B.local_task_dir(["piqa", "race"], tmp_path / "data", tmp_path / "yaml", num_fewshot=0)
    # 5-shot GSM8K needs its train split
    (tmp_path / "data" / "gsm8k").mkdir()
    (tmp_path / "data" / "gsm8k" / "test.jsonl").write_text("{}\n")
    with pytest.raises(FileNotFoundError, match=r"gsm8k/train\.jsonl \(the few-shot split 'train'\)"):
        B.local_task_dir(["gsm8k"], tmp_path / "data", tmp_path / "yaml", num_fewshot=5)
    out = B.local_task_dir(["gsm8k"], tmp_path / "data", tmp_path / "yaml", num_fewshot=0)
    doc = json.loads((out / "gsm8k.yaml").read_text())
    assert doc["dataset_kwargs"] == {"data_files": {"test": str(tmp_path / "data" / "gsm8k" / "test.jsonl")}}
    assert doc["training_split"] is None and doc["fewshot_split"] is None and doc["task"] == "gsm8k"


def test_registered_under_hylo():
    from lm_eval.api.registry import get_model

    assert get_model("hylo") is B.HyLoLM


@pytest.fixture(scope="module")
def tiny_models(tiny_tokenizer):
    from hylo_bench.models.hybrid import HyLoForCausalLM

    torch.manual_seed(0)
    hylo = HyLoForCausalLM(tiny_hybrid_config(vocab_size=len(tiny_tokenizer))).eval()
    return {"llama": make_base("llama", vocab_size=len(tiny_tokenizer)), "hylo": hylo}


def _reference_loglikelihood(model, tok, ctx: str, cont: str) -> tuple[float, bool]:
    """Sum of log p(cont tokens | prefix) from one forward pass in float64, lm-eval's tokenisation rule."""
    if ctx:
        n_space = len(ctx) - len(ctx.rstrip())  # trailing whitespace moves to the continuation
        ctx, cont = ctx[: len(ctx) - n_space], ctx[len(ctx) - n_space:] + cont
        ctx_ids = tok.encode(ctx)
        cont_ids = tok.encode(ctx + cont)[len(ctx_ids):]
    else:  # empty context: the BOS (prefix token) alone conditions the continuation
        ctx_ids, cont_ids = [tok.bos_token_id], tok.encode(cont, add_special_tokens=False)
    ids = (ctx_ids + cont_ids)[:-1]
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)[-len(cont_ids):]
    target = torch.tensor(cont_ids)
    return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def _instances(args: list[tuple], kind: str) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=0, metadata=("t", i, 1)) for i, a in enumerate(args)]


@pytest.mark.parametrize("kind", ["llama", "hylo"])
def test_loglikelihood_equals_direct_forward_and_batching(kind, tiny_models, tiny_tokenizer, forced_run):
    lm_requests = forced_run[0].requests[::6] + [("", " a zebra"), ("Question: x ", "y")]
    model = tiny_models[kind].double()
    try:
        unbatched = B.HyLoLM(pretrained=model, tokenizer=tiny_tokenizer, batch_size=1)
        got = unbatched.loglikelihood(_instances(lm_requests, "loglikelihood"))
        ref = [_reference_loglikelihood(model, tiny_tokenizer, c, x) for c, x in lm_requests]
        for (lp, greedy), (lp_ref, greedy_ref), req in zip(got, ref, lm_requests):
            assert lp == pytest.approx(lp_ref, rel=1e-9, abs=1e-9), req
            assert greedy == greedy_ref
        assert min(lp for lp, _ in got) < -20.0  # real multi-token sums, not zeros
        batched = B.HyLoLM(pretrained=model, tokenizer=tiny_tokenizer, batch_size=7)
        got_b = batched.loglikelihood(_instances(lm_requests, "loglikelihood"))
        assert [lp for lp, _ in got_b] == pytest.approx([lp for lp, _ in got], rel=1e-9, abs=1e-9)
        texts = [(a[0] + a[1],) for a in lm_requests[:6]]
        rolling_1 = unbatched.loglikelihood_rolling(_instances(texts, "loglikelihood_rolling"))
        rolling_b = batched.loglikelihood_rolling(_instances(texts, "loglikelihood_rolling"))
        assert rolling_b == pytest.approx(rolling_1, rel=1e-9, abs=1e-9)
        # rolling = log p(all tokens of tok_encode(text)) after the prefix token (BOS); lm-eval scores the
        # tokenizer's own BOS too
        seq = [tiny_tokenizer.bos_token_id] + tiny_tokenizer.encode(texts[0][0])
        with torch.no_grad():
            logp = model(torch.tensor([seq[:-1]])).logits[0].log_softmax(-1)
        assert rolling_1[0] == pytest.approx(float(logp.gather(-1, torch.tensor(seq[1:])[:, None]).sum()), rel=1e-9)
    finally:
        model.float()


@pytest.mark.parametrize("kind", ["llama", "hylo"])
def test_generate_until_batched_equals_unbatched(kind, tiny_models, tiny_tokenizer):
    model = tiny_models[kind]
    prompts = ["Question: Tom has 3 apples.\nAnswer:", "Hi", "A much longer prompt about the devil and his words:",
               "Question: what?\nAnswer:", "x y z"]
    gen = {"until": ["Question:"], "do_sample": False, "temperature": 0.0, "max_gen_toks": 12}
    reqs = [(p, dict(gen)) for p in prompts]
    one = B.HyLoLM(pretrained=model, tokenizer=tiny_tokenizer, batch_size=1).generate_until(
        _instances(reqs, "generate_until"))
    many = B.HyLoLM(pretrained=model, tokenizer=tiny_tokenizer, batch_size=5).generate_until(
        _instances([(p, dict(gen)) for p in prompts], "generate_until"))
    assert many == one
    assert sum(len(o) for o in one) > 10  # the random model does produce text
    # the unbatched output is the plain greedy continuation (12 new tokens unless a stop string cut it)
    ids = torch.tensor([tiny_tokenizer.encode(prompts[2])])
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=2)
    greedy = tiny_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("Question:")[0]
    assert one[2] == greedy


@pytest.mark.parametrize("kind", ["llama", "hylo"])
def test_native_engine_generate_until_equals_generate(kind, tiny_models, tiny_tokenizer):
    """engine='native' (serving engine, row by row, stop strings via should_stop) gives generate()'s texts."""
    model = tiny_models[kind]
    prompts = ["Question: Tom has 3 apples.\nAnswer:", "Hi", "A much longer prompt about the devil and his words:"]

    def run(engine, until, batch_size, tokenizer=tiny_tokenizer):
        gen = {"until": until, "do_sample": False, "temperature": 0.0, "max_gen_toks": 16}
        lm = B.HyLoLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, engine=engine)
        return lm, lm.generate_until(_instances([(p, dict(gen)) for p in prompts], "generate_until"))

    lm, free = run("native", ["\u2603"], 3)
    assert lm.engine == "native" and lm._native is not None
    assert free == run("generate", ["\u2603"], 3)[1]
    assert sum(len(t) for t in free) > 20
    longest = max(free, key=len)
    stop = longest[len(longest) // 2 : len(longest) // 2 + 2]  # a stop string met mid-generation
    cut = run("native", [stop], 1)[1]
    assert cut == run("generate", [stop], 3)[1]
    # 3 requests on 2 continuous-batching slots (HyLo): one refill. This run on the session's tokenizer object changed
    # the tokenizer that later fixtures save (test_cli_eval_end_to_end's tokenizer hash): it gets a copy
    assert run("native", [stop], 2, copy.deepcopy(tiny_tokenizer))[1] == cut
    assert cut[free.index(longest)] == longest.split(stop)[0]


def test_static_engine_generate_until_equals_generate(tiny_models, tiny_tokenizer, monkeypatch):
    """engine='static' (generate() over a preallocated StaticCache) gives generate()'s texts for left-padded
    batches, stop strings included; a HyLo model is refused with the engine to use."""
    from transformers import StaticCache

    built = []
    monkeypatch.setattr("transformers.StaticCache", lambda **kw: built.append(kw) or StaticCache(**kw))
    model = tiny_models["llama"]
    prompts = ["Question: Tom has 3 apples.\nAnswer:", "Hi", "A much longer prompt about the devil and his words:"]

    def run(engine, until):
        gen = {"until": until, "do_sample": False, "temperature": 0.0, "max_gen_toks": 16}
        lm = B.HyLoLM(pretrained=model, tokenizer=tiny_tokenizer, batch_size=3, engine=engine)
        return lm.generate_until(_instances([(p, dict(gen)) for p in prompts], "generate_until"))

    free = run("static", ["\u2603"])
    assert free == run("generate", ["\u2603"]) and sum(len(t) for t in free) > 20
    longest = max(free, key=len)
    stop = longest[len(longest) // 2 : len(longest) // 2 + 2]
    assert run("static", [stop]) == run("generate", [stop])
    assert len(built) == 2  # one StaticCache per HyLoLM: both runs' 3 prompts in one batch
    with pytest.raises(ValueError, match="engine 'native'"):
        B.HyLoLM(pretrained=tiny_models["hylo"], tokenizer=tiny_tokenizer, engine="static")


def test_engine_auto_resolves_to_generate_on_cpu(tiny_models, tiny_tokenizer):
    assert B.HyLoLM(pretrained=tiny_models["hylo"], tokenizer=tiny_tokenizer).engine == "generate"
    with pytest.raises(ValueError, match="engine: expected one of"):
        B.HyLoLM(pretrained=tiny_models["hylo"], tokenizer=tiny_tokenizer, engine="vllm")


def test_tie_weights_keeps_hylo_head_untied(tiny_models, tiny_tokenizer):
    model = tiny_models["hylo"]
    before = model.lm_head.weight.clone()
    B.HyLoLM(pretrained=model, tokenizer=tiny_tokenizer)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, before)


def test_eval_config_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError, match="batch_size"):
        B.EvalConfig(model="demo", tasks=["piqa"], output_dir=tmp_path, batch_size="big")
    with pytest.raises(ValueError, match="data_dir"):
        B.EvalConfig(model="demo", tasks=["piqa"], output_dir=tmp_path, data_dir=tmp_path / "nope")
    with pytest.raises(ValueError, match="dtype"):
        B.EvalConfig(model="demo", tasks=["piqa"], output_dir=tmp_path, dtype="int3")


@pytest.fixture
def tiny_hylo_dir(tmp_path, tiny_models, tiny_tokenizer):
    from hylo_bench.models.checkpoint import save_hylo

    d = tmp_path / "tiny_hylo"
    save_hylo(tiny_models["hylo"], d)
    tiny_tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("ckpt", ["llama", "hylo"])
def test_cli_eval_end_to_end(ckpt, tiny_base_dir, tiny_hylo_dir, fixture_dir, tmp_path):
    from typer.testing import CliRunner

    from hylo_bench.cli import app
    from hylo_bench.reports import store

    out = tmp_path / "results"
    ckpt_dir = tiny_base_dir if ckpt == "llama" else tiny_hylo_dir
    res = CliRunner().invoke(app, ["eval", str(ckpt_dir), "--tasks", "piqa,winogrande", "--data-dir",
                                   str(fixture_dir), "--limit", "3", "--batch-size",
                                   "auto" if ckpt == "llama" else "2", "--output-dir", str(out),
                                   "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(summary["scores"]) == {"piqa", "winogrande"}
    assert set(summary["scores"]["piqa"]) == {"acc", "acc_norm"} and set(summary["scores"]["winogrande"]) == {"acc"}
    assert all(v in (0.0, 100 / 3, 200 / 3, 100.0) for m in summary["scores"].values() for v in m.values())
    assert summary["n_samples"] == {"piqa": 3, "winogrande": 3}
    lm_eval_file = json.loads(Path(summary["lm_eval_results_path"]).read_text())
    assert lm_eval_file["results"]["piqa"]["acc,none"] * 100 == pytest.approx(summary["scores"]["piqa"]["acc"])
    assert lm_eval_file["config"]["model"] == "hylo" and lm_eval_file["n-shot"] == {"piqa": 0, "winogrande": 0}
    assert lm_eval_file["config"]["hylo_model"]["kind"] == ("transformer" if ckpt == "llama" else "hybrid")
    ours = json.loads(Path(summary["results_path"]).read_text())
    assert ours["kind"] == "lm-eval-summary" and ours["scores"] == summary["scores"]
    prov = ours["provenance"]
    from transformers import AutoTokenizer

    from hylo_bench.tasks.ruler.cache import tokenizer_hash

    assert prov["tokenizer_hash"] == tokenizer_hash(AutoTokenizer.from_pretrained(ckpt_dir))
    assert (prov["device"], prov["param_dtype"], prov["engine"]) == ("cpu", "torch.float32", "generate")
    assert prov["torch_version"] == torch.__version__ and prov["lm_eval_version"] and prov["git_sha"]
    assert ours["config"]["batch_size"] == ("auto" if ckpt == "llama" else "2") and ours["config"]["seed"] == 0
    metrics = store.metrics_frame(store.open_store(None, out, create=False))
    assert sorted(metrics["task"] + ":" + metrics["metric"]) == ["piqa:acc", "piqa:acc_norm", "winogrande:acc"]
    if ckpt == "hylo":
        return
    # a missing local file is a clear CLI error
    res = CliRunner().invoke(app, ["eval", str(tiny_base_dir), "--tasks", "race", "--data-dir", str(tmp_path),
                                   "--output-dir", str(out)])
    assert res.exit_code == 2 and "race/test.jsonl" in res.output.replace("\n", "")


def test_fixtures_cover_every_paper_task():
    assert set(FIXTURES) == set(B.PAPER_TASKS)


def test_two_worker_processes_give_the_one_process_scores(tiny_hylo_dir, fixture_dir, tmp_path):
    """--devices 2 on CPU (gloo): lm-eval shards the requests over two spawned workers, rank 0 gathers; the scores,
    per-sample log-likelihoods and generations equal a one-process run's (batch 1: a left-padded batch of a random
    model can flip a near-tie argmax somewhere in 256 generated tokens)."""
    tasks = ["piqa", "winogrande", "gsm8k"]
    runs = {}
    for n in (1, 2):
        cfg = B.EvalConfig(model=str(tiny_hylo_dir), tasks=tasks, output_dir=tmp_path / f"w{n}", data_dir=fixture_dir,
                           limit=4, batch_size=1, device="cpu", devices=n)
        runs[n] = B.run(cfg)
    assert runs[2]["world_size"] == 2 and runs[1]["world_size"] == 1
    assert runs[2]["scores"] == runs[1]["scores"] and runs[2]["n_samples"] == {t: 4 for t in tasks}

    def per_sample(run):
        out = {}
        for f in Path(run["lm_eval_results_path"]).parent.glob("samples_*.jsonl"):
            for line in filter(None, f.read_text().split("\n")):  # not splitlines: U+2028 may occur raw
                row = json.loads(line)
                out[(f.name.split("_")[1], row["doc_id"])] = row["resps"]
        return out

    one, two = per_sample(runs[1]), per_sample(runs[2])
    assert len(one) == 12 and one.keys() == two.keys()
    for key in one:
        if key[0] == "gsm8k":  # greedy generations: the same text
            assert two[key] == one[key], key
        else:  # [[["<loglikelihood>", "<is_greedy>"]], ...] per choice (lm-eval writes them as strings)
            lls = [[float(r[0][0]) for r in run[key]] for run in (one, two)]
            assert lls[1] == pytest.approx(lls[0], rel=1e-5) and min(lls[0]) < -5.0, key
            assert [r[0][1] for r in two[key]] == [r[0][1] for r in one[key]], key
