"""lm-eval 0.4.13 bridge: the ``hylo`` model class (HyLo hybrids and any transformers causal LM) and the
``hylo-bench eval`` runner (lm-eval's own tasks, 0-shot by default, optional local JSONL data, results saved as
lm-eval writes them, as our summary JSON and in the results store).

Spec: docs/eval.md. Public API: ``HyLoLM``, ``EvalConfig``, ``run``, ``evaluate_lm``,
``local_task_dir``, ``scores_from_results``, ``render_table``, ``PAPER_TASKS``.
lm-eval's own CLI with ``hylo`` registered: ``hylo-lm-eval`` (:mod:`hylo_bench.tasks.lm_eval_cli`).

Why ``HFLM`` is subclassed rather than ``LM`` implemented anew: HFLM accepts a built ``nn.Module`` and then only
needs ``.config``, ``.device``, ``.tie_weights()`` and a forward returning ``.logits`` -- ``HyLoForCausalLM`` has
all of them (its ``tie_weights`` leaves the untied ``lm_head`` alone). We inherit lm-eval's own tokenisation, BOS
and empty-context handling, length-sorted batching, the one-token logits cache, stop strings and rolling windows,
so scores match ``--model hf`` for plain transformers. Loglikelihood batches are right-padded (positions before a
pad never see it in causal or recurrent layers, so batched == unbatched); generation batches are left-padded with an
attention mask, which ``HyLoModel`` turns into a per-token mask that keeps pads out of the MLA keys and the GDN /
Mamba-2 states (tested: batched == unbatched).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import hylo_bench
from hylo_bench.config.device import parse_dtype
from hylo_bench.config.units import LM_EVAL_PERCENT_METRICS
from hylo_bench.io_utils import OnResult, atomic_write_json, check_output_path, git_sha, package_version, utc_now
from hylo_bench.tasks.provenance import software_versions, tokenizer_hash
from hylo_bench.tasks.workers import launched_world_size, run_workers

logger = logging.getLogger(__name__)

# The paper's short-context suite (HyLo §4.1): seven 0-shot commonsense tasks + GSM8K, lm-eval task names.
PAPER_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa", "race", "winogrande", "gsm8k")
COMMONSENSE_TASKS = PAPER_TASKS[:-1]
# Task YAMLs inside lm_eval/tasks/ for the tasks above (saves indexing all ~14k YAMLs for --data-dir runs).
_KNOWN_YAMLS = {
    "arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml", "hellaswag": "hellaswag/hellaswag.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml", "piqa": "piqa/piqa.yaml", "race": "race/race.yaml",
    "winogrande": "winogrande/default.yaml", "gsm8k": "gsm8k/gsm8k.yaml",
}
_SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
DEFAULT_MAX_LENGTH = None
"""``max_length`` default: None = the model's own context, resolved as lm-eval's ``hf`` model does
(``lm_eval.models.utils.resolve_max_length``: the config's ``max_position_embeddings`` / ``n_positions`` /
``n_ctx``, then the tokenizer's ``model_max_length``, then 2048)."""
@register_model("hylo")
class HyLoLM(HFLM):
    """lm-eval model ``hylo``: HFLM around a model loaded with :func:`hylo_bench.models.loading.load_model`.

    ``lm_eval``'s ``model_args`` map onto the arguments: ``pretrained=demo|DIR|org/name,dtype=bfloat16,
    max_length=8192,max_gen_toks=256,add_bos_token=True``; ``batch_size`` (int or ``auto``), ``max_batch_size``
    and ``device`` come from lm-eval's own flags.

    Args:
        pretrained: model spec for ``load_model`` (``demo``, a local directory or a hub id), or a built
            ``nn.Module`` (then ``tokenizer`` is required).
        tokenizer: HF tokenizer for a built module; ignored for a spec (the checkpoint's tokenizer is used).
        device: ``cpu`` / ``cuda`` / ``cuda:N`` (default: cuda when available). Ignored for a built module.
        dtype: ``auto`` (bf16 on GPU, fp32 on CPU) or a dtype name. Ignored for a built module.
        batch_size: requests per forward (int) or ``auto`` / ``auto:N`` (probes with ``max_length`` tokens).
        max_batch_size: upper bound for ``auto``.
        max_length: context window in tokens; longer requests are left-truncated by HFLM (and
            ``loglikelihood_rolling`` windows are this long). Default None: the model's own context, as lm-eval's
            ``hf`` model takes it (``max_position_embeddings`` of the model's config).
        max_gen_toks: generation budget in tokens when a task does not set one (HFLM default 256).
        add_bos_token: prepend BOS (None = the tokenizer's default: Llama-3 adds it, Qwen3 has none).
        engine: greedy ``generate_until`` through ``generate`` (transformers, batched, left-padded), ``native``
            (the serving engine: prefill in chunks, CUDA-graph decode, a HyLo model's requests continuously batched
            over ``batch_size`` slots, same tokens as one at a time; much faster per token
            than ``generate`` for a HyLo model on CUDA), ``static`` (``generate`` over a preallocated
            ``StaticCache``, transformer models: :class:`hylo_bench.decode.greedy.StaticCaches`) or ``auto``
            (native for a HyLo model on CUDA, generate otherwise; :func:`hylo_bench.decode.greedy.resolve_engine`).
            Sampling requests always use ``generate``.
        **kwargs: passed to ``HFLM`` (e.g. ``logits_cache``, ``softmax_dtype``, ``prefix_token_id``).

    Raises:
        ValueError: a built module without a tokenizer, a bad ``dtype``, or ``cuda`` without a GPU.
        FileNotFoundError: an unresolvable ``pretrained`` spec (from ``load_model``).
    """

    def __init__(self, pretrained: Any = "demo", tokenizer: Any = None, *, device: str | None = None,
                 dtype: str | torch.dtype | None = None, batch_size: int | str = 1, max_batch_size: int = 64,
                 max_length: int | None = DEFAULT_MAX_LENGTH, max_gen_toks: int = 256,
                 add_bos_token: bool | None = None,
                 engine: str = "auto", **kwargs: Any) -> None:
        from hylo_bench.decode.greedy import ENGINES
        from hylo_bench.models.loading import layout_name, load_model

        if engine not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")

        kwargs.pop("backend", None)
        self._loaded: Any = None
        if isinstance(pretrained, str):
            if device and str(device).startswith("cuda") and not torch.cuda.is_available():
                raise ValueError(f"device: {device!r} requested but no CUDA GPU is visible (lm_eval's CLI defaults to "
                                 "cuda); pass --device cpu")
            model, tokenizer, info = load_model(pretrained, device=device, dtype=parse_dtype(dtype))
        else:
            if tokenizer is None:
                raise ValueError("HyLoLM(pretrained=<nn.Module>) needs tokenizer=<HF tokenizer>; or pass "
                                 "pretrained='demo' / a checkpoint directory / a hub id")
            model = pretrained
            info = {"name": type(model).__name__, "path": None, "hash": None, "layout": layout_name(model),
                    "kind": "hybrid" if hasattr(model.config, "mixer_types") else "transformer"}
        if tokenizer.pad_token_id is None:  # HFLM pads generation batches with it
            tokenizer.pad_token = tokenizer.eos_token
        self.model_info = info
        self._max_gen_toks = int(max_gen_toks)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if isinstance(pretrained, str) and not distributed:
            # HFLM's loading path with its documented hooks (_get_config / _create_model, as lm-eval's own
            # MambaLMWrapper) handing over the model loaded above: no "pretrained is not of type str" warning. Under a
            # process group the built module is passed instead (HFLM would set up accelerate's own ranks and devices).
            self._loaded = model
            super().__init__(pretrained=pretrained, tokenizer=tokenizer, backend="causal", device=str(model.device),
                             batch_size=batch_size, max_batch_size=int(max_batch_size),
                             max_length=None if max_length is None else int(max_length), add_bos_token=add_bos_token,
                             **kwargs)
        else:
            super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=batch_size,
                             max_batch_size=int(max_batch_size),
                             max_length=None if max_length is None else int(max_length), add_bos_token=add_bos_token,
                             **kwargs)
        if isinstance(pretrained, str):
            # HFLM left-truncates every request to max_length itself; the tokenizer's own model_max_length (a
            # loading default) would only add a false "indexing errors" warning for longer documents
            self.tokenizer.model_max_length = max(int(self.max_length),
                                                  int(getattr(self.tokenizer, "model_max_length", 0) or 0))
        from hylo_bench.decode.greedy import resolve_engine

        self.engine = resolve_engine(self.model, engine)
        self._native: Any = None  # NativeDecoder, built on the first native generation
        self._static: Any = None
        if self.engine == "static":
            from hylo_bench.decode.greedy import StaticCaches

            self._static = StaticCaches(self.model)  # raises for a HyLo model
        logger.info("generate_until engine: %s", self.engine)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # data parallel: lm-eval shards the requests by rank and gathers the results on rank 0
            self._rank, self._world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens) of a log-likelihood request, split at a token boundary.

        As lm-eval's causal ``_encode_pair``: trailing spaces of the context move to the continuation and the
        whole text is encoded once (``tok_encode``: BOS as configured). The split is then taken from the
        tokenizer's character offsets: the context keeps the tokens that end at or before the context's last
        character, the continuation gets the rest, including a token that straddles the boundary ("hello wor" +
        "ld" scores the token " world"). Where the context alone tokenizes as a prefix of the whole (nearly every
        request) this is exactly lm-eval's split; lm-eval instead takes as many tokens as the context alone has,
        which for a split inside a token leaves the continuation empty (a bare AssertionError, or a choice that
        cannot win in a multiple-choice task). A context left without tokens (the boundary inside the first
        token, no BOS) gets lm-eval's ``prefix_token_id``.

        Raises:
            ValueError: an empty continuation, or a split inside a token with a tokenizer that gives no offsets
                (a slow tokenizer): lm-eval's split would score nothing there.
        """
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces > 0:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        if not continuation:
            raise ValueError(f"lm-eval request with an empty continuation (context ends {context[-40:]!r})")
        whole = self.tok_encode(context + continuation)
        try:
            enc = self.tokenizer(context + continuation, add_special_tokens=False, return_offsets_mapping=True)
            plain, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        except (NotImplementedError, KeyError):  # slow tokenizers have no offsets
            plain, offsets = None, None
        lead = len(whole) - len(plain) if plain is not None else -1
        if plain is None or lead < 0 or whole[lead:] != plain:
            context_enc = self.tok_encode(context)
            if whole[len(context_enc):] and whole[:len(context_enc)] == context_enc:
                return context_enc, whole[len(context_enc):]
            raise ValueError(f"cannot split {context[-30:]!r} + {continuation[:30]!r} at a token boundary: the "
                             "split falls inside a token and this tokenizer gives no character offsets")
        boundary = len(context)
        k = next((i for i, (_, end) in enumerate(offsets) if end > boundary), len(plain))
        context_enc, continuation_enc = whole[: lead + k], whole[lead + k:]
        if not context_enc:
            context_enc = [self.prefix_token_id]
        return context_enc, continuation_enc

    def _get_config(self, pretrained: str, **kwargs: Any) -> None:
        """HFLM hook: the config of the model loaded in ``__init__`` (HFLM would read ``config.json`` again)."""
        if self._loaded is None:
            return super()._get_config(pretrained, **kwargs)
        self._config = self._loaded.config

    def _create_model(self, pretrained: str, **kwargs: Any) -> None:
        """HFLM hook: the model loaded in ``__init__`` by ``load_model`` (HyLo hybrid or transformers)."""
        if self._loaded is None:
            return super()._create_model(pretrained, **kwargs)
        self._model = self._loaded

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` (a 0-d count or [n]) over the ranks along dim 0, on CPU through the process
        group (gloo carries CPU tensors; lm-eval exchanges only request counts and batch sizes this way)."""
        if self.world_size <= 1:
            return tensor
        t = tensor.detach().cpu().reshape(-1)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, t)
        return torch.cat(parts).to(tensor.device)

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    def _detect_batch_size(self, requests: Any = None, pos: int = 0) -> int:
        """HFLM's OOM-halving probe, except for generation with the native engine (``requests`` None: HFLM would
        run 5 forwards of ``max_batch_size`` x ``max_length`` tokens): 1 (give an int ``batch_size`` for continuous
        batching)."""
        if requests is None and self.engine == "native":
            return 1
        return super()._detect_batch_size(requests, pos)

    def _native_generate(self, context: torch.Tensor, attention_mask: torch.Tensor | None, max_length: int,
                         stop: list[str]) -> torch.Tensor:
        """Greedy continuations of the left-padded ``context`` [B, T_ctx] through the native engine: a HyLo
        model's rows continuously batched over ``batch_size`` slots (an int ``batch_size``; else B), with the same
        tokens as row by row (:func:`hylo_bench.decode.batching.continuous_generate`).

        Each row's prompt is its unpadded tokens (``attention_mask`` [B, T_ctx], 1 = real token; all real when
        absent). A row stops at EOS, after ``max_length`` - T_ctx tokens, or once its decoded text holds a stop
        string (that token kept, as ``stop_sequences_criteria`` does for ``generate``).

        Returns:
            [B, T_ctx + n] int64 on ``context``'s device: the context rows, then each continuation right-padded
            with ``pad_token_id`` to the longest (HFLM keeps ``[T_ctx:]`` and cuts at the stop strings).
        """
        from hylo_bench.decode.greedy import NativeDecoder

        if self._native is None:
            slots = self.batch_size_per_gpu if isinstance(self.batch_size_per_gpu, int) else context.shape[0]
            self._native = NativeDecoder(self.model, self.tokenizer, batch_size=max(1, slots))
        budget = max(1, max_length - context.shape[1])
        mask = attention_mask if attention_mask is not None else torch.ones_like(context)
        stops = [s for s in stop if s]

        def should_stop(tokens: list[int]) -> bool:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            return any(s in text for s in stops)

        prompts = [[t for t, keep in zip(row, keep_row) if keep] for row, keep_row in zip(context.tolist(),
                                                                                          mask.tolist())]
        conts = self._native.tokens_many(prompts, budget, should_stop if stops else None)
        width = max(1, max(len(c) for c in conts))
        pad = self.tokenizer.pad_token_id
        out = torch.full((context.shape[0], width), pad, dtype=context.dtype)
        for row, cont in enumerate(conts):
            out[row, : len(cont)] = torch.tensor(cont, dtype=context.dtype)
        return torch.cat([context, out.to(context.device)], dim=1)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        """Token ids [B, T_ctx + new] continuing the left-padded ``context`` [B, T_ctx].

        As HFLM's, except that the budget goes to ``generate`` as ``max_new_tokens`` = ``max_length`` - T_ctx: a
        checkpoint's ``generation_config.max_new_tokens`` would otherwise take precedence over ``max_length``.
        Greedy unless the task asks for sampling; stops at the stop strings (and EOS, via ``generate``). With
        ``engine == "native"`` greedy requests go through :meth:`_native_generate` instead; with ``"static"``
        ``generate`` runs over a preallocated ``StaticCache`` (sampling requests too).
        """
        from lm_eval.models.utils_hf import stop_sequences_criteria

        temperature = generation_kwargs.setdefault("temperature", 0.0)
        if temperature == 0.0 and generation_kwargs.get("do_sample") is None:
            generation_kwargs["do_sample"] = False
        if self.engine == "native" and generation_kwargs.get("do_sample") is False:
            return self._native_generate(context, generation_kwargs.get("attention_mask"), max_length, stop)
        if generation_kwargs.get("do_sample") is False and temperature == 0.0:
            generation_kwargs.pop("temperature")
        criteria = stop_sequences_criteria(self.tokenizer, stop, context.shape[1], context.shape[0])
        new_tokens = max(1, max_length - context.shape[1])
        with torch.inference_mode():  # the static cache's tensors are made and reset in inference mode
            if self._static is not None:
                generation_kwargs["past_key_values"] = self._static.get(context.shape[0],
                                                                        context.shape[1] + new_tokens)
            with torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                enabled=self.mixed_precision_dtype is not None):
                return self.model.generate(input_ids=context, max_new_tokens=new_tokens, stopping_criteria=criteria,
                                           pad_token_id=self.tokenizer.pad_token_id, use_cache=True,
                                           **generation_kwargs)

    def get_model_info(self) -> dict:
        """Parameters, dtype and our checkpoint identity; no Hub query (HFLM's asks the Hub for a SHA)."""
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype), "model_revision": None,
                "model_sha": self.model_info.get("hash") or "", "hylo_model": dict(self.model_info)}


