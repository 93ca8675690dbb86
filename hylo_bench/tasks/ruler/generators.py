"""RULER sample builders (NIAH, variable tracking, CWE, FWE, QA): one haystack size -> input, golds, gen_prefix.

Each builder is a pure function of ``(task, rng, num_units, context)``; the caller owns sizing and seeding
(:mod:`hylo_bench.tasks.ruler.sampling`). Prompt strings are byte-exact copies of lm-evaluation-harness 0.4.13
``lm_eval/tasks/ruler/{niah_utils,prepare_niah,vt_utils,cwe_utils,fwe_utils,qa_utils}.py`` (ruler.md section 3)
and, for ``flavor="nvidia"``, of NVIDIA/RULER ``scripts/data/synthetic/*.py`` where the two differ (VT and CWE;
docs/ruler.md lists every difference), with the global ``random``/numpy draws replaced by the per-sample ``rng``
(ruler.md section 5.3, hylo-bench policy).
"""

from __future__ import annotations

import dataclasses
import math
import random
import string

from hylo_bench.tasks.ruler.qa import QA_GEN_PREFIX, QAData, qa_text, select_docs
from hylo_bench.tasks.ruler.registry import RulerTask
from hylo_bench.text.haystack import (
    DEPTHS,
    NEEDLE,
    NOISE_LINE,
    cwe_words,
    essay_prefix,
    random_needle,
    split_sentences,
)

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are: "
)
VT_ANSWER_PREFIX_NVIDIA = VT_ANSWER_PREFIX.replace("assgined", "assigned")
"""NVIDIA/RULER fixed lm-eval's "assgined" typo in May 2025 (ruler.md section 3.2)."""
VT_EXAMPLE_VALUE = "12345"
"""NVIDIA/RULER builds the VT example with this value and replaces it per sample."""
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

VT_EXAMPLE_BUDGET_TOKENS = 500
"""Token budget of the VT one-shot example (lm-eval ``vt_utils.get_dataset``)."""
CWE_NUM_COMMON = 10
FWE_ALPHA = 2.0
FWE_ZETA = math.pi**2 / 6  # scipy.special.zeta(2.0), bit-identical
FWE_CODED_WORD_LEN = 6
FWE_TOKENS_TO_GENERATE = 50
"""NVIDIA/RULER's FWE ``tokens_to_generate`` (= the task's ``max_gen_toks``), subtracted before the vocabulary size."""


@dataclasses.dataclass(frozen=True, slots=True)
class BuildContext:
    """What a builder needs besides the rng and the size.

    Attributes:
        length_tokens: target length L (CWE repeat counts and FWE vocabulary size depend on it).
        flavor: ``nvidia`` | ``lm-eval`` (registry.FLAVORS).
        essay: essay words (NIAH essay haystack), empty otherwise.
        vt_example: the VT one-shot example text (input, answer prefix, names, then ``"\\n\\n"`` for lm-eval,
            ``"\\n"`` for nvidia), empty otherwise.
        qa: parsed QA data (QA tasks), ``None`` otherwise.
        question_index: QA question of this sample (sample i asks question i).
        qa_extra: extra distractor document ids appended by the sizing's gap fill.
    """

    length_tokens: int
    flavor: str = "nvidia"
    essay: tuple[str, ...] = ()
    vt_example: str = ""
    qa: QAData | None = None
    question_index: int = 0
    qa_extra: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Built:
    """A built sample before prompt assembly: lm-eval ``input``, gold ``outputs``, ``gen_prefix``, extras."""

    input: str
    outputs: list[str]
    gen_prefix: str
    extra: dict


