"""RULER sample generation: per-sample seeding, prompt assembly and haystack sizing to a token budget.

Sizing rule (hylo-bench): ``tokens + max_gen_toks <= length_tokens``, with ``tokens`` counted by the model's own
tokenizer on the exact prompt fed to the model (:func:`sizing_tokens`: for the nvidia flavor without the BOS the
tokenizer adds, as NVIDIA/RULER counts), and the haystack as large as that allows.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import random
from pathlib import Path
from typing import Any, Callable, Sequence

from hylo_bench.tasks.ruler.generators import VT_EXAMPLE_BUDGET_TOKENS, BuildContext, Built, build, vt_text
from hylo_bench.tasks.ruler.qa import DOCUMENT_TEMPLATE, QAData, fill_candidates, load_qa
from hylo_bench.tasks.ruler.registry import RulerTask, check_flavor, get_task
from hylo_bench.text.haystack import cwe_words, default_haystack_text, essay_words

logger = logging.getLogger(__name__)

SHORT_WARNING_FRACTION = 0.98
""":func:`fitted_size` warns when the probe's ``prompt_tokens + max_gen_toks`` stays below this fraction of L."""
SAMPLE_TOLERANCE = 0.005
"""A sample stops searching once its slack below the budget is at most this fraction of ``length_tokens``."""
PROBE_TOLERANCE = 0.001
"""The probe search (:func:`fitted_size`) stops at this slack fraction; each probe step tokenizes a whole prompt."""
QA_FILL_CANDIDATES = 64
"""QA gap fill: how many next-priority documents are tried when a whole-document count leaves slack."""


class PromptTooLongError(ValueError):
    """The smallest haystack of a task does not fit the token budget."""


def sample_seed(seed: int, task: str, length_tokens: int, index: int) -> int:
    """Stable 64-bit seed of one sample: sha256 of ``(seed, task, length, index)``; independent of run order."""
    digest = hashlib.sha256(f"hylo-bench/ruler|{seed}|{task}|{length_tokens}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def render_prompt(task: RulerTask, input_text: str, gen_prefix: str, tokenizer: Any, chat_template: bool,
                  flavor: str = "nvidia") -> str:
    """Final prompt text: ``input + target_delimiter + gen_prefix`` (ruler.md section 4).

    ``flavor="nvidia"`` always joins with one space (the original appends its answer prefix, which starts with a
    space); lm-eval uses the task's ``target_delimiter`` (``"\\n\\n"`` for CWE). With ``chat_template``,
    ``input`` is the user turn (``apply_chat_template(..., add_generation_prompt=True)``) and ``gen_prefix`` is
    appended to the open assistant turn, which the model continues: after the answer prefix's leading space for
    nvidia (``prepare.py``: ``model_template.format(task_template=...) + answer_prefix``), directly for lm-eval.
    """
    if chat_template:
        messages = [{"role": "user", "content": input_text}]
        head = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return head + (" " if flavor == "nvidia" and not gen_prefix[:1].isspace() else "") + gen_prefix
    delimiter = " " if flavor == "nvidia" else task.target_delimiter
    if input_text[-1:].isspace() or gen_prefix[:1].isspace():
        delimiter = ""
    return input_text + delimiter + gen_prefix


def encode_prompt(tokenizer: Any, prompt: str, chat_template: bool) -> list[int]:
    """Token ids of a rendered prompt: the HF default call (special tokens added) unless the chat template
    already rendered them."""
    # verbose=False: sizing probes may run past the tokenizer's model_max_length; they are measured, never fed
    # to the model (check_lengths bounds what is), so transformers' "indexing errors" warning would be false
    return list(tokenizer(prompt, add_special_tokens=not chat_template, verbose=False).input_ids)


def encode_prompts(tokenizer: Any, prompts: Sequence[str], chat_template: bool) -> list[list[int]]:
    """:func:`encode_prompt` of each prompt, in one call of the tokenizer: a fast tokenizer encodes a batch on all
    CPU cores (its Rust thread pool, without the GIL), one prompt at a time on one. No padding or truncation, so
    the ids are each prompt's own."""
    if not prompts:
        return []
    return [list(ids) for ids in tokenizer(list(prompts), add_special_tokens=not chat_template,
                                           verbose=False).input_ids]