@dataclasses.dataclass(kw_only=True, slots=True)
class EvalConfig:
    """One ``hylo-bench eval`` run.

    Attributes:
        model: model spec for ``load_model`` (``demo``, a local directory or a hub id).
        tasks: lm-eval task names, e.g. ``list(PAPER_TASKS)``.
        output_dir: results folder: ``eval-<model>-<stamp>.json`` (our summary), ``lm-eval/<model>/results_*.json``
            and ``samples_*.jsonl`` (lm-eval's own files); ``hylo-bench eval``'s results store defaults to
            ``output_dir/hylo_bench.sqlite`` ($HYLO_BENCH_DB overrides).
        num_fewshot: shots for every task; 0 is the paper's protocol (GSM8K's YAML default is 5).
        limit: first N docs per task (int) or a fraction (float < 1); None = all.
        batch_size: int or ``auto`` / ``auto:N``.
        max_batch_size: upper bound for ``auto``.
        max_length: context window in tokens; None = the model's own (see ``HyLoLM``).
        data_dir: read ``DATA_DIR/<task>/<split>.jsonl`` instead of the Hub (offline machines).
        device: ``cpu`` / ``cuda`` (default: cuda when available).
        dtype: ``auto`` or a dtype name.
        seed: lm-eval's ``random_seed``; numpy/torch/fewshot seeds stay at lm-eval's 1234.
        log_samples: also write lm-eval's per-sample JSONL files.
        engine: ``generate_until`` engine of ``HyLoLM`` (``auto`` | ``generate`` | ``native``).
        devices: worker processes (one per GPU, ``cuda:0..N-1``; all on CPU with ``device="cpu"``); lm-eval shards
            the requests over them and rank 0 gathers and saves. Under ``torchrun`` the launched processes are the
            workers.
    """

    model: str
    tasks: list[str]
    output_dir: str | Path
    num_fewshot: int = 0
    limit: int | float | None = None
    batch_size: int | str = 1
    max_batch_size: int = 64
    max_length: int | None = DEFAULT_MAX_LENGTH
    data_dir: str | Path | None = None
    device: str | None = None
    dtype: str = "auto"
    seed: int = 0
    log_samples: bool = True
    engine: str = "auto"
    devices: int = 1

    def __post_init__(self) -> None:
        from hylo_bench.decode.greedy import ENGINES

        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {self.engine!r}")
        if self.devices < 1:
            raise ValueError(f"devices: expected >= 1 worker processes, got {self.devices}")
        if not self.tasks:
            raise ValueError(f"tasks: expected at least one lm-eval task name, e.g. {','.join(PAPER_TASKS)}")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"tasks has duplicates: {self.tasks!r}")
        if self.num_fewshot < 0:
            raise ValueError(f"num_fewshot: expected >= 0, got {self.num_fewshot}")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"limit: expected a positive count or fraction, got {self.limit}")
        bs = str(self.batch_size)
        if not (bs.isdigit() and int(bs) >= 1) and not re.fullmatch(r"auto(:\d+(\.\d+)?)?", bs):
            raise ValueError(f"batch_size: expected a positive int, 'auto' or 'auto:N', got {self.batch_size!r}")
        if self.max_length is not None and self.max_length < 16:
            raise ValueError(f"max_length: expected >= 16 tokens, got {self.max_length}")
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            raise ValueError(f"data_dir: {str(self.data_dir)!r} is not a directory; expected DIR/<task>/<split>.jsonl")
        check_output_path(self.output_dir, "--output-dir", is_dir=True)
        parse_dtype(self.dtype)

    def to_dict(self) -> dict:
        """JSON-ready copy (paths as strings)."""
        out = dataclasses.asdict(self)
        out["output_dir"] = str(self.output_dir)
        out["data_dir"] = None if self.data_dir is None else str(self.data_dir)
        out["batch_size"] = str(self.batch_size)
        return out


