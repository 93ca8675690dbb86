"""RULER runner: load a model, generate or reuse cached samples, decode greedily, score, write the results JSON.

``run(cfg)`` is what ``hylo-bench ruler`` calls; ``evaluate_model`` does the work for an already-loaded model.
Results are rewritten atomically after every (task, length), and every batch's predictions are appended to
``RESULTS_DIR/predictions/`` (:mod:`hylo_bench.tasks.ruler.predictions`), so ``resume=True`` continues an
interrupted run from the last scored batch.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import re
import statistics
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

import hylo_bench
from hylo_bench.decode.greedy import ENGINES, Decoder, make_decoder, resolve_engine
from hylo_bench.io_utils import (
    OnResult,
    atomic_write_json,
    check_output_path,
    check_utf8_file,
    fault_point,
    utc_now,
)
from hylo_bench.tasks.provenance import param_dtype, software_versions
from hylo_bench.tasks.ruler import predictions as pred_store
from hylo_bench.tasks.ruler.cache import GENERATOR_VERSION, cache_path, load_or_generate, text_hash, tokenizer_hash
from hylo_bench.tasks.ruler.qa import QA_SOURCES, load_qa, locate_qa_file
from hylo_bench.tasks.ruler.registry import check_flavor, check_lm_eval_tasks, get_task, list_tasks
from hylo_bench.tasks.ruler.sampling import encode_prompt, encode_prompts, fitted_size
from hylo_bench.tasks.ruler.scoring import mean_score, task_score, weighted_averages
from hylo_bench.text.haystack import read_haystack_text

logger = logging.getLogger(__name__)
MODEL_INFO_KEYS = ("name", "path", "hash", "layout", "kind")
BACKENDS = ("native", "lm-eval")
"""``native``: hylo-bench's RULER implementation; ``lm-eval``: lm-eval 0.4.13's ``ruler`` tasks (docs/ruler.md)."""
SUMMARY_KEYS = ("avg", "weighted_avg_inc", "weighted_avg_dec")
RUN_STATUSES = ("running", "complete")
"""A results file is ``running`` from its first (task, length) until the last one is scored, then ``complete``; a
run that was killed stays ``running`` (``report`` and ``compare`` leave such runs out and say so)."""
SIZING_BYTES_PER_TOKEN = 400
"""Peak memory of tokenizing one prompt, bytes per token (a fast BPE tokenizer on 1.7M tokens of the shipped essay:
about 370 B/token of RSS). Sizing a prompt of L tokens needs about L times this."""


@dataclasses.dataclass(kw_only=True, slots=True)
class RulerConfig:
    """One RULER run.

    Attributes:
        model: model spec for ``hylo_bench.models.loading.load_model`` (path, recipe name, ...).
        lengths: target lengths in tokens, e.g. ``[4096, 8192]``.
        tasks: task names from ``TASKS``.
        samples: samples per (task, length); lm-eval uses 500.
        results_dir: folder for ``ruler-<model>-<timestamp>.json`` and the sample cache ``cache/``.
        seed: run seed; each sample's rng derives from (seed, task, length, index). Default (None): 42, or 0 (lm-eval's
            own) with ``backend="lm-eval"``.
        haystack_path: essay haystack text file; ``None`` = the shipped ``devils-dictionary.txt``.
        batch_size: prompts per ``generate`` call (left-padded when > 1); with ``engine="native"`` and a HyLo
            model, the continuous-batching slots (same predictions as 1).
        chat_template: wrap ``input`` as a user turn and prefill ``gen_prefix`` as the assistant turn.
        device: ``cpu`` / ``cuda`` (default: cuda when available).
        strip_think: remove ``<think>...</think>`` spans from predictions before scoring
            (:func:`hylo_bench.text.think.strip_think`; for Qwen3-based checkpoints).
        flavor: ``nvidia`` (NVIDIA/RULER prompts and QA any-match) or ``lm-eval`` (lm-eval 0.4.13's variant);
            docs/ruler.md lists the differences. Default (None): ``nvidia``, or ``lm-eval`` with
            ``backend="lm-eval"``.
        squad_path: SQuAD v2 dev JSON for ``ruler_qa_squad`` (``None``: ``$HYLO_BENCH_SQUAD``, else
            ``~/.cache/hylo_bench/ruler/dev-v2.0.json``).
        hotpotqa_path: HotpotQA dev distractor JSON for ``ruler_qa_hotpot`` (``None``: ``$HYLO_BENCH_HOTPOTQA``,
            else ``~/.cache/hylo_bench/ruler/hotpot_dev_distractor_v1.json``).
        resume: reuse the per-sample predictions already in ``results_dir/predictions/`` for the same model
            hash, dtype, tokenizer, data, seed, flavor, chat template and generation budget, and decode only the
            missing samples (opt-in, like lm-eval's ``--use_cache``); without it a run starts from no predictions.
            The results go to a new results file either way.
        devices: worker processes, one per GPU (``cuda:0`` ... ``cuda:N-1``, or all on CPU with ``device="cpu"``);
            each decodes every N-th sample of each (task, length), rank 0 merges and scores
            (:mod:`hylo_bench.tasks.ruler.parallel`). Under ``torchrun`` (``WORLD_SIZE`` > 1) the launched
            processes are the workers and this must be 1 or ``WORLD_SIZE``.
        engine: ``generate`` (transformers ``generate()``, batched), ``static`` (the same over a preallocated
            ``StaticCache``, transformer models; on CUDA transformers compiles its decode step), ``native`` (greedy
            through :mod:`hylo_bench.decode.engine`; continuous batching over ``batch_size`` slots for HyLo models)
            or ``auto`` (native for HyLo models on CUDA, generate otherwise); :mod:`hylo_bench.decode.greedy`.
        backend: ``native`` (hylo-bench's generators, scorer and decoding: everything above) or ``lm-eval``
            (lm-eval 0.4.13's own ``ruler`` tasks and scorer through the ``hylo`` lm-eval model, offline;
            :mod:`hylo_bench.tasks.ruler.lm_eval_backend`). ``lm-eval`` needs ``flavor="lm-eval"`` and supports
            neither ``resume``, ``devices`` > 1, ``engine="native"`` / ``"static"`` nor ``strip_think``.
        prefill_chunk: tokens per prefill chunk of the native engine (None:
            :data:`hylo_bench.decode.greedy.PREFILL_CHUNK_TOKENS`); larger chunks launch fewer kernels per prompt
            and take more activation memory.
        prefix_sharing: the native engine's continuous batching prefills the whole 4K-token blocks that a prompt
            shares with an earlier one (a NIAH haystack before its needle) once (:mod:`hylo_bench.decode.batching`);
            predictions are the same either way, up to the rounding of a prefill chunk cut at a shared length.
    """

    model: str
    lengths: list[int]
    tasks: list[str]
    samples: int
    results_dir: str | Path
    seed: int | None = None  # resolved in __post_init__ (42; 0 with the lm-eval backend)
    haystack_path: str | Path | None = None
    batch_size: int = 1
    chat_template: bool = False
    device: str | None = None
    strip_think: bool = False
    flavor: str | None = None  # resolved in __post_init__ ("nvidia"; "lm-eval" with the lm-eval backend)
    squad_path: str | Path | None = None
    hotpotqa_path: str | Path | None = None
    resume: bool = False
    devices: int = 1
    engine: str = "auto"
    backend: str = "native"
    beyond_context: bool = False  # allow lengths past the model's configured context (length generalisation)
    prefill_chunk: int | None = None
    prefix_sharing: bool = True

    def qa_path(self, task: str) -> str | Path | None:
        """The configured data file of a QA task (``None``: environment variable or default location)."""
        return self.squad_path if task == "ruler_qa_squad" else self.hotpotqa_path

    def __post_init__(self) -> None:
        lm_eval = self.backend == "lm-eval"
        if self.seed is None:
            self.seed = 0 if lm_eval else 42
        if self.flavor is None:
            self.flavor = "lm-eval" if lm_eval else "nvidia"
        if not self.lengths or any(not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be a non-empty list of positive ints (tokens), got {self.lengths!r}")
        if len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"lengths has duplicates: {self.lengths!r}")
        if not self.tasks:
            raise ValueError("tasks must name at least one RULER task; see hylo_bench.tasks.ruler.list_tasks()")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "lm-eval":
            self._check_lm_eval_backend()
        for task in self.tasks:
            get_task(task)
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks has duplicates: {self.tasks!r}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1 (worker processes), got {self.devices}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token, got {self.prefill_chunk}")
        if self.haystack_path is not None and not Path(self.haystack_path).is_file():
            raise ValueError(f"haystack_path {str(self.haystack_path)!r} is not a file; pass a text file or omit it")
        if self.haystack_path is not None:
            check_utf8_file(self.haystack_path, "--haystack")
        check_output_path(self.results_dir, "--results-dir", is_dir=True)
        check_flavor(self.flavor)
        for task in self.tasks:
            if task in QA_SOURCES:
                found, reason = locate_qa_file(task, self.qa_path(task))
                if found is None:
                    raise FileNotFoundError(reason)
                qa = load_qa(task, found)  # parsed (and cached) now: a bad file fails before the model loads
                if self.samples > len(qa.questions):
                    raise ValueError(f"{qa.path} holds {len(qa.questions)} usable questions for {task}; --samples "
                                     f"{self.samples} asks for more: use at most {len(qa.questions)} samples")

    def _check_lm_eval_backend(self) -> None:
        check_lm_eval_tasks(self.tasks)
        unsupported = {
            "flavor": (self.flavor != "lm-eval", f"flavor {self.flavor!r}: lm-eval's own tasks are the lm-eval "
                       "flavor (use --flavor lm-eval or leave it out)"),
            "resume": (self.resume, "--resume (lm-eval decodes every (task, length) afresh)"),
            "devices": (self.devices != 1, f"--devices {self.devices} (one process only)"),
            "engine": (self.engine in ("native", "static"), f"--engine {self.engine} (decoding goes through "
                       "lm-eval's HFLM generate_until; use auto or generate)"),
            "strip_think": (self.strip_think, "--strip-think (lm-eval scores the raw generations)"),
            "prefill_chunk": (self.prefill_chunk is not None, "--prefill-chunk (the native engine's; lm-eval's "
                              "generate_until decodes)"),
            "prefix_sharing": (not self.prefix_sharing, "--no-prefix-sharing (the native engine's)"),
        }
        bad = [why for flag, why in unsupported.values() if flag]
        if bad:
            raise ValueError("--backend lm-eval does not support " + "; ".join(bad))

    def to_dict(self) -> dict:
        """JSON-ready copy (paths as strings)."""
        out = dataclasses.asdict(self)
        for key in ("results_dir", "haystack_path", "squad_path", "hotpotqa_path"):
            out[key] = None if out[key] is None else str(out[key])
        return out


def select_tasks(spec: str, squad_path: str | Path | None = None, hotpotqa_path: str | Path | None = None) -> list[str]:
    """Task list from a ``--tasks`` value: ``"all"`` or comma-separated names.

    ``"all"`` = the 13 tasks, minus each QA task whose data file is missing (logged with the reason, so offline
    demos keep working); named QA tasks are kept and fail later with the missing-file message.
    """
    if spec.strip() != "all":
        return [t.strip() for t in spec.split(",") if t.strip()]
    tasks = []
    for task in list_tasks():
        if task in QA_SOURCES:
            found, reason = locate_qa_file(task, squad_path if task == "ruler_qa_squad" else hotpotqa_path)
            if found is None:
                logger.warning("skipping %s: %s", task, reason)
                continue
        tasks.append(task)
    return tasks


class _RateColumn(ProgressColumn):
    def render(self, task: Any) -> Text:
        return Text(f"{task.speed:.2f} samples/s" if task.speed else "- samples/s")


def _progress(console: Console | None, disable: bool = False) -> Progress:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), _RateColumn())
    return Progress(*columns, TimeRemainingColumn(), console=console or Console(stderr=True), disable=disable)


# RULER 64K, batch 8 on fresh H200s (benchmarks/results/ruler_throughput_b8_encode{4,1}.json): four threads cut the
# host wait for each task's first batch (1.7 vs 4.6 s over 24 prompts) and cost the prefills beside them some speed
# (median 1.22 vs 1.07 s per 64K prompt: the tokenizer wrapper's Python work shares the GIL with the prefill's
# launches); net 27.0 vs 28.8 s, within the spread between machines. More than four was not measured.
ENCODE_WORKERS_MAX = 4


def encode_workers() -> int:
    """Threads that tokenise prompts while the GPU decodes: one per spare CPU core, at most
    :data:`ENCODE_WORKERS_MAX` (each holds its own tokenizer copy), at least one."""
    return max(1, min(ENCODE_WORKERS_MAX, (os.cpu_count() or 1) - 1))


class PromptEncoder:
    """Token ids of prompts (:func:`encode_prompt`) on worker threads, each with its own copy of the tokenizer:
    transformers sets a fast tokenizer's truncation and padding on the shared Rust object at every call, so two
    threads on one tokenizer can fail with "Already borrowed" (huggingface/tokenizers#537,
    huggingface/transformers#47085). Fast tokenizers release the GIL while encoding, so ``workers`` threads encode
    that many prompts at once (a 64K-token prompt takes about a tenth of a second of CPU), though the wrapper's
    Python work around each call still takes the GIL from the thread that launches the GPU's kernels
    (:data:`ENCODE_WORKERS_MAX`).

    The copies are made here, once, on the calling thread; one encoder serves a whole RULER run.

    Raises:
        ValueError: ``workers`` < 1.
    """

    def __init__(self, tokenizer: Any, chat_template: bool, workers: int = 1):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        copies = [copy.deepcopy(tokenizer) for _ in range(workers)]
        self._local = threading.local()
        self.chat_template, self.workers = chat_template, workers

        def take_copy() -> None:  # once per worker thread; list.pop is atomic
            self._local.tokenizer = copies.pop()

        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ruler-encode", initializer=take_copy)
        self._ahead: dict[str, Future] = {}

    def submit(self, prompt: str) -> Future:
        """A future of the prompt's token ids (list[int]); the one :meth:`prefetch` started, when it did."""
        ahead = self._ahead.pop(prompt, None)
        if ahead is not None:
            return ahead
        return self._pool.submit(lambda: encode_prompt(self._local.tokenizer, prompt, self.chat_template))

    def submit_many(self, prompts: Sequence[str]) -> list[Future]:
        """:meth:`submit` of each prompt, for prompts the caller is about to wait for (the GPU idle meanwhile): those
        no :meth:`prefetch` started are split into one batch per worker (:func:`encode_prompts`), which a fast
        tokenizer spreads over every CPU core instead of one core per worker. A future cancelled before its batch
        starts is dropped; the rest of its batch is still encoded."""
        futures: list[Future | None] = [self._ahead.pop(p, None) for p in prompts]
        todo = [i for i, fut in enumerate(futures) if fut is None]
        groups = min(self.workers, len(todo))
        for g in range(groups):
            part = todo[g * len(todo) // groups : (g + 1) * len(todo) // groups]
            outs = [Future() for _ in part]
            for i, out in zip(part, outs):
                futures[i] = out
            self._pool.submit(self._encode_into, [prompts[i] for i in part], outs)
        return futures  # type: ignore[return-value]

    def _encode_into(self, prompts: list[str], outs: list[Future]) -> None:
        live = [(p, out) for p, out in zip(prompts, outs) if out.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            ids = encode_prompts(self._local.tokenizer, [p for p, _ in live], self.chat_template)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller through its futures
            for _, out in live:
                out.set_exception(e)
            return
        for (_, out), x in zip(live, ids):
            out.set_result(x)

    def prefetch(self, prompts: Sequence[str]) -> None:
        """Start encoding ``prompts`` now, queued behind the work already submitted, for a later :meth:`submit`.

        Prompts of the previous prefetch that no call has taken (their samples had predictions already) are
        dropped first, so at most one prefetch's token ids are held."""
        for fut in self._ahead.values():
            fut.cancel()
        self._ahead = {}
        for prompt in prompts:
            if prompt not in self._ahead:
                self._ahead[prompt] = self._pool.submit(
                    lambda p=prompt: encode_prompt(self._local.tokenizer, p, self.chat_template))

    def close(self) -> None:
        """Stop the workers; prompts not yet started are dropped."""
        self._ahead = {}
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PromptEncoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prompts_per_call(decode: Decoder, cfg: RulerConfig) -> int:
    """Prompts per call of ``decode``, and so per saved batch of predictions: the decoder's ``requests_per_call``
    when it has one (a continuous-batching decoder takes several prompts per slot, so refilled slots keep the batch
    full), else ``cfg.batch_size``."""
    return getattr(decode, "requests_per_call", None) or cfg.batch_size


def _predict(
    decode: Decoder, tokenizer: Any, samples: list[dict], cfg: RulerConfig, max_new: int,
    on_batch: Callable[[list[dict], list[str]], None], encoder: PromptEncoder | None = None,
    lookahead: Sequence[str] = (),
) -> None:
    """Decode ``samples`` in batches of :func:`prompts_per_call`; ``on_batch(batch, predictions)`` after each batch.

    The prompts of this batch and the next are tokenised on ``encoder``'s worker threads (a one-thread
    :class:`PromptEncoder` of ``tokenizer`` for this call when None), so the next batch's prompts are ready when
    this one has decoded; only the first batch waits for its own prompts (encoded in batches,
    :meth:`PromptEncoder.submit_many`), and not even that when an earlier call passed them as its ``lookahead``:
    prompts of the next call (the next task or length) that ``encoder`` starts
    encoding (:meth:`PromptEncoder.prefetch`) once this call's first prompts are queued, so the GPU does not idle
    between tasks while they are tokenised.

    A batch that runs out of GPU memory is retried at half the batch size (and the rest of the samples keep the
    smaller size), down to one sample; the out-of-memory error of a single sample is raised. On any error the
    prompts not yet tokenised are dropped.
    """
    size, start = prompts_per_call(decode, cfg), 0
    encoded: dict[int, Future] = {}
    own = encoder is None
    enc = PromptEncoder(tokenizer, cfg.chat_template) if own else encoder

    def ensure(lo: int, hi: int, waited_for_now: bool = False) -> None:
        todo = [i for i in range(lo, min(hi, len(samples))) if i not in encoded]
        prompts = [samples[i]["prompt"] for i in todo]
        futures = enc.submit_many(prompts) if waited_for_now else [enc.submit(p) for p in prompts]
        encoded.update(zip(todo, futures))

    try:
        ensure(0, size, waited_for_now=True)  # nothing decodes until these are encoded: on every core
        ensure(size, 2 * size)
        if lookahead:
            enc.prefetch(lookahead)  # queued behind this call's first prompts
        while start < len(samples):
            batch = samples[start : start + size]
            ensure(start, start + 2 * size)  # this batch, and the next one while this one decodes
            ids = [encoded[i].result() for i in range(start, start + len(batch))]
            try:
                preds = decode(ids, max_new)
            except Exception as e:  # noqa: BLE001 - torch.OutOfMemoryError, or a RuntimeError saying so
                if size == 1 or not _is_oom(e):
                    raise
                import torch

                torch.cuda.empty_cache()
                size = max(1, size // 2)
                logger.warning("out of GPU memory decoding %d prompts of up to %d tokens; retrying %d at a time",
                               len(batch), max(len(x) for x in ids), size)
                continue
            on_batch(batch, preds)
            for i in range(start, start + len(batch)):
                del encoded[i]
            start += len(batch)
    finally:
        for fut in encoded.values():  # an error is raised without tokenising the rest
            fut.cancel()
        if own:
            enc.close()


def _is_oom(e: BaseException) -> bool:
    """True for a GPU allocation failure: torch's ``OutOfMemoryError``, a RuntimeError saying "out of memory", or
    cuDNN attention failing to run its graph on a full GPU (``mha_graph.execute(..., workspace_ptr.get())``)."""
    text = str(e).lower()
    return type(e).__name__ == "OutOfMemoryError" or "out of memory" in text or "workspace_ptr" in text


def results_path(results_dir: Path, model_name: str) -> Path:
    """A new results file name, claimed by creating the file exclusively (``O_EXCL``): two runs of one model
    started in the same second (e.g. two length groups in parallel) get different files instead of one run
    overwriting the other's results. The claimed file is empty until the first record is written."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name).strip("_") or "model"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, k = results_dir / f"ruler-{safe}-{stamp}.json", 1
    while True:
        try:
            with open(path, "x"):
                return path
        except FileExistsError:
            path, k = results_dir / f"ruler-{safe}-{stamp}-{k}.json", k + 1


def provenance(model: Any, model_info: dict, cfg: RulerConfig, tok_hash: str, haystack_text: str,
               shard: Shard | None = None) -> dict:
    """What produced a results file: model and tokenizer hashes, generator version, flavor, seed, samples, batch
    size, parameter dtype and device (read from the model; rank 0's), number of processes, decoding engine,
    torch / transformers / Python versions, git sha, and the sha256 of the essay text and of each QA data file
    used."""
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    qa_files = {t: load_qa(t, cfg.qa_path(t)).sha256 for t in cfg.tasks if t in QA_SOURCES}
    return {
        "backend": "native",
        "model_hash": model_info["hash"],
        "tokenizer_hash": tok_hash,
        "generator_version": GENERATOR_VERSION,
        "flavor": cfg.flavor,
        "seed": cfg.seed,
        "samples_per_task": cfg.samples,
        "batch_size": cfg.batch_size,
        "dtype": "unknown" if param is None else str(param.dtype).removeprefix("torch."),
        "device": "unknown" if param is None else str(param.device),
        "num_processes": 1 if shard is None else shard.world_size,
        "engine": resolve_engine(model, cfg.engine),
        "chat_template": cfg.chat_template,
        "strip_think": cfg.strip_think,
        **software_versions(),
        "haystack_sha256": text_hash(haystack_text),
        "qa_data_sha256": qa_files,
    }


def model_context_tokens(model: Any) -> tuple[int, str] | None:
    """The longest context ``model`` is configured for, in tokens, with where that number comes from: its config's
    ``max_position_embeddings`` (for a HyLo hybrid the larger of the hybrid's and the base ``config.json``'s), or a
    YaRN / linear / dynamic ``rope_scaling`` factor times ``original_max_position_embeddings`` when larger. None when
    the model has no config saying so (e.g. a scripted test model)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    found: list[tuple[int, str]] = []
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            found.append((value, f"config {attr}"))
            break
    base = getattr(cfg, "base_config", None)
    if isinstance(base, dict) and isinstance(base.get("max_position_embeddings"), int):
        found.append((base["max_position_embeddings"], "config.json max_position_embeddings"))
    for attr in ("mla_rope_scaling", "rope_scaling"):
        rs = getattr(cfg, attr, None)
        if isinstance(rs, dict) and isinstance(rs.get("factor"), (int, float)) and \
                isinstance(rs.get("original_max_position_embeddings"), int):
            scaled = int(rs["factor"] * rs["original_max_position_embeddings"])
            source = f"rope_scaling factor {rs['factor']:g} x original_max_position_embeddings " \
                     f"{rs['original_max_position_embeddings']}"
            found.append((scaled, source))
    return max(found) if found else None


def _available_memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_lengths(lengths: list[int], model: Any, beyond_context: bool = False) -> None:
    """Refuse lengths the model cannot take or that cannot be sized here, before any sample is built.

    ``beyond_context``: lengths past the model's configured context are allowed (with a warning): scoring a model
    beyond the length it was trained at is how length generalisation is measured (the paper's 8K-trained hybrids
    at 64K).

    Raises:
        ValueError: a length beyond :func:`model_context_tokens` (without ``beyond_context``), or one whose sizing
            would need more than half of the available memory (:data:`SIZING_BYTES_PER_TOKEN`); the numbers are in
            the message.
    """
    ctx = model_context_tokens(model)
    if ctx is not None:
        over = [n for n in lengths if n > ctx[0]]
        if over and not beyond_context:
            raise ValueError(f"--lengths {', '.join(map(str, over))} tokens: longer than the model's context of "
                             f"{ctx[0]} tokens ({ctx[1]}); use lengths <= {ctx[0]}, or --beyond-context to score "
                             f"the model past it (length generalisation)")
        if over:
            logger.warning("--lengths %s: beyond the model's context of %d tokens (%s), as asked by "
                           "--beyond-context", ", ".join(map(str, over)), ctx[0], ctx[1])
    avail = _available_memory_bytes()
    if avail is not None:
        need = max(lengths) * SIZING_BYTES_PER_TOKEN
        if need > avail // 2:
            raise ValueError(f"--lengths {max(lengths)} tokens: sizing one prompt of that length needs about "
                             f"{need / 2 ** 30:.1f} GiB ({SIZING_BYTES_PER_TOKEN} bytes/token while tokenizing), more "
                             f"than half of the {avail / 2 ** 30:.1f} GiB available; use lengths <= "
                             f"{avail // 2 // SIZING_BYTES_PER_TOKEN}")


def check_sizing(cfg: RulerConfig, tokenizer: Any, haystack_text: str, tok_hash: str) -> None:
    """Size every (task, length) of ``cfg`` before anything is decoded (the probe search of
    :func:`~hylo_bench.tasks.ruler.sampling.fitted_size`, cached, so the samples reuse it); pairs whose samples are
    already in the cache were sized before and are skipped.

    Raises:
        ValueError: listing every (task, length) that cannot hold the task's smallest prompt, with the length each
            needs; nothing has been decoded or written then.
    """
    problems = []
    for length in cfg.lengths:
        for task in cfg.tasks:
            data_hash = load_qa(task, cfg.qa_path(task)).sha256 if task in QA_SOURCES else text_hash(haystack_text)
            cached = cache_path(Path(cfg.results_dir) / "cache", task, length, tok_hash, cfg.seed, data_hash,
                                cfg.chat_template, cfg.flavor)
            if cached.is_file() and cached.stat().st_size > 0:
                continue
            qa = load_qa(task, cfg.qa_path(task)) if task in QA_SOURCES else None
            try:
                fitted_size(task, tokenizer, length, cfg.seed, haystack_text, cfg.chat_template, cfg.flavor, qa)
            except ValueError as exc:
                problems.append(f"{task} @ {length}: {exc}")
    if problems:
        raise ValueError(f"{len(problems)} of {len(cfg.lengths) * len(cfg.tasks)} (task, length) pairs cannot be "
                         f"sized; nothing was decoded:\n  " + "\n  ".join(problems))


def results_header(model_info: dict, cfg: RulerConfig, prov: dict) -> dict:
    """A results file before its first record: kind, run id, model, config, provenance, the planned (task, length)
    pairs and ``status: running`` (the native and lm-eval backends write the same header)."""
    return {
        "kind": "ruler",
        # the store keys a run on its header: two runs with the same settings started within one second (a resume
        # right after a kill) are still two runs
        "run_id": uuid.uuid4().hex,
        "status": "running",
        "planned": [{"task": t, "seq_len": n} for n in cfg.lengths for t in cfg.tasks],
        "hylo_bench_version": hylo_bench.__version__,
        "git_sha": prov["git_sha"],
        "created_utc": utc_now(),
        "model": {k: model_info[k] for k in MODEL_INFO_KEYS},
        "tokenizer_hash": prov["tokenizer_hash"],
        "seed": cfg.seed,
        "samples_per_task": cfg.samples,
        "chat_template": cfg.chat_template,
        "flavor": cfg.flavor,
        "haystack_sha256": prov["haystack_sha256"],
        "provenance": prov,
        "config": cfg.to_dict(),
        "records": [],
        "mean": {},
        "avg": None,
        "weighted_avg_inc": None,
        "weighted_avg_dec": None,
    }


def _record(task: str, length: int, seed: int, samples: list[dict], predictions: list[str],
            strip_think: bool = False, flavor: str = "nvidia") -> dict:
    agg = task_score(task, predictions, [s["outputs"] for s in samples], flavor=flavor, strip_think=strip_think)
    prompt_tokens = [s["prompt_tokens"] for s in samples]
    record = {
        "task": task,
        "seq_len": length,
        "score": agg["score"],
        "n": agg["n"],
        "seed": seed,
        "nulls": agg["nulls"],
        "prompt_tokens_mean": statistics.fmean(prompt_tokens),
        "prompt_tokens_min": min(prompt_tokens),
        "prompt_tokens_max": max(prompt_tokens),
        "flavor": flavor,
        "generator_version": GENERATOR_VERSION,
    }
    if "score_by_flavor" in agg:
        record["score_by_flavor"] = agg["score_by_flavor"]
    return record


def length_means(records: list[dict]) -> dict[str, float]:
    """``{"<L>": mean score over the tasks scored at length L}`` of a results file's records."""
    lengths = sorted({r["seq_len"] for r in records})
    return {str(n): mean_score(r["score"] for r in records if r["seq_len"] == n) for n in lengths}


@dataclasses.dataclass(kw_only=True, slots=True)
class Shard:
    """This process's share of a multi-process run (:mod:`hylo_bench.tasks.ruler.parallel`).

    Attributes:
        rank: 0 ... world_size - 1; rank 0 generates the samples, merges the predictions, scores and writes.
        world_size: number of processes; each decodes every world_size-th missing sample.
        barrier: blocks until every process has called it (``torch.distributed.barrier``).
    """

    rank: int
    world_size: int
    barrier: Callable[[], None]

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")


SINGLE = Shard(rank=0, world_size=1, barrier=lambda: None)


def _task_predictions(
    decode: Decoder, tokenizer: Any, samples: list[dict], task: str, path: Path, cfg: RulerConfig, shard: Shard,
    advance: Callable[[int], None], encoder: PromptEncoder | None = None, lookahead: Sequence[str] = (),
) -> list[str] | None:
    """Predictions for ``samples`` in index order (rank 0; None on other ranks).

    Rank 0 first merges the stored predictions (``cfg.resume``) or deletes them; then every rank decodes its share
    of the missing samples, appending to its shard file after every batch; after a barrier rank 0 merges the
    shards into ``path``. ``lookahead``: as :func:`_predict`'s.
    """
    if shard.rank == 0:
        if cfg.resume:
            pred_store.consolidate(path, samples)
        else:
            pred_store.discard(path)
    shard.barrier()
    # the merged file only: a shard another worker is already appending to would make the todo lists differ
    done = pred_store.read_predictions(path, samples, shards=False)
    advance(len(done) if shard.rank == 0 else 0)
    own = pred_store.shard_path(path, shard.rank, shard.world_size)

    def on_batch(batch: list[dict], preds: list[str]) -> None:
        pred_store.append_predictions(own, [pred_store.prediction_row(s, p) for s, p in zip(batch, preds)])
        fault_point("ruler:predictions_appended")
        advance(len(batch))

    todo = [s for s in samples if s["index"] not in done][shard.rank :: shard.world_size]
    _predict(decode, tokenizer, todo, cfg, get_task(task).max_gen_toks, on_batch, encoder, lookahead)
    shard.barrier()
    if shard.rank != 0:
        return None
    found = pred_store.read_predictions(path, samples)
    missing = [s["index"] for s in samples if s["index"] not in found]
    if missing:  # keep the shard files (evidence, and --resume can reuse what they hold)
        files = {p.name: len(p.read_text().splitlines()) for p in pred_store.shard_files(path)}
        raise AssertionError(f"{path}: no prediction for samples {missing[:10]} after the barrier; shard files "
                             f"(rows): {files}")
    merged = pred_store.consolidate(path, samples)
    advance(len(merged) - len(done) - len(todo))
    return [merged[s["index"]] for s in samples]


def _samples(task: str, length: int, tokenizer: Any, cfg: RulerConfig, haystack_text: str, tok_hash: str,
             shard: Shard, on_sample: Callable[[], None]) -> list[dict]:
    """The (task, length) samples; rank 0 generates and caches them before the other ranks read the cache."""

    def load() -> list[dict]:
        return load_or_generate(
            task, tokenizer, length, cfg.samples, seed=cfg.seed, haystack_text=haystack_text,
            chat_template=cfg.chat_template, cache_dir=Path(cfg.results_dir) / "cache", tok_hash=tok_hash,
            on_sample=on_sample, flavor=cfg.flavor, qa_path=cfg.qa_path(task),
        )

    samples = load() if shard.rank == 0 else None
    shard.barrier()
    return samples if samples is not None else load()


def evaluate_model(
    model: Any, tokenizer: Any, model_info: dict, cfg: RulerConfig, *, console: Console | None = None,
    shard: Shard = SINGLE, on_result: OnResult | None = None,
) -> dict | None:
    """Run RULER on a loaded model: for each length, each task, generate/reuse samples, decode, score, save.

    Every batch's predictions are appended to ``results_dir/predictions/<key>.jsonl``
    (:mod:`hylo_bench.tasks.ruler.predictions`); with ``cfg.resume`` the stored ones are reused and only the
    missing samples reach the model.

    Args:
        model: HF-style causal LM with ``generate`` (put in eval mode here).
        tokenizer: the model's HF tokenizer (sizes the prompts).
        model_info: ``name, path, hash, layout, kind`` as returned by ``load_model``.
        cfg: run configuration.
        console: rich console for the progress bar (default: stderr).
        shard: this process's share when several processes run the same config (one process by default).
        on_result: called on rank 0 with ``(results doc, results path)`` after every (task, length) is scored
            (the CLI: the results store); None writes the results file alone.

    Returns:
        On rank 0: ``{"model": name, "flavor": str, "scores": {task: {"<L>": score}}, "mean": {"<L>": score},
        "avg", "weighted_avg_inc", "weighted_avg_dec", "results_path": str, "engine_stats": dict or None}``,
        scores 0-100 (``engine_stats``: the native engine's continuous batching, summed over the run:
        :class:`hylo_bench.decode.batching.BatchStats` as a dict, seconds of prefill and of decode; None for other
        decoders and batch size 1); mean = unweighted
        mean over the tasks run at that length; avg / wAvg (inc) / wAvg (dec) = plain and length-rank-weighted
        means of ``mean`` (:func:`hylo_bench.tasks.ruler.scoring.weighted_averages`). The results JSON holds the
        same plus ``provenance`` and one record per (task, length). On other ranks: None.

    Raises:
        ValueError: ``model_info`` lacks a key, or a length is too small for a task.
    """
    missing = [k for k in MODEL_INFO_KEYS if k not in model_info]
    if missing:
        raise ValueError(f"model_info lacks {missing}; load_model must return {MODEL_INFO_KEYS}")
    haystack_text = read_haystack_text(cfg.haystack_path)
    tok_hash = tokenizer_hash(tokenizer)
    check_lengths(cfg.lengths, model, cfg.beyond_context)
    check_sizing(cfg, tokenizer, haystack_text, tok_hash)
    results_dir = Path(cfg.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    lead = shard.rank == 0
    prov = provenance(model, model_info, cfg, tok_hash, haystack_text, shard) if lead else {}
    doc = results_header(model_info, cfg, prov) if lead else {}
    path = results_path(results_dir, str(model_info["name"])) if lead else None
    if lead:
        atomic_write_json(path, doc)  # the claimed file holds the header from the start, never an empty file
    if hasattr(model, "eval"):
        model.eval()
    decode = make_decoder(model, tokenizer, cfg.engine, cfg.batch_size, cfg.prefill_chunk, cfg.prefix_sharing)
    scores: dict[str, dict[str, float]] = {}
    encoder = PromptEncoder(tokenizer, cfg.chat_template, encode_workers())
    plan = [(length, task) for length in cfg.lengths for task in cfg.tasks]
    first_call = prompts_per_call(decode, cfg)  # prompts _predict's first batch takes
    with _progress(console, disable=not lead) as progress, encoder:
        bar = progress.add_task("ruler", total=len(plan) * cfg.samples)

        def load(length: int, task: str) -> list[dict]:
            gen_bar = progress.add_task(f"  samples {task} @ {length}", total=cfg.samples)
            samples = _samples(task, length, tokenizer, cfg, haystack_text, tok_hash, shard,
                               lambda: progress.advance(gen_bar))
            progress.remove_task(gen_bar)
            return samples

        upcoming = load(*plan[0]) if plan else []
        for j, (length, task) in enumerate(plan):
            progress.update(bar, description=f"{task} @ {length}")
            samples = upcoming
            # the next (task, length)'s first prompts are tokenised while this one decodes (every rank loads the
            # next samples here, in the same order, so the sample cache's barrier still pairs up)
            upcoming = load(*plan[j + 1]) if j + 1 < len(plan) else []
            lookahead = [s["prompt"] for s in upcoming[shard.rank :: shard.world_size][:first_call]]
            data_hash = load_qa(task, cfg.qa_path(task)).sha256 if task in QA_SOURCES else text_hash(haystack_text)
            pred_path = pred_store.predictions_path(
                results_dir, task=task, length_tokens=length, model_hash=str(model_info["hash"]),
                dtype=param_dtype(model), tok_hash=tok_hash, data_hash=data_hash, seed=cfg.seed,
                flavor=cfg.flavor, chat_template=cfg.chat_template, max_gen_toks=get_task(task).max_gen_toks,
            )
            preds = _task_predictions(decode, tokenizer, samples, task, pred_path, cfg, shard,
                                      lambda k: progress.advance(bar, k), encoder, lookahead)
            if not lead:
                continue
            record = _record(task, length, cfg.seed, samples, preds, cfg.strip_think, cfg.flavor)
            doc["records"].append(record)
            doc["mean"] = length_means(doc["records"])
            doc.update(weighted_averages(doc["mean"]))
            if len(doc["records"]) == len(doc["planned"]):
                doc["status"] = "complete"
            atomic_write_json(path, doc)
            fault_point("ruler:results_written")
            if on_result is not None:
                on_result(doc, path)
            fault_point("ruler:stored")
            scores.setdefault(task, {})[str(length)] = record["score"]
    if not lead:
        return None
    stats = getattr(decode, "stats", None)  # the native engine's continuous batching (batch size > 1)
    return {"model": model_info["name"], "flavor": cfg.flavor, "backend": "native", "scores": scores,
            "mean": doc["mean"],
            **{k: doc[k] for k in SUMMARY_KEYS}, "results_path": str(path),
            "engine_stats": stats.to_dict() if stats is not None and stats.requests else None}


def render_tables(summary: dict) -> list[Table]:
    """One rich table per length (a row per task, score 0-100, and a final ``mean`` row), then one summary row
    in RULER's README layout: the per-length means, Avg., wAvg. (inc) and wAvg. (dec).

    Args:
        summary: the dict returned by :func:`evaluate_model` / :func:`run`.
    """
    tables = []
    for length, mean in summary["mean"].items():
        table = Table(title=f"RULER {summary['model']} @ {length} tokens")
        table.add_column("task")
        table.add_column("score", justify="right")
        for task, by_length in summary["scores"].items():
            if length in by_length:
                table.add_row(task, f"{by_length[length]:.2f}")
        table.add_section()
        table.add_row("mean", f"{mean:.2f}", style="bold")
        tables.append(table)
    if summary["mean"]:
        backend = " via lm-eval" if summary.get("backend") == "lm-eval" else ""
        table = Table(title=f"RULER {summary['model']} ({summary.get('flavor', 'nvidia')} flavor{backend})")
        lengths = sorted(summary["mean"], key=int)
        for col in [*lengths, "Avg.", "wAvg. (inc)", "wAvg. (dec)"]:
            table.add_column(col, justify="right")
        table.add_row(*[f"{summary['mean'][n]:.2f}" for n in lengths],
                      *[f"{summary[k]:.2f}" for k in SUMMARY_KEYS])
        tables.append(table)
    return tables