def build(task: RulerTask, rng: random.Random, num_units: int, ctx: BuildContext) -> Built:
    """Build one sample of ``task`` with a haystack of ``num_units`` units.

    Units: NIAH repeat/needle = haystack lines, NIAH essay = words, VT = noise lines, CWE = distinct words,
    FWE = the Zipf word budget ``num_words``, QA = documents.

    Raises:
        ValueError: the generator is not implemented.
    """
    if task.generator == "niah":
        return build_niah(task, rng, num_units, ctx)
    if task.generator == "qa":
        return build_qa(rng, num_units, ctx)
    if task.generator == "vt":
        return build_vt(rng, num_units, ctx)
    if task.generator == "cwe":
        return build_cwe(rng, num_units, ctx)
    if task.generator == "fwe":
        return build_fwe(rng, num_units, ctx)
    raise ValueError(f"task {task.name}: generator {task.generator!r} is not implemented yet")


def build_niah(task: RulerTask, rng: random.Random, num_units: int, ctx: BuildContext) -> Built:
    """NIAH sample (lm-eval ``prepare_niah.generate_input_output``; ruler.md section 3.1)."""
    type_k, type_v = task.key_type, task.value_type
    num_k, num_v, num_q = task.num_needle_keys, task.num_values, task.num_queries
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(random_needle(type_k, rng))
        value = []
        for _ in range(num_v):
            value.append(random_needle(type_v, rng))
            needles.append(NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=value[-1]))
        values.append(value)
    random.Random(42).shuffle(needles)

    if task.haystack == "essay":
        sents = split_sentences(essay_prefix(ctx.essay, num_units).strip())
        depths = sorted(int(len(sents) * (d / 100)) for d in rng.sample(DEPTHS, len(needles)))
        cuts = [0, *depths, len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if task.haystack == "repeat":
            lines = [NOISE_LINE] * num_units
        else:
            lines = [
                NEEDLE.format(type_needle_v=type_v, key=random_needle(type_k, rng), value=random_needle(type_v, rng))
                for _ in range(num_units)
            ]
        for index, needle in zip(sorted(rng.sample(range(num_units), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        context = "\n".join(lines)

    indices = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in indices]
    answers = [a for i in indices for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, shown_v = NIAH_TEMPLATE, type_v
    if num_q * num_v == 1:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        template = template.replace("answers", "answer")
        shown_v = type_v[:-1]
        gen_prefix = f"The special magic {shown_v} for {query} mentioned in the provided text is"
    else:
        gen_prefix = f"The special magic {type_v} for {query} mentioned in the provided text are"
    text = template.format(type_needle_v=shown_v, context=context, query=query)
    return Built(input=text, outputs=answers, gen_prefix=gen_prefix, extra={})


def _vt_chain(rng: random.Random, num_hops: int, is_icl: bool, flavor: str) -> tuple[list[str], list[str]]:
    """One variable chain: names (5 letters; 3 for the example) and its ``VAR X = ...`` lines.

    Names are drawn until ``num_hops + 1`` distinct ones exist and the first distinct ones are used; lm-eval
    draws the same way but keeps a repeated name in the chain and plants the surplus names as an extra chain
    (a 1-in-a-million event for 5-letter names), which is not reproduced. The nvidia example's value is
    ``12345`` (re-drawn per sample); otherwise a random 5-digit value.
    """
    k = 3 if is_icl else 5
    num_hops = min(10, num_hops) if is_icl else num_hops
    names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range(num_hops + 1)]
    while len(set(names)) < num_hops + 1:
        names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
    names = list(dict.fromkeys(names))[: num_hops + 1]
    value = VT_EXAMPLE_VALUE if is_icl and flavor == "nvidia" else str(rng.randint(10000, 99998))
    chain = [f"VAR {names[0]} = {value}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, chain


def vt_text(rng: random.Random, num_noises: int, num_hops: int, is_icl: bool,
            flavor: str = "nvidia") -> tuple[str, list[str]]:
    """VT template + answer prefix with one chain among ``num_noises`` noise lines.

    lm-eval (``vt_utils``): noise lines end in ``\\n`` and are joined by spaces; nvidia (``variable_tracking.py``):
    joined by ``\\n``, answer prefix spelled "assigned".
    """
    names, chain = _vt_chain(rng, num_hops, is_icl, flavor)
    if flavor == "nvidia":
        assert num_noises >= len(chain), f"nvidia VT needs >= {len(chain)} noise lines, got {num_noises}"
        sentences = [NOISE_LINE] * num_noises
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for j, pos in enumerate(positions):
            sentences.insert(pos + j, chain[j])
        context = "\n".join(sentences).replace(". \n", ".\n")
        prefix = VT_ANSWER_PREFIX_NVIDIA
    else:
        sentences = [NOISE_LINE + "\n"] * num_noises
        if len(sentences) <= len(chain):
            pieces = [x for noise in sentences for x in noise.split(".")]
            sentences = [p + "." if len(p.strip()) > 0 else p for p in pieces]
            if len(sentences) <= len(chain):
                chain = chain[: len(sentences) - 1]
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for j, pos in enumerate(positions):
            sentences.insert(pos + j, chain[j])
        context = " ".join(sentences).replace(". \n", ".\n")
        prefix = VT_ANSWER_PREFIX
    value = chain[0].split("=")[-1].strip()
    return (VT_TEMPLATE + prefix).format(context=context, query=value, num_v=num_hops + 1), names


def randomize_vt_example(example: str, rng: random.Random, flavor: str = "nvidia") -> str:
    """Re-draw the example's variable names (lm-eval ``vt_utils.randomize_icl``; its value is kept); nvidia also
    replaces the example value ``12345`` by a random 5-digit value (``variable_tracking.randomize_icl``)."""
    if flavor == "nvidia":
        names = example.strip().split()[-5:]
    else:
        cut = example.index(VT_ANSWER_PREFIX[-10:])
        names = example[cut + 10 :].strip().split()
    for item in names:
        example = example.replace(item, "".join(rng.choices(string.ascii_uppercase, k=len(item))))
    if flavor == "nvidia":
        example = example.replace(VT_EXAMPLE_VALUE, str(rng.randint(10000, 99998)))
    return example


def build_vt(rng: random.Random, num_units: int, ctx: BuildContext, num_hops: int = 4) -> Built:
    """Variable-tracking sample: example, then 4 newlines (lm-eval) or 2 (nvidia), then the prompt (ruler.md
    section 3.2). The nvidia ``gen_prefix`` keeps the original answer prefix's trailing space."""
    text, names = vt_text(rng, num_units, num_hops, is_icl=False, flavor=ctx.flavor)
    joiner = "\n" if ctx.flavor == "nvidia" else "\n\n"
    text = randomize_vt_example(ctx.vt_example, rng, ctx.flavor) + joiner + text
    cut = text.rfind(" Answer: According to the chain(s) of variable assignment")
    prefix = text[cut:].lstrip() if ctx.flavor == "nvidia" else text[cut:].strip()
    return Built(input=text[:cut], outputs=names, gen_prefix=prefix, extra={})


def _cwe_list(rng: random.Random, num_words: int, common_repeats: int, uncommon_repeats: int,
              flavor: str = "nvidia") -> tuple[str, list]:
    """A numbered CWE word list and its 10 common words. The words come from ``rng``; the list order from a fresh
    ``Random(42)`` for nvidia (``common_words_extraction.get_example``: the common words sit at the same positions
    in every list of one length) and from ``rng`` for lm-eval (whose module-level ``RNG`` carries state across
    calls; docs/ruler.md row 17)."""
    full = rng.sample(cwe_words(), num_words)
    common, uncommon = full[:CWE_NUM_COMMON], full[CWE_NUM_COMMON:]
    word_list = common * common_repeats + uncommon * uncommon_repeats
    (random.Random(42) if flavor == "nvidia" else rng).shuffle(word_list)
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(word_list)), common


def cwe_repeats(length_tokens: int) -> tuple[int, int]:
    """(common, uncommon) repeat counts: (30, 3) at L >= 4096, else (6, 1) (lm-eval ``cwe_utils``)."""
    return (6, 1) if length_tokens < 4096 else (30, 3)


def build_cwe(rng: random.Random, num_units: int, ctx: BuildContext) -> Built:
    """Common-words sample (ruler.md section 3.3). lm-eval keeps ``input_example`` as a field, not in the prompt;
    nvidia puts it first: ``input = input_example + "\\n" + list prompt``. The example's answer follows the
    answer prefix after one space in nvidia (``template.format(...) + ' ' + answers``), directly in lm-eval
    (``cwe_utils.generate_input_output``)."""
    if ctx.length_tokens < 4096:
        example, example_answer = _cwe_list(rng, 20, 3, 1, ctx.flavor)
    else:
        example, example_answer = _cwe_list(rng, 40, 10, 3, ctx.flavor)
    context, answer = _cwe_list(rng, num_units, *cwe_repeats(ctx.length_tokens), ctx.flavor)
    answer_sep = " " if ctx.flavor == "nvidia" else ""
    input_example = (CWE_TEMPLATE + CWE_ANSWER_PREFIX).format(context=example) + answer_sep + " ".join(
        f"{i + 1}. {word}" for i, word in enumerate(example_answer)
    )
    text = (CWE_TEMPLATE + CWE_ANSWER_PREFIX).format(context=context)
    text = text[: text.rfind(CWE_ANSWER_PREFIX)].strip()
    extra = {"input_example": input_example}
    if ctx.flavor == "nvidia":
        text = input_example + "\n" + text
    return Built(input=text, outputs=answer, gen_prefix=CWE_ANSWER_PREFIX.strip(), extra=extra)


def fwe_counts(num_words: int, vocab_size: int) -> list[int]:
    """Zipf counts ``int(num_words * k**-2 / zeta(2))`` for ranks k = 1 ... vocab_size (lm-eval ``fwe_utils``)."""
    return [int(num_words * (k**-FWE_ALPHA) / FWE_ZETA) for k in range(1, vocab_size + 1)]


def fwe_vocab_size(length_tokens: int, flavor: str = "nvidia") -> int:
    """FWE vocabulary size: ``(L - 50) // 50`` for nvidia (``freq_words_extraction.sys_kwext`` subtracts the 50
    tokens to generate first), ``L // 50`` for lm-eval (``fwe_utils.sys_kwext``). 80 / 81 at 4096."""
    return (length_tokens - FWE_TOKENS_TO_GENERATE) // 50 if flavor == "nvidia" else length_tokens // 50


def build_fwe(rng: random.Random, num_units: int, ctx: BuildContext) -> Built:
    """Frequent-words sample: vocabulary of :func:`fwe_vocab_size` coded words, rank 1 = ``...`` (ruler.md
    section 3.4)."""
    vocab_size = fwe_vocab_size(ctx.length_tokens, ctx.flavor)
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=FWE_CODED_WORD_LEN)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=FWE_CODED_WORD_LEN)))
    vocab = sorted(set(vocab))
    random.Random(42).shuffle(vocab)
    vocab[0] = "..."
    words = [w for w, count in zip(vocab, fwe_counts(num_units, len(vocab))) for _ in range(count)]
    random.Random(42).shuffle(words)
    text = (FWE_TEMPLATE + FWE_ANSWER_PREFIX).format(context=" ".join(words))
    text = text[: text.rfind(FWE_ANSWER_PREFIX)].strip()
    return Built(input=text, outputs=vocab[1:4], gen_prefix=FWE_ANSWER_PREFIX.strip(), extra={})


def build_qa(rng: random.Random, num_units: int, ctx: BuildContext) -> Built:
    """QA sample: question ``ctx.question_index`` with ``num_units`` documents (+ ``ctx.qa_extra``), ruler.md
    section 3.5. ``outputs`` = the gold answers (SQuAD: every annotator answer, duplicates kept)."""
    assert ctx.qa is not None, "QA tasks need BuildContext.qa"
    item = ctx.qa.questions[ctx.question_index]
    doc_ids = select_docs(ctx.qa, item, num_units, rng, ctx.flavor, ctx.qa_extra)
    extra = {"question_index": ctx.question_index, "num_docs": len(doc_ids), "query": item.query}
    return Built(input=qa_text(ctx.qa, item, doc_ids), outputs=list(item.outputs), gen_prefix=QA_GEN_PREFIX,
                 extra=extra)