def _task_yaml(task: str) -> Path:
    """The registered YAML of ``task`` in lm-eval (known tasks by table, others through a full TaskManager)."""
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    if task in _KNOWN_YAMLS and (root / _KNOWN_YAMLS[task]).is_file():
        return root / _KNOWN_YAMLS[task]
    entry = default_task_manager().task_index.get(task)
    if entry is None or entry.yaml_path is None or str(entry.kind) not in ("Kind.TASK", "TASK", "task"):
        raise ValueError(f"--data-dir: {task!r} is not a single lm-eval task with a YAML (groups and tags cannot be "
                         f"read from local files; list their member tasks instead)")
    return Path(entry.yaml_path)


def local_task_dir(tasks: list[str], data_dir: str | Path, out_dir: str | Path, num_fewshot: int) -> Path:
    """Write one YAML per task into ``out_dir`` that includes lm-eval's YAML and reads local JSONL files.

    Each YAML keeps the task's name, prompts, metrics and ``!function`` helpers (``include:`` of the original)
    and overrides ``dataset_path: json``, ``dataset_name: null`` and ``dataset_kwargs.data_files``
    with ``DATA_DIR/<task>/<split>.jsonl`` for every split the task names that exists there; absent optional
    splits are set to null.

    Args:
        tasks: lm-eval task names.
        data_dir: folder with ``<task>/<split>.jsonl`` (rows with the columns of the task's Hub dataset).
        out_dir: folder for the generated YAMLs (pass it to ``TaskManager(include_path=..., include_defaults=False)``).
        num_fewshot: shots that will be requested; > 0 makes the few-shot split required.

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: the evaluated split (``test_split``, else ``validation_split``) or, with
            ``num_fewshot > 0``, the few-shot split is missing; the message names the expected file.
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    data_dir, out_dir = Path(data_dir).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        src = _task_yaml(task)
        cfg = load_yaml(src, resolve_func=False)
        splits = {k: cfg.get(k) for k in _SPLIT_KEYS}
        evaluated = splits["test_split"] or splits["validation_split"]
        fewshot = splits["fewshot_split"] or splits["training_split"] or splits["validation_split"]
        required = {evaluated} | ({fewshot} if num_fewshot > 0 and fewshot else set())
        files, overrides = {}, {}
        for key, split in splits.items():
            if not split:
                continue
            path = data_dir / task / f"{split}.jsonl"
            if path.is_file():
                files[split] = str(path)
            elif split in required:
                role = "evaluated" if split == evaluated else "few-shot"
                raise FileNotFoundError(f"{task}: missing {path} (the {role} split {split!r}); write the rows of "
                                        f"the Hub dataset {cfg.get('dataset_path')}"
                                        f"{'/' + cfg['dataset_name'] if cfg.get('dataset_name') else ''} split "
                                        f"{split!r} there as JSON lines, with the Hub dataset's columns")
            else:
                overrides[key] = None
        doc = {"include": str(src), "task": task, "tag": [], "dataset_path": "json", "dataset_name": None,
               "dataset_kwargs": {"data_files": files}, **overrides}
        if num_fewshot == 0 and "fewshot_split" not in overrides and splits["fewshot_split"] not in files:
            doc["fewshot_split"] = None
        (out_dir / f"{task}.yaml").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")  # JSON is YAML
    return out_dir


def scores_from_results(results: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` from lm-eval's results dict; accuracy-like metrics on a 0-100 scale.

    Keys: ``acc``, ``acc_norm`` (filter ``none`` dropped), ``exact_match,strict-match``,
    ``exact_match,flexible-extract``; stderr entries are left out (they stay in lm-eval's file).
    """
    scores: dict[str, dict[str, float]] = {}
    for task, res in results["results"].items():
        for key, value in res.items():
            name, _, filt = key.partition(",")
            if not filt or "_stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            scale = 100.0 if name in LM_EVAL_PERCENT_METRICS else 1.0
            scores.setdefault(task, {})[name if filt == "none" else key] = float(value) * scale
    return scores


