"""RULER sample generation: registry, byte-exact prompts, sizing to the token budget, golds, determinism."""

from __future__ import annotations

import collections
import itertools
import random
import re
import uuid

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from hylo_bench.tasks import ruler
from hylo_bench.tasks.ruler import (
    TASKS,
    generate_sample,
    generators,
    get_task,
    list_tasks,
    sample_seed,
    sampling,
)
from hylo_bench.text import haystack

LENGTHS = (1024, 4096, 8192, 16384)
NUM_SAMPLES = 2
SEED = 42
SYNTHETIC = [t for t, spec in TASKS.items() if spec.generator != "qa"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (6144 tokens) trained on the shipped essay plus UUIDs and 7-digit numbers, adding BOS.

    The UUIDs and numbers in the training data give it roughly Llama-3's density on needle values (a UUID
    needle line is ~45 tokens), which sets the sizing granularity of niah_multikey_3.
    """
    rng = random.Random(0)
    extra = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(6000)]
    extra += [str(rng.randint(10**6, 10**7 - 1)) for _ in range(6000)]
    tok = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(r" ?[^\s]+|\s+"), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=6144, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([haystack.default_haystack_text(), " ".join(extra)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def samples(tok):
    """Memoised ``(task, length) -> [sample 0, sample 1]``."""
    memo: dict = {}

    def get(task: str, length: int, flavor: str = "nvidia") -> list[dict]:
        if (task, length, flavor) not in memo:
            memo[task, length, flavor] = [
                generate_sample(task, tok, length, i, SEED, flavor=flavor) for i in range(NUM_SAMPLES)
            ]
        return memo[task, length, flavor]

    return get


def test_registry_matches_ruler_md_table():
    assert list_tasks() == [
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe",
        "ruler_qa_squad", "ruler_qa_hotpot",
    ]  # fmt: skip
    rows = {
        n: (t.haystack, t.key_type, t.value_type, t.num_keys, t.num_values, t.num_queries) for n, t in TASKS.items()
    }
    assert rows["niah_single_1"] == ("repeat", "words", "numbers", 1, 1, 1)
    assert rows["niah_single_3"] == ("essay", "words", "uuids", 1, 1, 1)
    assert rows["niah_multikey_1"] == ("essay", "words", "numbers", 4, 1, 1)
    assert rows["niah_multikey_3"] == ("needle", "uuids", "uuids", 1, 1, 1)
    assert rows["niah_multiquery"] == ("essay", "words", "numbers", 4, 1, 4)
    assert rows["niah_multivalue"] == ("essay", "words", "numbers", 1, 4, 1)
    gen = {name: t.max_gen_toks for name, t in TASKS.items()}
    assert gen == {**{n: 128 for n in list_tasks()[:8]}, "ruler_vt": 30, "ruler_cwe": 120, "ruler_fwe": 50,
                   "ruler_qa_squad": 32, "ruler_qa_hotpot": 32}  # fmt: skip
    assert [n for n, t in TASKS.items() if t.metric != "string_match_all"] == ["ruler_qa_squad", "ruler_qa_hotpot"]
    assert {t.metric for t in TASKS.values()} == {"string_match_all", "string_match_part"}
    assert (TASKS["ruler_qa_squad"].original_name, TASKS["ruler_qa_hotpot"].original_name) == ("qa_1", "qa_2")
    assert [n for n, t in TASKS.items() if t.target_delimiter != " "] == ["ruler_cwe"]
    assert TASKS["ruler_cwe"].target_delimiter == "\n\n"


def test_unknown_task_lists_valid_names(tok):
    with pytest.raises(ValueError, match="valid tasks: niah_single_1, .*ruler_fwe"):
        get_task("niah_single_9")
    with pytest.raises(ValueError, match="unknown RULER task"):
        generate_sample("nope", tok, 1024, 0, SEED)


def test_word_pools_match_lm_eval():
    import wonderwords

    r = wonderwords.RandomWord()
    expected = sorted({w for c in ("noun", "adjective", "verb") for w in r._categories[c]})
    random.Random(42).shuffle(expected)
    assert list(haystack.cwe_words()) == expected and len(expected) == 8166
    adjs, nouns = haystack._key_words()
    assert set(adjs) == set(r._categories["adjectives"]) and set(nouns) == set(r._categories["nouns"])
    assert haystack.num_key_words() == 6171620
    assert haystack.DEPTHS[:4] == (0, 3, 5, 8) and len(haystack.DEPTHS) == 40 and haystack.DEPTHS[-1] == 100


def test_fwe_zeta_matches_scipy():
    special = pytest.importorskip("scipy.special")
    assert generators.FWE_ZETA == special.zeta(2.0)


def test_split_sentences_round_trips_and_skips_abbreviations():
    text = 'ABASEMENT, n. A decent attitude. Dr. Johnson said "no." Then he left! 42 men stayed? yes. End'
    sents = haystack.split_sentences(text)
    assert " ".join(sents) == text
    assert sents == [
        "ABASEMENT, n. A decent attitude.", 'Dr. Johnson said "no."', "Then he left!", "42 men stayed? yes.", "End"
    ]  # fmt: skip
    words = haystack.essay_words(haystack.default_haystack_text())
    assert haystack.essay_prefix(words, len(words) + 3).split(" ")[-3:] == list(words[:3])


def test_largest_fitting_matches_brute_force():
    rng = random.Random(1)
    for trial in range(200):
        per_unit, base = rng.randint(1, 60), rng.randint(5, 300)
        jitter = [rng.randint(0, 3) for _ in range(5000)]
        calls = []

        def measure(n):
            calls.append(n)
            return base + per_unit * n + jitter[n]

        budget = rng.randint(base + per_unit + 3, 50_000)
        start = rng.randint(1, 4000)
        got = sampling.largest_fitting(measure, budget=budget, n_min=1, n_max=4000, n_start=start)
        assert len(set(calls)) <= 30, trial
        fits = [n for n in range(1, 4001) if measure(n) <= budget]
        # non-monotone jitter: the answer fits and its successor does not (or it is the cap)
        assert measure(got) <= budget and (got == 4000 or measure(got + 1) > budget), trial
        assert got >= max(fits) - 3
    with pytest.raises(sampling.PromptTooLongError):
        sampling.largest_fitting(lambda n: 100 + n, budget=50, n_min=1, n_max=10, n_start=5)


@pytest.mark.parametrize("flavor", ["nvidia", "lm-eval"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", SYNTHETIC)
def test_prompt_fits_budget_tightly(tok, samples, task, length, flavor):
    max_gen = TASKS[task].max_gen_toks
    if flavor == "nvidia" and task == "ruler_cwe" and length == 1024:
        pytest.skip("nvidia's CWE prompt carries its one-shot example and needs > 1024 tokens with this tokenizer")
    for s in samples(task, length, flavor):
        # nvidia sizes as NVIDIA/RULER counts (tokenize(): no BOS), lm-eval with the BOS; the BOS is fed either way
        sized = len(tok(s["prompt"], add_special_tokens=flavor != "nvidia").input_ids)
        total = sized + max_gen
        assert s["prompt_tokens"] == len(tok(s["prompt"]).input_ids)
        assert s["length"] == total and s["max_length"] == length and s["flavor"] == flavor
        assert total <= length
        assert total >= 0.95 * length, (task, length, total)
        if length >= 4096:
            assert total >= 0.98 * length, (task, length, total)
        delimiter = " " if flavor == "nvidia" else TASKS[task].target_delimiter
        assert s["prompt"] == s["input"] + delimiter + s["gen_prefix"]


def _niah_keys(sample: dict) -> list[str]:
    pattern = r"The special magic \w+ for (.*) mentioned in the provided text (is|are)$"
    query = re.match(pattern, sample["gen_prefix"])[1]
    return re.split(r", and |, ", query)


@pytest.mark.parametrize("length", (1024, 4096))
@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")])
def test_niah_needles_and_golds(samples, task, length):
    spec = TASKS[task]
    value_type = spec.value_type
    for s in samples(task, length):
        keys = _niah_keys(s)
        assert len(keys) == spec.num_queries and len(s["outputs"]) == spec.num_queries * spec.num_values
        for i, key in enumerate(keys):
            for value in s["outputs"][i * spec.num_values : (i + 1) * spec.num_values]:
                needle = f"One of the special magic {value_type} for {key} is: {value}."
                assert s["input"].count(needle) == 1, needle
        head, rest = s["input"].split("\n", 1)
        context, question = rest.rsplit("\n", 1)
        planted = context.count(f"One of the special magic {value_type} for ")
        if spec.haystack == "repeat":
            assert context.split("\n").count(haystack.NOISE_LINE) == s["haystack_units"]
            assert planted == spec.num_needle_keys * spec.num_values
        elif spec.haystack == "needle":
            assert planted == s["haystack_units"] + 1 == len(context.split("\n"))
            assert sum(line.split(" for ")[1].startswith(keys[0] + " is:") for line in context.split("\n")) == 1
        else:
            assert planted == spec.num_needle_keys * spec.num_values
            stripped = re.sub(r"One of the special magic \w+ for [^ ]+ is: [0-9a-f-]+\.", " ", context)
            words = haystack.essay_words(haystack.default_haystack_text())
            assert stripped.split() == haystack.essay_prefix(words, s["haystack_units"]).split()
        if spec.num_queries * spec.num_values == 1:
            noun = value_type[:-1]
            assert head == (
                f"A special magic {noun} is hidden within the following text. Make sure to memorize it. "
                f"I will quiz you about the {noun} afterwards."
            )
            assert question == f"What is the special magic {noun} for {keys[0]} mentioned in the provided text?"
            assert s["gen_prefix"] == f"The special magic {noun} for {keys[0]} mentioned in the provided text is"
        else:
            query = ", ".join(keys) if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
            assert head.startswith("Some special magic numbers are hidden within the following text.")
            assert question == f"What are all the special magic numbers for {query} mentioned in the provided text?"
            assert s["gen_prefix"] == f"The special magic numbers for {query} mentioned in the provided text are"


def test_niah_single_1_prompt_ending(samples):
    s = samples("niah_single_1", 1024)[0]
    key = _niah_keys(s)[0]
    assert s["prompt"].endswith(
        f"There and back again.\nWhat is the special magic number for {key} mentioned in the provided text? "
        f"The special magic number for {key} mentioned in the provided text is"
    )
    assert re.fullmatch(r"[1-9]\d{6}", s["outputs"][0])
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                        samples("niah_single_3", 1024)[0]["outputs"][0])  # fmt: skip


@pytest.mark.parametrize("length", (1024, 4096))
def test_vt_chain_and_prompt_lm_eval(samples, length):
    for s in samples("ruler_vt", length, "lm-eval"):
        names = s["outputs"]
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        example, real = s["input"].split("\n\n\n\n")
        assert real.startswith(
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        )
        assert real.endswith("Question: Find all variables that are assigned the value "
                             f"{s['gen_prefix'].split('value ')[1].split(',')[0]} in the text above.")  # fmt: skip
        value = re.search(rf"VAR {names[0]} = (\d{{5}}) ", real)[1]
        for a, b in zip(names, names[1:]):
            assert f"VAR {b} = VAR {a} " in real
        assert s["gen_prefix"] == (
            "Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
            f"assgined the value {value}, they are:"
        )
        assert re.search(r"they are:  [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}$", example)
        assert example.startswith("Memorize and track the chain(s)")
        assert "\n The grass is green." in real and "variables are assigned" not in example + s["gen_prefix"]


@pytest.mark.parametrize("length", (1024, 4096))
def test_vt_chain_and_prompt_nvidia(samples, length):
    for s in samples("ruler_vt", length, "nvidia"):
        names = s["outputs"]
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
        example = s["input"].split("\n\nMemorize and track")[0]
        real = s["input"][len(example) + 2 :]
        assert s["input"][len(example) : len(example) + 2] == "\n\n" and not example.endswith("\n")
        head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        assert real.startswith(head)
        value = re.search(rf"VAR {names[0]} = (\d{{5}})\n", real)[1]
        for a, b in itertools.pairwise(names):
            assert f"\nVAR {b} = VAR {a} \n" in real
        context = real.split("\n\n", 1)[1].rsplit("\nQuestion:", 1)[0]
        assert all(line == haystack.NOISE_LINE or line.startswith("VAR ") for line in context.split("\n"))
        assert s["gen_prefix"] == (
            "Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
            f"assigned the value {value}, they are: "
        )
        assert s["prompt"].endswith(f"in the text above. {s['gen_prefix']}")
        ex_value = re.match(r"Memorize.*?\nVAR [A-Z]{3} = (\d{5})\n", example, re.DOTALL)
        assert ex_value and ex_value[1] != "12345" and f"assigned the value {ex_value[1]}, they are:  " in example
        assert re.search(r"they are:  [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3} [A-Z]{3}$", example)


def _cwe_entries(sample: dict) -> list[str]:
    body = sample["input"].split("Memorize the ones that appear most often.\n", 1)[1].rsplit("\nQuestion:", 1)[0]
    parts = re.split(r"(?:^| )(\d+)\. ", body)[1:]
    numbers, words = [int(p) for p in parts[0::2]], parts[1::2]
    assert numbers == list(range(1, len(words) + 1))
    return words


@pytest.mark.parametrize("length", (1024, 4096))
def test_cwe_counts(samples, length):
    common_repeats, uncommon_repeats = generators.cwe_repeats(length)
    for s in samples("ruler_cwe", length, "lm-eval"):
        counts = collections.Counter(_cwe_entries(s))
        assert len(s["outputs"]) == 10 and len(counts) == s["haystack_units"]
        assert all(counts[w] == common_repeats for w in s["outputs"])
        assert all(c == uncommon_repeats for w, c in counts.items() if w not in s["outputs"])
        assert s["prompt"] == s["input"] + "\n\nAnswer: The top 10 words that appear most often in the list are:"
        assert s["input"].endswith("\nQuestion: What are the 10 most common words in the above list?")
        assert "input_example" in s and s["input_example"] not in s["prompt"]


def test_cwe_nvidia_puts_the_example_first(samples):
    for s in samples("ruler_cwe", 4096, "nvidia"):
        assert s["input"].startswith(s["input_example"] + "\nBelow is a numbered list of words.")
        assert s["input_example"].count("Below is a numbered list of words.") == 1
        # NVIDIA: template.format(...) + ' ' + answers (common_words_extraction.generate_input_output)
        assert re.search(r"list are: 1\. \w+ 2\. ", s["input_example"])
        assert s["prompt"] == s["input"] + " Answer: The top 10 words that appear most often in the list are:"
        body = s["input"][len(s["input_example"]) + 1 :]
        counts = collections.Counter(_cwe_entries({"input": body}))
        assert all(counts[w] == 30 for w in s["outputs"]) and len(counts) == s["haystack_units"]


@pytest.mark.parametrize("length", (1024, 4096))
def test_fwe_counts(samples, length):
    for s in samples("ruler_fwe", length):
        head = (
            "Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words. "
        )
        assert s["input"].startswith(head)
        context, question = s["input"][len(head) :].split("\nQuestion: ")
        assert question == ("Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                            "frequently appeared words in the above coded text?")  # fmt: skip
        ranked = collections.Counter(context.split(" ")).most_common()
        assert ranked[0][0] == "..."
        assert [w for w, _ in ranked[1:4]] == s["outputs"] and ranked[3][1] > ranked[4][1]
        counts = generators.fwe_counts(s["haystack_units"], length // 50)
        assert [c for _, c in ranked[:4]] == counts[:4]
        assert s["gen_prefix"] == (
            "Answer: According to the coded text above, the three most frequently appeared words are:"
        )


def _clear_caches():
    sampling.fitted_size.cache_clear()
    sampling._vt_example.cache_clear()


def test_samples_are_deterministic_and_order_independent(tok):
    jobs = [("niah_single_2", 2048, 0), ("ruler_vt", 2048, 1), ("ruler_cwe", 2048, 0), ("niah_multikey_3", 2048, 2)]
    _clear_caches()
    first = [generate_sample(t, tok, n, i, SEED) for t, n, i in jobs]
    _clear_caches()
    generate_sample("ruler_fwe", tok, 2048, 0, SEED)
    second = [generate_sample(t, tok, n, i, SEED) for t, n, i in reversed(jobs)][::-1]
    assert first == second
    assert generate_sample("niah_single_2", tok, 2048, 1, SEED) != first[0]
    assert generate_sample("niah_single_2", tok, 2048, 0, SEED + 1)["outputs"] != first[0]["outputs"]
    assert sample_seed(42, "niah_single_1", 4096, 0) == 0xAFB37F60245BB03


def test_custom_short_haystack_is_repeated(tok):
    s = generate_sample("niah_single_2", tok, 4096, 0, SEED, haystack_text="Short text. Only two sentences here.")
    assert s["prompt_tokens"] + 128 >= 0.95 * 4096
    assert s["input"].count("Short text.") > 50


def test_length_too_small_is_actionable(tok):
    with pytest.raises(ValueError, match=r"too small for RULER task 'ruler_vt'.*use a length >= \d+"):
        generate_sample("ruler_vt", tok, 300, 0, SEED)
    with pytest.raises(ValueError, match="length_tokens must be a positive int"):
        generate_sample("ruler_vt", tok, 0, 0, SEED)


def test_missing_haystack_file_names_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="nope.txt"):
        haystack.read_haystack_text(missing)


def test_public_api_reexports():
    assert ruler.generate_sample is generate_sample and callable(ruler.score_prediction)


def test_niah_sizes_to_256k_within_two_percent(tok):
    """Generation is linear in the haystack: a 256K sample sizes in seconds (probe search + one sample)."""
    length = 262144
    for index in range(2):
        s = generate_sample("niah_single_1", tok, length, index, SEED)
        total = s["prompt_tokens"] + 128
        assert 0.98 * length <= total <= length and s["prompt_tokens"] == len(tok(s["prompt"]).input_ids)
        assert s["input"].count(f"One of the special magic numbers for {_niah_keys(s)[0]} is: {s['outputs'][0]}.") == 1


def test_capped_haystack_warns_once(tok, caplog):
    """CWE's word pool (8166 words, ruler.md section 8 row 4) cannot fill 256K: the prompt is short and logged."""
    sampling.fitted_size.cache_clear()
    with caplog.at_level("WARNING"):
        s = generate_sample("ruler_cwe", tok, 262144, 0, SEED)
        generate_sample("ruler_cwe", tok, 262144, 1, SEED)
    assert s["haystack_units"] == 8166 and s["prompt_tokens"] < 0.9 * 262144
    assert caplog.text.count("RULER ruler_cwe (nvidia) at 262144 tokens: prompts reach only") == 1
    assert "capped at 8166 units" in caplog.text