def sizing_tokens(tokenizer: Any, prompt: str, chat_template: bool, flavor: str) -> int:
    """Tokens a prompt counts for the haystack sizing.

    nvidia: ``len(tokenizer.tokenize(text))`` as NVIDIA/RULER's ``HFTokenizer.text_to_tokens`` counts, i.e. without
    the special tokens the tokenizer adds (BOS); a chat-rendered prompt's own special tokens are text and count.
    lm-eval: ``len(tokenizer(text).input_ids)`` (BOS counted), as its generators do; this is also what is fed to
    the model (:func:`encode_prompt`).
    """
    if flavor == "nvidia":
        return len(tokenizer(prompt, add_special_tokens=False, verbose=False).input_ids)
    return len(encode_prompt(tokenizer, prompt, chat_template))


def largest_fitting(
    measure: Callable[[int], int],
    *,
    budget: int,
    n_min: int,
    n_max: int,
    n_start: int,
    tol_tokens: int = 0,
) -> int:
    """Largest ``n`` in ``[n_min, n_max]`` with ``measure(n) <= budget`` (``measure`` roughly non-decreasing).

    Safeguarded interpolation search: probes ``n_start`` first, extrapolates linearly until a probe overshoots,
    then interpolates inside the bracket, aiming ``tol_tokens / 2`` below the budget; a step that fails to halve
    the bracket is followed by a bisection, so the bracket at least halves every two steps. Stops early at a
    fitting ``n`` whose slack ``budget - measure(n)`` is ``<= tol_tokens``. ``measure`` is called at most once per
    ``n``: about 4-8 times for a cold search, once or twice from a good ``n_start``.

    Raises:
        PromptTooLongError: ``measure(n_min) > budget``.
    """
    lo, f_lo = n_min, measure(n_min)
    if f_lo > budget:
        raise PromptTooLongError(f"{f_lo} tokens at the smallest haystack > budget {budget}")
    hi, f_hi = None, None  # smallest n known to overshoot
    anchor, f_anchor = n_min, f_lo  # a second fitting point for the slope while no overshoot is known
    target = budget - tol_tokens // 2
    probe, bisect_next, width = min(max(n_start, n_min), n_max), False, None
    while True:
        if probe > lo:
            f = measure(probe)
            if f <= budget:
                anchor, f_anchor = lo, f_lo
                lo, f_lo = probe, f
            else:
                hi, f_hi = probe, f
        if lo >= n_max or (hi is not None and hi - lo <= 1) or budget - f_lo <= tol_tokens:
            return lo
        if hi is not None:
            bisect_next = not bisect_next and width is not None and 2 * (hi - lo) > width
            width = hi - lo
        if hi is None:
            slope = (f_lo - f_anchor) / (lo - anchor) if lo > anchor else 0.0
            probe = lo + (math.ceil((target - f_lo) / slope) if slope > 0 else max(1, lo - n_min))
            probe = min(max(probe, lo + 1), n_max)
        elif bisect_next or f_hi <= f_lo:
            probe = (lo + hi) // 2
        else:
            probe = lo + int((max(target, f_lo + 1) - f_lo) * (hi - lo) / (f_hi - f_lo))
            probe = min(max(probe, lo + 1), hi - 1)


def _size_bounds(task: RulerTask, length_tokens: int, ctx: BuildContext) -> tuple[int, int]:
    """Haystack units allowed: NIAH lines >= #needles; CWE 10 ... 8166 words (lm-eval's pool, ruler.md section 8
    row 4); QA >= the question's own paragraphs; nvidia VT >= 5 noise lines; lm-eval caps the essay and the QA
    corpus at their ends (ruler.md section 8 row 7); others >= 1. The upper bound 8 x length only guards against
    tokenizers that under-count."""
    cap = 8 * length_tokens
    if task.generator == "niah" and task.haystack != "essay":
        return task.num_needle_keys * task.num_values, cap
    if task.generator == "niah" and ctx.flavor == "lm-eval":
        return 1, min(cap, len(ctx.essay))
    if task.generator == "cwe":
        return 10, len(cwe_words())
    if task.generator == "vt" and ctx.flavor == "nvidia":
        return 5, cap
    if task.generator == "qa":
        assert ctx.qa is not None
        own = len(ctx.qa.questions[ctx.question_index].context)
        return own, max(own, len(ctx.qa.docs)) if ctx.flavor == "lm-eval" else max(own, cap)
    return 1, cap


