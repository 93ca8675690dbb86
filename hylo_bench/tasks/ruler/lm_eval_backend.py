"""``hylo-bench ruler --backend lm-eval``: lm-eval 0.4.13's own ``ruler`` tasks (``lm_eval/tasks/ruler/``), run
with our ``hylo`` model class, offline, scored by lm-eval's scorer, written in the native backend's results format.

How a run goes: the model is loaded once (:class:`hylo_bench.tasks.lm_eval_bridge.HyLoLM`); then for every
(length, task) one ``lm_eval.simple_evaluate`` call runs that single task with
``metadata={"max_seq_lengths": [L], "tokenizer": <the model's tokenizer directory>}`` and ``limit=samples``. One
call per (task, length) is what makes ``limit`` mean "N samples per length" (lm-eval's ``limit`` takes the first N
documents of the whole task, i.e. of the first length only) and makes a task's samples independent of the other
tasks run (lm-eval's generators share Python's global ``random``, seeded once per ``simple_evaluate``): the samples
are those of ``lm_eval run --tasks T --metadata '{"max_seq_lengths": [L], ...}' --limit N`` with the same seeds.

Offline hooks (:func:`offline_hooks`, a documented patch of lm-eval's module attributes, restored on exit):

- essays: ``niah_utils.get_haystack("essay")`` returns the words of our essay text (the shipped
  ``devils-dictionary.txt`` or ``--haystack FILE``) instead of loading the HF dataset ``baber/paul_graham_essays``;
  the ``repeat`` and ``needle`` haystacks are lm-eval's own.
- sentence splitting: when NLTK's ``punkt_tab`` is not installed, lm-eval's import-time ``nltk.download`` is
  skipped and ``prepare_niah.sent_tokenize`` is our regex splitter
  (:func:`hylo_bench.text.haystack.split_sentences`); with ``punkt_tab`` installed NLTK is used as is.
- QA: ``qa_utils.download_json(url)`` reads the local SQuAD v2 / HotpotQA file that the native QA tasks use
  (``--squad`` / ``--hotpotqa``, environment variables, ``~/.cache/hylo_bench/ruler/``) for lm-eval's two URLs.
- generation cap: lm-eval always generates 500 samples per length and then evaluates the first ``limit``; the
  generators are asked for ``min(500, samples)`` instead. With one length per call the first N samples are the same
  either way (every generator draws its samples one after another from the same seeded state; tested), so only
  the wasted work goes away.
- words: ``wonderwords`` ships its word lists, so lm-eval's word pools need nothing extra.

Public API: ``offline_hooks``, ``tokenizer_dir``, ``evaluate_lm_eval``,
``run_lm_eval``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import json
import logging
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hylo_bench.io_utils import OnResult, atomic_write_json, atomic_write_text, package_version
from hylo_bench.tasks.lm_eval_bridge import HyLoLM
from hylo_bench.tasks.provenance import param_dtype, software_versions
from hylo_bench.tasks.ruler import runner as R
from hylo_bench.tasks.ruler.cache import text_hash, tokenizer_hash
from hylo_bench.tasks.ruler.qa import QA_SOURCES, load_qa, locate_qa_file, resolve_qa_file
from hylo_bench.tasks.ruler.registry import LM_EVAL_TASKS, check_lm_eval_tasks
from hylo_bench.tasks.ruler.scoring import weighted_averages
from hylo_bench.text.haystack import essay_words, read_haystack_text, split_sentences

if TYPE_CHECKING:
    from rich.console import Console

    from hylo_bench.tasks.ruler.runner import RulerConfig  # noqa: F401 (annotations)

logger = logging.getLogger(__name__)

LM_EVAL_SAMPLES_PER_LENGTH = 500
"""What lm-eval 0.4.13's RULER generators produce per length (``num_samples=500``, hard-coded in the callers)."""
LM_EVAL_NUMPY_SEED = 1234
"""lm-eval's default ``numpy_random_seed`` / ``torch_random_seed`` (VT draws its values from numpy's generator)."""
# lm-eval's QA download URLs (qa_utils.read_squad / read_hotpotqa defaults) -> our QA task names.
_QA_URLS = {src.url: task for task, src in QA_SOURCES.items()}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_PROBE = "RULER probe: The special magic number for shiny-apple is 1234567. Zoë's café ≠ 42!"