def evaluate_lm(lm: Any, cfg: EvalConfig, task_manager: Any = None) -> dict:
    """Run lm-eval's ``simple_evaluate`` on an LM instance with ``cfg``'s tasks, shots, limit and seed.

    Args:
        lm: an ``lm_eval.api.model.LM`` (usually ``HyLoLM``).
        cfg: run configuration (``model`` and ``output_dir`` are not used here).
        task_manager: a ready ``TaskManager``; default: local YAMLs for ``cfg.data_dir``, else lm-eval's.

    Returns:
        lm-eval's results dict (``results``, ``configs``, ``n-shot``, ``n-samples``, ``samples``, ``config`` ...).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="hylo-lmeval-tasks-") as tmp:
        if task_manager is None:
            if cfg.data_dir is not None:
                local_task_dir(cfg.tasks, cfg.data_dir, tmp, cfg.num_fewshot)
                task_manager = TaskManager(include_path=tmp, include_defaults=False)
            else:
                task_manager = default_task_manager()
        with _quiet_git_probe():
            return simple_evaluate(model=lm, tasks=list(cfg.tasks), num_fewshot=cfg.num_fewshot, limit=cfg.limit,
                                   task_manager=task_manager, log_samples=cfg.log_samples, random_seed=cfg.seed,
                                   bootstrap_iters=100000)


@contextlib.contextmanager
def _quiet_git_probe():
    """Run ``simple_evaluate`` with lm-eval's git-hash probe made quiet outside a git checkout.

    lm-eval 0.4.13 (``lm_eval.loggers.utils.get_git_commit_hash``, called by ``lm_eval.evaluator``) runs
    ``git describe --always`` with the terminal's stderr, so every ``eval`` outside a checkout printed "fatal: not
    a git repository" (EleutherAI/lm-evaluation-harness#1691, #2625; no option turns the probe off). The
    replacement runs the same command with stderr captured and keeps its result (the same fallback to
    ``get_commit_from_path(cwd)``); the original is put back on exit. The one patch of lm-eval internals here.
    """
    import subprocess

    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_commit_hash() -> str | None:
        try:
            out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
            return out.stdout.strip()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    original = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = git_commit_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"


def _save(res: dict, lm: HyLoLM, cfg: EvalConfig) -> tuple[Path, Path]:
    """Write lm-eval's results (and samples) with its EvaluationTracker, then our summary; return both paths."""
    from lm_eval.loggers import EvaluationTracker

    out = Path(cfg.output_dir)
    tracker = EvaluationTracker(output_path=str(out / "lm-eval"))
    # the model's name as `hylo-bench ruler` stores it ("demo-teacher" for demo), so the store matches the runs
    model_args = f"pretrained={lm.model_info['name']},dtype={cfg.dtype},max_length={lm.max_length}"
    tracker.general_config_tracker.log_experiment_args(model_source="hylo", model_args=model_args,
                                                       system_instruction=None, chat_template=None,
                                                       fewshot_as_multiturn=False)
    res["config"].update(model="hylo", model_args=model_args, batch_size=str(cfg.batch_size), device=str(lm.device),
                         hylo_model=lm.model_info, add_bos_token=lm.add_bos_token, apply_chat_template=False)
    samples = res.pop("samples", None)
    tracker.save_results_aggregated(results=res, samples=samples)
    for task, task_samples in (samples or {}).items():
        tracker.save_results_samples(task_name=task, samples=task_samples)
    lm_eval_path = out / "lm-eval" / tracker.general_config_tracker.model_name_sanitized / \
        f"results_{tracker.date_id}.json"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path, k = out / f"eval-{_safe(str(cfg.model))}-{stamp}.json", 1
    while path.exists():
        path, k = out / f"eval-{_safe(str(cfg.model))}-{stamp}-{k}.json", k + 1
    atomic_write_json(path, {
        "kind": "lm-eval-summary", "hylo_bench_version": hylo_bench.__version__, "git_sha": git_sha(),
        "created_utc": utc_now(), "model": lm.model_info,
        "config": cfg.to_dict(),
        "provenance": {**software_versions(), "lm_eval_version": res.get("lm_eval_version"),
                       "tokenizer_hash": tokenizer_hash(lm.tokenizer), "device": str(lm.device),
                       "param_dtype": str(next(lm.model.parameters()).dtype), "engine": lm.engine,
                       "add_bos_token": lm.add_bos_token, "apply_chat_template": False,
                       "max_gen_toks": lm.max_gen_toks},
        "lm_eval_version": res.get("lm_eval_version"), "n-shot": res.get("n-shot"),
        "n-samples": res.get("n-samples"), "versions": res.get("versions"), "scores": scores_from_results(res),
        "lm_eval_results": str(lm_eval_path)})
    return lm_eval_path, path