@functools.lru_cache(maxsize=64)
def _vt_example(tokenizer: Any, length_tokens: int, seed: int, flavor: str = "nvidia") -> str:
    """The VT one-shot example for one target length: input + answer prefix + " " + 5 names + newline(s).

    lm-eval: sized as ``vt_utils.sys_vartrack_w_noise_random(max_seq_length=500, incremental=5)`` (grow by 5
    noise lines while ``tokens(text + " " + str(names)) + 30 < 500``, step back once, then shrink until
    ``tokens(text) + 30 <= 500``), ends ``"\\n\\n"``. nvidia: the largest noise count >= 5 with
    ``tokens(text) <= 500`` without BOS (the original's binary search with nothing reserved for generation),
    value ``12345``, ends ``"\\n"``.
    """
    example_seed = sample_seed(seed, "ruler_vt/example", length_tokens, 0)

    def make(num_noises: int) -> tuple[str, list[str]]:
        return vt_text(random.Random(example_seed), num_noises, num_hops=4, is_icl=True, flavor=flavor)

    def count(text: str) -> int:  # NVIDIA counts text_to_tokens (no BOS), lm-eval tokenizer(text) (BOS counted)
        return len(tokenizer(text, add_special_tokens=flavor != "nvidia", verbose=False).input_ids)

    if flavor == "nvidia":
        n = largest_fitting(lambda k: count(make(k)[0]), budget=VT_EXAMPLE_BUDGET_TOKENS, n_min=5,
                            n_max=VT_EXAMPLE_BUDGET_TOKENS, n_start=20)
        text, names = make(n)
        return text + " " + " ".join(names) + "\n"
    num_noises, total = 5, 0
    while total + 30 < VT_EXAMPLE_BUDGET_TOKENS:
        text, names = make(num_noises)
        total = count(text + f" {names}")
        if total + 30 > VT_EXAMPLE_BUDGET_TOKENS:
            num_noises -= 5
            break
        num_noises += 5
    num_noises = max(num_noises, 5)
    text, names = make(num_noises)
    while count(text) + 30 > VT_EXAMPLE_BUDGET_TOKENS and num_noises > 5:
        num_noises -= 5
        text, names = make(num_noises)
    return text + " " + " ".join(names) + "\n\n"


def _context(task: RulerTask, tokenizer: Any, length_tokens: int, seed: int, haystack_text: str, flavor: str,
             qa: QAData | None) -> BuildContext:
    if task.generator == "niah" and task.haystack == "essay":
        return BuildContext(length_tokens=length_tokens, flavor=flavor, essay=essay_words(haystack_text))
    if task.generator == "vt":
        example = _vt_example(tokenizer, length_tokens, seed, flavor)
        return BuildContext(length_tokens=length_tokens, flavor=flavor, vt_example=example)
    if task.generator == "qa":
        return BuildContext(length_tokens=length_tokens, flavor=flavor, qa=qa)
    return BuildContext(length_tokens=length_tokens, flavor=flavor)