def ruler_dir() -> Path:
    """``lm_eval/tasks/ruler`` of the installed lm-eval."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "ruler"


def _load_task_module(name: str) -> Any:
    """The module object lm-eval's YAML loader uses for ``!function <name>.<fn>`` in the ruler YAMLs.

    It caches modules it loads itself (by file path, with an ``__mtime__`` stamp) and re-executes any other, so
    patches must go onto the object it hands out, not onto a plain ``import`` of the same file.
    """
    from lm_eval.tasks._yaml_loader import _load_module_with_cache

    return _load_module_with_cache((ruler_dir() / f"{name}.py").resolve())


def _punkt_available() -> bool:
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
    except LookupError:
        return False
    return True


def _import_prepare_niah() -> tuple[Any, str]:
    """Import ``prepare_niah`` without letting it reach the network; returns (module, sentence splitter used)."""
    import nltk

    if _punkt_available():
        return importlib.import_module("lm_eval.tasks.ruler.prepare_niah"), "nltk punkt_tab"
    original = nltk.download
    nltk.download = lambda *a, **k: False  # its import-time nltk.download("punkt_tab") would go online
    try:
        # it then prints "Downloaded punkt_tab on rank 0" on stdout, which is false and would break --json
        with contextlib.redirect_stdout(io.StringIO()):
            module = importlib.import_module("lm_eval.tasks.ruler.prepare_niah")
    finally:
        nltk.download = original
    return module, "hylo-bench regex splitter (NLTK punkt_tab not installed)"


class _Patches:
    """Sets module attributes and puts the old values back (in reverse order) on :meth:`restore`."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, module: Any, name: str, value: Any) -> None:
        self._undo.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def restore(self) -> None:
        while self._undo:
            module, name, value = self._undo.pop()
            setattr(module, name, value)