def run(cfg: EvalConfig, on_result: OnResult | None = None) -> dict | None:
    """Load ``cfg.model`` as ``HyLoLM``, evaluate ``cfg.tasks``, save every result file.

    With ``cfg.devices`` > 1, or under ``torchrun``, each worker process loads the model on its own device and
    evaluates its share of the requests (lm-eval's data parallelism); rank 0 gathers, scores and saves. Scores
    equal a one-process run's (tested on CPU). ``on_result(results, path)`` is called on rank 0 with lm-eval's
    results object once its file is written (the CLI: the results store; it must pickle to reach spawned
    workers); None writes the files alone.

    Returns:
        ``{"model": name, "scores": {task: {metric: value 0-100}}, "n_samples": {task: n}, "num_fewshot": {task: k},
        "results_path": our summary JSON, "lm_eval_results_path": lm-eval's results JSON}``; None on torchrun
        ranks other than 0.

    Raises:
        FileNotFoundError: unresolvable model, or a local data file missing (the path is named).
        ValueError: bad configuration values, ``devices`` disagreeing with torchrun's ``WORLD_SIZE``, or fewer
            GPUs than workers.
        torch.multiprocessing.ProcessRaisedException: a spawned worker failed (its traceback is in the message).
    """
    if cfg.devices == 1 and launched_world_size() == 1:
        return _evaluate_and_save(cfg, cfg.device, on_result)
    return run_workers(functools.partial(_evaluate_and_save_worker, cfg, on_result), cfg.devices, cfg.device)