def _fit(
    task: RulerTask,
    tokenizer: Any,
    length_tokens: int,
    seed_int: int,
    ctx: BuildContext,
    chat_template: bool,
    n_start: int,
    tol_tokens: int,
) -> tuple[int, Built, str, int, float]:
    """Search the haystack size for one rng seed (then, for QA, fill the gap left by whole documents).

    Returns:
        (units, built, prompt, prompt_tokens, tokens per unit between ``n_min`` and ``units``).
    """
    memo: dict[int, tuple[Built, str, int]] = {}

    def make(n: int, c: BuildContext) -> tuple[Built, str, int]:
        built = build(task, random.Random(seed_int), n, c)
        prompt = render_prompt(task, built.input, built.gen_prefix, tokenizer, chat_template, c.flavor)
        return built, prompt, sizing_tokens(tokenizer, prompt, chat_template, c.flavor)

    def measure(n: int) -> int:
        if n not in memo:
            memo[n] = make(n, ctx)
        return memo[n][2]

    n_min, n_max = _size_bounds(task, length_tokens, ctx)
    budget = length_tokens - task.max_gen_toks
    try:
        n = largest_fitting(measure, budget=budget, n_min=n_min, n_max=n_max, n_start=n_start, tol_tokens=tol_tokens)
    except PromptTooLongError as err:  # the caller adds the smallest length that fits (minimum_length)
        raise PromptTooLongError(
            f"length_tokens={length_tokens} is too small for RULER task {task.name!r}: its smallest prompt is "
            f"{memo[n_min][2]} tokens + max_gen_toks={task.max_gen_toks}"
        ) from err
    slope = (memo[n][2] - memo[n_min][2]) / (n - n_min) if n > n_min else 1.0
    best = memo[n]
    if task.generator == "qa" and budget - best[2] > tol_tokens:
        best = _qa_fill(tokenizer, ctx, seed_int, n, budget, best, make)
    return (n, *best, max(slope, 1e-3))


def _qa_fill(tokenizer: Any, ctx: BuildContext, seed_int: int, n: int, budget: int,
             best: tuple[Built, str, int], make: Callable) -> tuple[Built, str, int]:
    """Whole documents leave up to one document of slack (~150 tokens for SQuAD, > 2% of 4K). Scan the next
    :data:`QA_FILL_CANDIDATES` documents of the priority order and add each whose own token count still fits the
    remaining slack (first fit), then verify on the real prompt, dropping the last addition while over budget."""
    assert ctx.qa is not None
    item = ctx.qa.questions[ctx.question_index]
    cands = fill_candidates(ctx.qa, item, n, random.Random(seed_int), QA_FILL_CANDIDATES)
    overhead = len(tokenizer("\n\n" + DOCUMENT_TEMPLATE.format(i=100, document=""), add_special_tokens=False,
                             verbose=False).input_ids)
    left, extra = budget - best[2], []
    for c in cands:
        cost = len(tokenizer(ctx.qa.docs[c], add_special_tokens=False, verbose=False).input_ids) + overhead
        if cost <= left:
            extra.append(c)
            left -= cost
    while extra:
        got = make(n, dataclasses.replace(ctx, qa_extra=tuple(extra)))
        if got[2] <= budget:
            return got if got[2] > best[2] else best
        extra.pop()
    return best


MINIMUM_LENGTH_SCAN = 1 << 16
""":func:`minimum_length` gives up after scanning this many lengths above the one that failed."""


def _smallest_fits(spec: RulerTask, tokenizer: Any, length_tokens: int, seed: int, text: str, chat_template: bool,
                   flavor: str, qa: QAData | None, num_samples: int) -> bool:
    """Whether the probe and samples ``0 .. num_samples - 1`` fit ``length_tokens`` at their smallest haystack."""
    try:
        ctx = _context(spec, tokenizer, length_tokens, seed, text, flavor, qa)
    except PromptTooLongError:
        return False
    budget = length_tokens - spec.max_gen_toks
    runs = [(sample_seed(seed, f"{spec.name}/probe", length_tokens, 0), ctx)]
    for i in range(num_samples):
        runs.append((sample_seed(seed, spec.name, length_tokens, i),
                     dataclasses.replace(ctx, question_index=i) if qa is not None else ctx))
    for seed_int, c in runs:
        n_min = _size_bounds(spec, length_tokens, c)[0]
        built = build(spec, random.Random(seed_int), n_min, c)
        prompt = render_prompt(spec, built.input, built.gen_prefix, tokenizer, chat_template, flavor)
        if sizing_tokens(tokenizer, prompt, chat_template, flavor) > budget:
            return False
    return True