def _capped(fn: Callable[..., Any], cap: int) -> Callable[..., Any]:
    """``fn`` with its ``num_samples`` keyword lowered to ``min(num_samples, cap)`` (default 500 when absent)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["num_samples"] = min(int(kwargs.get("num_samples", LM_EVAL_SAMPLES_PER_LENGTH)), cap)
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _rng_untouched() -> Iterator[None]:
    """Run a block without leaving a trace in Python's and numpy's global generators (lm-eval's RULER state)."""
    import random

    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def _too_short(task: str, length: int, smallest: int) -> ValueError:
    return ValueError(f"lm-eval's {task} cannot fit a prompt into {length} tokens with this tokenizer: its smallest "
                      f"sample takes {smallest} tokens as lm-eval measures it (lm-eval 0.4.13 would retry forever "
                      "or emit samples without answers here); use a larger --lengths value")


def _vt_guard(module: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``vt_utils.sys_vartrack_w_noise_random`` that raises instead of spinning when nothing fits.

    lm-eval's size search starts at ``incremental`` noise sentences; when that already overflows (measured as the
    search measures: prompt + answer + few-shot example + generation budget) it ends at 0 and the sample loop
    retries one size forever (a bare ``except:`` around an ``assert``). That first size is built once beforehand,
    with the generators' state saved and restored, so the samples drawn afterwards are unchanged.
    """
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        tok, icl = a["tokenizer"], a["icl_example"]
        with _rng_untouched():
            example_tokens = 0
            if a["add_fewshot"] and icl is not None:
                example_tokens = len(tok(icl["input"] + " " + " ".join(icl["outputs"]) + "\n\n").input_ids)
            text, answer = module.generate_input_output(a["incremental"], a["num_chains"], a["num_hops"],
                                                        is_icl=a["add_fewshot"] and icl is None)
            smallest = len(tok(text + f" {answer}").input_ids) + a["tokens_to_generate"] + example_tokens
        if smallest > a["max_seq_length"]:
            raise _too_short("ruler_vt", a["max_seq_length"], smallest)
        return fn(*args, **kwargs)

    return wrapper


def _cwe_guard(module: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``cwe_utils.sys_word_pair_random`` that raises when nothing fits (as :func:`_vt_guard`: lm-eval's search
    then ends at 0 words and its samples have no answers, which its scorer divides by), and starts from the state
    a fresh import leaves ``cwe_utils.RNG`` in.

    ``RNG`` (``Random(42)``, which shuffled ``WORDS`` at import) lives as long as the process; resetting it makes
    every (task, length) call draw what a fresh ``lm_eval`` process running that one length draws.
    """
    import random

    signature = inspect.signature(fn)
    fresh = random.Random(42)
    fresh.shuffle(list(range(len(module.WORDS))))  # a shuffle's draws depend only on the length
    fresh_state = fresh.getstate()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        a = signature.bind(*args, **kwargs)
        a.apply_defaults()
        a = a.arguments
        module.RNG.setstate(fresh_state)
        with _rng_untouched():
            cwe_state = module.RNG.getstate()
            example, text, answer = module.generate_input_output(a["incremental"], a["max_seq_length"])
            listed = " ".join(f"{i + 1}. {word}" for i, word in enumerate(answer))
            smallest = len(a["tokenizer"](example + "\n" + text + " " + listed).input_ids) + a["tokens_to_generate"]
            module.RNG.setstate(cwe_state)
        if smallest > a["max_seq_length"]:
            raise _too_short("ruler_cwe", a["max_seq_length"], smallest)
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def offline_hooks(tasks: list[str], haystack_text: str, qa_files: dict[str, Path],
                  sample_cap: int | None = None) -> Iterator[dict]:
    """Patch lm-eval's ruler modules so the given tasks build their data offline (see the module docstring).

    Args:
        tasks: our task names (keys of :data:`LM_EVAL_TASKS`); only their modules are imported and patched
            (``prepare_niah`` alone takes tens of seconds to import: it sorts 6.2M wonderwords pairs).
        haystack_text: essay text for the ``essay`` haystack (NIAH single 2/3, multikey 1, multiquery, multivalue).
        qa_files: ``{"ruler_qa_squad": path, "ruler_qa_hotpot": path}`` for the QA tasks among ``tasks``.
        sample_cap: generate at most this many samples per length (``None``: lm-eval's 500).

    Yields:
        ``{"sentence_splitter": str | None}`` (``None`` when no essay-haystack module was loaded).

    Raises:
        ValueError: unknown task. FileNotFoundError: (inside the block) lm-eval asked for a QA file that is not in
        ``qa_files``, or for a URL we do not map.
    """
    check_lm_eval_tasks(tasks)
    # every ruler YAML includes niah_single_1.yaml, so lm-eval imports niah_utils (and prepare_niah) for any task
    modules = {"niah_utils"} | {LM_EVAL_TASKS[t][1] for t in tasks}
    patches, info = _Patches(), {"sentence_splitter": None}
    try:
        prepare_niah, info["sentence_splitter"] = _import_prepare_niah()
        if not info["sentence_splitter"].startswith("nltk"):
            patches.set(prepare_niah, "sent_tokenize", split_sentences)
        prepare_niah.cached_sent_tokenize.cache_clear()
        niah = _load_task_module("niah_utils")
        original_haystack = niah.get_haystack
        words = list(essay_words(haystack_text))

        def get_haystack(type_haystack: str) -> list[str] | str:
            return list(words) if type_haystack == "essay" else original_haystack(type_haystack=type_haystack)

        patches.set(niah, "get_haystack", get_haystack)
        if sample_cap is not None:
            patches.set(niah, "generate_samples", _capped(niah.generate_samples, sample_cap))
        for module_name, fn_name, guard in (("vt_utils", "sys_vartrack_w_noise_random", _vt_guard),
                                            ("cwe_utils", "sys_word_pair_random", _cwe_guard)):
            if module_name in modules:
                module = _load_task_module(module_name)
                patches.set(module, fn_name, guard(module, getattr(module, fn_name)))
        if sample_cap is not None:
            for module_name, fn_name in (("vt_utils", "sys_vartrack_w_noise_random"),
                                         ("cwe_utils", "sys_word_pair_random"), ("fwe_utils", "sys_kwext"),
                                         ("qa_utils", "generate_samples")):
                if module_name in modules:
                    module = _load_task_module(module_name)
                    patches.set(module, fn_name, _capped(getattr(module, fn_name), sample_cap))
        if "qa_utils" in modules:
            qa = _load_task_module("qa_utils")

            def download_json(url: str) -> Any:
                task = _QA_URLS.get(url)
                if task is None:
                    raise FileNotFoundError(f"lm-eval's ruler QA asked for {url}; offline, hylo-bench maps only "
                                            f"{', '.join(_QA_URLS)} to local files")
                if task not in qa_files:
                    raise FileNotFoundError(locate_qa_file(task)[1] or f"{task}: no local data file was passed to "
                                            "offline_hooks")
                with open(qa_files[task], encoding="utf-8") as fh:
                    return json.load(fh)

            patches.set(qa, "download_json", download_json)
            qa.read_squad.cache_clear()
            qa.read_hotpotqa.cache_clear()
        yield info
    finally:
        patches.restore()
        if "qa_utils" in modules:
            qa = _load_task_module("qa_utils")
            qa.read_squad.cache_clear()
            qa.read_hotpotqa.cache_clear()
        if info["sentence_splitter"] is not None:
            importlib.import_module("lm_eval.tasks.ruler.prepare_niah").cached_sent_tokenize.cache_clear()


@contextlib.contextmanager
def tokenizer_dir(tokenizer: Any, model_path: str | None) -> Iterator[str]:
    """A directory lm-eval's ``AutoTokenizer.from_pretrained`` loads the model's own tokenizer from.

    The model's directory when it holds tokenizer files (what ``load_model`` read the tokenizer from), else a
    temporary ``save_pretrained`` copy (a model built in memory).

    Raises:
        ValueError: the tokenizer lm-eval loads from there encodes a probe text differently from ``tokenizer``.
    """
    from lm_eval.tasks.ruler.common_utils import get_tokenizer

    with contextlib.ExitStack() as stack:
        path = model_path
        if not path or not Path(path).is_dir() or not any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
            path = stack.enter_context(tempfile.TemporaryDirectory(prefix="hylo-ruler-tok-"))
            tokenizer.save_pretrained(path)
        loaded = get_tokenizer(path)
        if loaded(_PROBE).input_ids != tokenizer(_PROBE).input_ids:
            raise ValueError(f"the tokenizer lm-eval loads from {path} encodes text differently from the model's "
                             "tokenizer; RULER prompts would be sized with the wrong tokenizer")
        yield path


def _evaluate_one(lm: Any, task: str, length: int, cfg: RulerConfig, tok_dir: str) -> dict:
    """lm-eval's results dict for one task at one length (``simple_evaluate``, samples logged)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(ruler_dir()), include_defaults=False,
                          metadata={"max_seq_lengths": [length], "tokenizer": tok_dir})
    return simple_evaluate(model=lm, tasks=[LM_EVAL_TASKS[task][0]], limit=cfg.samples, task_manager=manager,
                           log_samples=True, random_seed=cfg.seed, numpy_random_seed=LM_EVAL_NUMPY_SEED,
                           torch_random_seed=LM_EVAL_NUMPY_SEED, apply_chat_template=cfg.chat_template,
                           bootstrap_iters=0)


def _record(lm: Any, task: str, length: int, cfg: RulerConfig, res: dict) -> tuple[dict, list[dict]]:
    """Our results record (native keys; score 0-100 from lm-eval's own ``<L>,none`` metric) and per-sample rows."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred

    name = LM_EVAL_TASKS[task][0]
    value = res["results"].get(name, {}).get(f"{length},none")
    samples = res.get("samples", {}).get(name, [])
    if value is None or value < 0 or not samples:
        raise ValueError(f"lm-eval produced no {name} samples at {length} tokens (its generator could not fit any "
                         "in that length); use a larger --lengths value")
    rows, prompt_tokens, nulls = [], [], 0
    for s in samples:
        context = s["arguments"][0][0]
        prediction = s["filtered_resps"][0]
        prompt_tokens.append(len(lm.tok_encode(context)))
        nulls += not postprocess_pred([prediction])[0]
        rows.append({"doc_id": s["doc_id"], "prompt_sha256": text_hash(context), "prompt_tokens": prompt_tokens[-1],
                     "prediction": prediction, "outputs": s["doc"]["outputs"], "score": s.get(str(length))})
    max_gen = int(res.get("configs", {}).get(name, {}).get("generation_kwargs", {}).get("max_gen_toks", 0))
    if max(prompt_tokens) + max_gen > lm.max_length:
        logger.warning("%s @ %d: prompts of up to %d tokens + %d to generate exceed the model's window of %d "
                       "tokens; lm-eval's HFLM cut them from the left", name, length, max(prompt_tokens), max_gen,
                       lm.max_length)
    record = {
        "task": task, "seq_len": length, "score": 100.0 * float(value), "n": len(samples), "seed": cfg.seed,
        "nulls": nulls, "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "prompt_tokens_min": min(prompt_tokens), "prompt_tokens_max": max(prompt_tokens), "flavor": "lm-eval",
        "backend": "lm-eval", "lm_eval_task": name, "lm_eval_task_version": res.get("versions", {}).get(name),
    }
    return record, rows


def _provenance(lm: Any, model_info: dict, cfg: RulerConfig, tok_hash: str, haystack_text: str,
                splitter: str | None, tok_dir: str) -> dict:
    param = next(iter(lm.model.parameters()), None)
    return {
        "backend": "lm-eval",
        "lm_eval_version": package_version("lm_eval"),
        "model_hash": model_info["hash"],
        "tokenizer_hash": tok_hash,
        "flavor": "lm-eval",
        "seed": cfg.seed,
        "numpy_seed": LM_EVAL_NUMPY_SEED,
        "torch_seed": LM_EVAL_NUMPY_SEED,
        "samples_per_task": cfg.samples,
        "samples_generated_per_length": min(cfg.samples, LM_EVAL_SAMPLES_PER_LENGTH),
        "batch_size": cfg.batch_size,
        "max_length": lm.max_length,
        "dtype": param_dtype(lm.model),
        "device": "unknown" if param is None else str(param.device),
        "num_processes": 1,
        "engine": "lm-eval HFLM generate_until",
        "chat_template": cfg.chat_template,
        "strip_think": cfg.strip_think,
        "sentence_splitter": splitter,
        "tokenizer_source": "model directory" if tok_dir == model_info.get("path") else "save_pretrained copy",
        **software_versions(),
        "haystack_sha256": text_hash(haystack_text),
        "qa_data_sha256": {t: load_qa(t, cfg.qa_path(t)).sha256 for t in cfg.tasks if t in QA_SOURCES},
    }


def evaluate_lm_eval(lm: Any, model_info: dict, cfg: RulerConfig, *, console: Console | None = None,
                     on_result: OnResult | None = None) -> dict:
    """Run lm-eval's ruler tasks on a ready lm-eval model (usually :class:`HyLoLM`) and write our results file.

    Args:
        lm: an HFLM-style lm-eval model with ``.tokenizer``, ``.model``, ``.max_length`` and ``tok_encode``.
        model_info: ``name, path, hash, layout, kind`` (as ``load_model`` returns); ``path`` is used for the
            tokenizer directory when it holds tokenizer files.
        cfg: the run (``backend`` must be ``lm-eval``).
        console: rich console for progress lines (default: stderr).
        on_result: called with ``(results doc, results path)`` after every (task, length) (the CLI: the results
            store); None writes the results file alone.

    Returns:
        The native summary shape: ``{"model", "flavor": "lm-eval", "backend": "lm-eval", "scores": {task: {"<L>":
        score 0-100}}, "mean": {"<L>": score}, "avg", "weighted_avg_inc", "weighted_avg_dec", "results_path"}``.
        The results JSON (``RESULTS_DIR/ruler-<model>-<time>.json``) has the native keys plus ``backend`` and is
        passed to ``on_result`` after every (task, length); per-sample predictions go to
        ``RESULTS_DIR/lm-eval-ruler/<results file stem>/<task>-<L>.jsonl``.

    Raises:
        ValueError: unknown task, or lm-eval produced no sample at a length.
        FileNotFoundError: a QA data file is missing (the message names the file, flag, variable and URL).
    """
    from rich.console import Console

    check_lm_eval_tasks(cfg.tasks)
    missing = [k for k in R.MODEL_INFO_KEYS if k not in model_info]
    if missing:
        raise ValueError(f"model_info lacks {missing}; load_model must return {R.MODEL_INFO_KEYS}")
    console = console or Console(stderr=True)
    R.check_lengths(cfg.lengths, getattr(lm, "model", None), cfg.beyond_context)
    haystack_text = read_haystack_text(cfg.haystack_path)
    qa_files = {t: resolve_qa_file(t, cfg.qa_path(t)) for t in cfg.tasks if t in QA_SOURCES}
    tok_hash = tokenizer_hash(lm.tokenizer)
    results_dir = Path(cfg.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = R.results_path(results_dir, str(model_info["name"]))
    samples_dir = results_dir / "lm-eval-ruler" / path.stem
    scores: dict[str, dict[str, float]] = {}
    with offline_hooks(cfg.tasks, haystack_text, qa_files, sample_cap=cfg.samples) as hooks, \
            tokenizer_dir(lm.tokenizer, model_info.get("path")) as tok_dir:
        doc = R.results_header(model_info, cfg, _provenance(lm, model_info, cfg, tok_hash, haystack_text,
                                                   hooks["sentence_splitter"], tok_dir))
        doc["backend"] = "lm-eval"
        atomic_write_json(path, doc)  # the claimed file holds the header from the start
        for length in cfg.lengths:
            for task in cfg.tasks:
                console.print(f"lm-eval {LM_EVAL_TASKS[task][0]} @ {length} tokens ({cfg.samples} samples)")
                res = _evaluate_one(lm, task, length, cfg, tok_dir)
                record, rows = _record(lm, task, length, cfg, res)
                samples_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_text(samples_dir / f"{task}-{length}.jsonl",
                                  "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
                doc["records"].append(record)
                doc["mean"] = R.length_means(doc["records"])
                doc.update(weighted_averages(doc["mean"]))
                if len(doc["records"]) == len(doc["planned"]):
                    doc["status"] = "complete"
                atomic_write_json(path, doc)
                if on_result is not None:
                    on_result(doc, path)
                scores.setdefault(task, {})[str(length)] = record["score"]
    return {"model": model_info["name"], "flavor": "lm-eval", "backend": "lm-eval", "scores": scores,
            "mean": doc["mean"], **{k: doc[k] for k in R.SUMMARY_KEYS}, "results_path": str(path)}


def run_lm_eval(cfg: RulerConfig, *, console: Console | None = None, on_result: OnResult | None = None) -> dict:
    """Load ``cfg.model`` as the ``hylo`` lm-eval model and run :func:`evaluate_lm_eval`.

    The context window (``max_length``) is the largest length plus 1024 tokens: lm-eval sizes prompts to leave
    the generation budget free but appends the answer prefix afterwards (and FWE reserves nothing), so a window of
    exactly L would left-truncate some prompts.
    """
    lm = HyLoLM(pretrained=cfg.model, device=cfg.device, batch_size=cfg.batch_size,
                max_length=max(cfg.lengths) + 1024)
    return evaluate_lm_eval(lm, lm.model_info, cfg, console=console, on_result=on_result)