def _evaluate_and_save_worker(cfg: EvalConfig, on_result: OnResult | None, device: str, rank: int,
                              world_size: int) -> dict | None:
    return _evaluate_and_save(cfg, device, on_result)  # HyLoLM reads rank and world size from the process group


def check_tasks(cfg: EvalConfig) -> Any:
    """Check ``cfg.tasks`` before a model is loaded: with ``data_dir``, every task's YAML and local files
    (:func:`local_task_dir`, into a temporary folder); else that lm-eval knows each name.

    Returns:
        The ``TaskManager`` that was built for the check (None with ``data_dir``), for :func:`evaluate_lm`.

    Raises:
        ValueError: an unknown task (with the closest known names), a group with ``data_dir``.
        FileNotFoundError: a local file a task needs is missing (the path named).
    """
    if cfg.data_dir is not None:
        with tempfile.TemporaryDirectory(prefix="hylo-lmeval-check-") as tmp:
            local_task_dir(cfg.tasks, cfg.data_dir, tmp, cfg.num_fewshot)
        return None
    import difflib

    manager = default_task_manager()
    known = set(manager.all_tasks)
    unknown = [t for t in cfg.tasks if t not in known]
    if unknown:
        hints = {t: difflib.get_close_matches(t, sorted(known), n=3) for t in unknown}
        shown = ", ".join(f"{t!r}" + (f" (closest: {', '.join(h)})" if h else "") for t, h in hints.items())
        raise ValueError(f"--tasks: {shown} {'is' if len(unknown) == 1 else 'are'} not a task, group or tag that "
                         f"lm-eval {package_version('lm_eval')} knows; `lm-eval ls tasks` lists them, e.g. "
                         f"{','.join(PAPER_TASKS)}")
    return manager