def minimum_length(task: str, tokenizer: Any, above: int, seed: int = 42, haystack_text: str | None = None, *,
                   chat_template: bool = False, flavor: str = "nvidia", qa_path: str | Path | None = None,
                   num_samples: int = 1) -> int:
    """The smallest length ``L > above`` at which a run of ``num_samples`` samples of ``task`` can be generated.

    A length is possible when the smallest prompt (the task's minimum haystack) of the probe sample and of every
    sample ``0 .. num_samples - 1`` fits ``L - max_gen_toks``. The words, names and numbers of a sample are drawn
    from seeds that include L, so the smallest prompt differs from length to length (CWE's 10 + 40 random words
    by tens of tokens): lengths are tried one by one, which is why "the smallest prompt + max_gen_toks" at one
    length is not a length that works.

    Raises:
        ValueError: no length up to ``above + MINIMUM_LENGTH_SCAN`` fits.
    """
    spec = get_task(task)
    text = default_haystack_text() if haystack_text is None else haystack_text
    qa = load_qa(task, qa_path) if spec.generator == "qa" else None
    for length in range(above + 1, above + 1 + MINIMUM_LENGTH_SCAN):
        if _smallest_fits(spec, tokenizer, length, seed, text, chat_template, flavor, qa, num_samples):
            return length
    raise ValueError(f"RULER task {task!r}: no length up to {above + MINIMUM_LENGTH_SCAN} holds its smallest prompt")


@functools.lru_cache(maxsize=256)
def fitted_size(
    task: str, tokenizer: Any, length_tokens: int, seed: int, haystack_text: str, chat_template: bool,
    flavor: str = "nvidia", qa: QAData | None = None,
) -> tuple[int, float]:
    """Haystack size for (task, tokenizer, length, flavor): the largest fit of a probe sample, to within 0.1% of the
    length (cached; QA probes question 0). Warns when even that stays 2% short (a capped haystack).

    Returns:
        (units, prompt tokens per unit) of the probe sample.

    Raises:
        PromptTooLongError: the length cannot hold the task's smallest prompt.
    """
    spec = get_task(task)
    ctx = _context(spec, tokenizer, length_tokens, seed, haystack_text, flavor, qa)
    probe_seed = sample_seed(seed, f"{task}/probe", length_tokens, 0)
    n_min, n_max = _size_bounds(spec, length_tokens, ctx)
    tol = int(PROBE_TOLERANCE * length_tokens)
    n, _, _, num_tokens, slope = _fit(spec, tokenizer, length_tokens, probe_seed, ctx, chat_template, n_min + 64, tol)
    total = num_tokens + spec.max_gen_toks
    if total < SHORT_WARNING_FRACTION * length_tokens:
        why = f"its haystack is capped at {n_max} units" if n >= n_max else "the next haystack unit overshoots"
        logger.warning("RULER %s (%s) at %d tokens: prompts reach only %d tokens (%.1f%%): %s", task, flavor,
                       length_tokens, total, 100 * total / length_tokens, why)
    return n, slope


def generate_sample(
    task: str,
    tokenizer: Any,
    length_tokens: int,
    index: int,
    seed: int = 42,
    haystack_text: str | None = None,
    *,
    chat_template: bool = False,
    flavor: str = "nvidia",
    qa_path: str | Path | None = None,
    num_samples: int | None = None,
) -> dict:
    """Generate RULER sample ``index`` of ``task`` sized for ``length_tokens`` with ``tokenizer``.

    Deterministic in (task, tokenizer, length_tokens, index, seed, haystack_text, chat_template, flavor, QA data
    file): the sample's
    ``random.Random`` is seeded by :func:`sample_seed`, and the haystack size comes from a cached probe search
    (:func:`fitted_size`) refined per sample by :func:`largest_fitting`: it starts a quarter percent below the
    probe's fit, shrinks on overshoot and grows while the slack exceeds 0.5% of the length (usually one
    tokenization per sample). QA sample ``index`` asks question ``index`` of the data file (ruler.md section 3.5)
    and fills the gap left by whole documents with further distractors that fit (:func:`_qa_fill`).

    Args:
        task: a name from ``TASKS`` (e.g. ``"niah_single_1"``, ``"ruler_vt"``).
        tokenizer: HF tokenizer of the evaluated model; lengths are ``len(tokenizer(prompt).input_ids)``.
        length_tokens: target length L in tokens; ``prompt_tokens + max_gen_toks <= L``.
        index: sample number, >= 0.
        seed: run seed.
        haystack_text: essay corpus text; ``None`` = the shipped ``devils-dictionary.txt``.
        chat_template: render (and measure) the prompt with the tokenizer's chat template.
        flavor: ``nvidia`` (NVIDIA/RULER prompts) or ``lm-eval`` (lm-eval 0.4.13's port); docs/ruler.md.
        qa_path: QA tasks only: the SQuAD / HotpotQA JSON file (default: ``$HYLO_BENCH_SQUAD`` /
            ``$HYLO_BENCH_HOTPOTQA``, else ``~/.cache/hylo_bench/ruler/<file>``; :func:`qa.locate_qa_file`).
        num_samples: samples the run will generate (default ``index + 1``); only used for the length advice of
            a too-small length (:func:`minimum_length`).

    Returns:
        lm-eval fields ``index, input, outputs, length, max_length, gen_prefix`` (``length`` = the prompt's
        :func:`sizing_tokens` + max_gen_toks, <= ``length_tokens``; for nvidia that count leaves out the BOS the
        tokenizer adds, as NVIDIA/RULER's ``length`` does), plus ``prompt`` (text fed to the model),
        ``prompt_tokens`` (tokens fed to the model, BOS included), ``task``, ``seed``,
        ``flavor``, ``haystack_units``, ``chat_template``; CWE adds ``input_example``; QA adds
        ``question_index``, ``num_docs`` (documents in the prompt) and ``query``.

    Raises:
        ValueError: unknown task or flavor, bad length/index, a length too small for the task
            (:class:`PromptTooLongError`, naming the smallest length that fits), or a QA index past the file's
            usable questions. FileNotFoundError: a QA data file is missing.
    """
    spec = get_task(task)
    check_flavor(flavor)
    if not isinstance(length_tokens, int) or length_tokens < 1:
        raise ValueError(f"length_tokens must be a positive int, got {length_tokens!r}")
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be an int >= 0, got {index!r}")
    text = default_haystack_text() if haystack_text is None else haystack_text
    qa = load_qa(task, qa_path) if spec.generator == "qa" else None
    if qa is not None and index >= len(qa.questions):
        raise ValueError(f"{qa.path} holds {len(qa.questions)} usable questions for {task}; sample {index} asks "
                         f"question {index}: use at most {len(qa.questions)} samples or a larger file")
    try:
        n_probe, slope = fitted_size(task, tokenizer, length_tokens, seed, text, chat_template, flavor, qa)
        ctx = _context(spec, tokenizer, length_tokens, seed, text, flavor, qa)
        if qa is not None:
            ctx = dataclasses.replace(ctx, question_index=index)
        tol = int(SAMPLE_TOLERANCE * length_tokens)
        # Start half a tolerance below the probe's fit: most samples then fit at the first probe and stop there.
        n_start = n_probe - int(0.5 * tol / slope)
        seed_int = sample_seed(seed, task, length_tokens, index)
        n, built, prompt, num_tokens, _ = _fit(spec, tokenizer, length_tokens, seed_int, ctx, chat_template,
                                               n_start, tol)
    except PromptTooLongError as err:
        k = max(index + 1, num_samples or 0)
        need = minimum_length(task, tokenizer, length_tokens, seed, text, chat_template=chat_template,
                              flavor=flavor, qa_path=qa_path, num_samples=k)
        which = "sample 0" if k == 1 else f"samples 0-{k - 1}"
        raise PromptTooLongError(f"{err}; use a length >= {need} (the smallest length at which {which} fit: the "
                                 f"words are drawn per length, so the smallest prompt differs by length)") from None
    return {
        "index": index,
        "input": built.input,
        "outputs": list(built.outputs),
        "length": num_tokens + spec.max_gen_toks,
        "max_length": length_tokens,
        "gen_prefix": built.gen_prefix,
        "prompt": prompt,
        "prompt_tokens": num_tokens if flavor != "nvidia" else len(encode_prompt(tokenizer, prompt, chat_template)),
        "task": task,
        "seed": seed,
        "flavor": flavor,
        "haystack_units": n,
        "chat_template": chat_template,
        **built.extra,
    }