@functools.lru_cache(maxsize=1)
def default_task_manager() -> Any:
    """lm-eval's ``TaskManager`` over its own task YAMLs, built once per process (it indexes ~14k files)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def _evaluate_and_save(cfg: EvalConfig, device: str | None, on_result: OnResult | None = None) -> dict | None:
    manager = check_tasks(cfg)
    lm = HyLoLM(pretrained=cfg.model, device=device, dtype=cfg.dtype, batch_size=cfg.batch_size,
                max_batch_size=cfg.max_batch_size, max_length=cfg.max_length, engine=cfg.engine)
    try:
        res = evaluate_lm(lm, cfg, task_manager=manager)
    except ConnectionError as exc:  # datasets' error for a Hub dataset it cannot fetch (offline, no cache)
        raise ValueError(f"--tasks {','.join(cfg.tasks)}: lm-eval could not load a task's dataset from the Hugging "
                         f"Face Hub ({exc}); offline, pass --data-dir DIR with DIR/<task>/<split>.jsonl (the Hub "
                         f"dataset's columns), or run once with network access to fill the datasets cache") from None
    if res is None:  # lm-eval returns the results on rank 0 only
        return None
    lm_eval_path, path = _save(res, lm, cfg)
    if on_result is not None:
        on_result(json.loads(lm_eval_path.read_text(encoding="utf-8")), lm_eval_path)
    return {"model": lm.model_info["name"], "scores": scores_from_results(res),
            "n_samples": {t: v.get("effective") for t, v in res.get("n-samples", {}).items()},
            "num_fewshot": dict(res.get("n-shot", {})), "results_path": str(path),
            "lm_eval_results_path": str(lm_eval_path), "world_size": lm.world_size}


def render_table(summary: dict) -> Any:
    """A rich table of ``run``'s summary: one row per (task, metric), scores 0-100, plus the paper's commonsense
    average (mean of the seven tasks' ``acc``) when all seven ran. The acc/acc_norm choice per task is not stated
    by the paper (eval.md §5.2): both are listed."""
    from rich.table import Table

    table = Table(title=f"lm-eval {summary['model']}")
    for col, justify in (("task", "left"), ("metric", "left"), ("score", "right"), ("n", "right"), ("shots", "right")):
        table.add_column(col, justify=justify)
    for task, metrics in summary["scores"].items():
        for metric, value in metrics.items():
            table.add_row(task, metric, f"{value:.2f}", str(summary["n_samples"].get(task, "")),
                          str(summary["num_fewshot"].get(task, "")))
    if all(t in summary["scores"] for t in COMMONSENSE_TASKS):
        avg = sum(summary["scores"][t]["acc"] for t in COMMONSENSE_TASKS) / len(COMMONSENSE_TASKS)
        table.add_section()
        table.add_row("commonsense avg", "acc", f"{avg:.2f}", "", "", style="bold")
    return table
