"""Greedy decoding of RULER prompts: transformers ``generate()`` (batched, left-padded; with ``static`` over a
preallocated ``StaticCache``) or the native serving engine (:mod:`hylo_bench.decode.engine`, continuous batching
for HyLo models), all cut at the first EOS and decoded with ``skip_special_tokens=True``, so they give the same
text for the same greedy tokens.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)
ENGINES = ("auto", "generate", "static", "native")
PREFILL_CHUNK_TOKENS = 16384
"""Prefill chunk of the native engine for RULER and ``eval`` (bounds activation memory). 16K rather than 8K: fewer,
larger kernels and fewer attention merges per prompt, at half the activation memory of 32K
(``benchmarks/results/ruler_prefill_chunks_h100.json``)."""
PREFILL_STREAMS = 2
"""Prompts the native engine's continuous batching prefills at once on CUDA when several slots are free
(``continuous_generate``'s ``prefill_streams``: one CUDA stream each; the tokens are the same for any value). Two
streams ran RULER at 64K, batch 8, at 1.30 samples/s against 1.27 with one (one H100,
``benchmarks/results/ruler_prefill_streams_h100.json``)."""
CAPACITY_STEP_TOKENS = 4096
"""The native engine's cache capacity grows in multiples of this, so similar prompt lengths share one engine."""

Decoder = Callable[[list[list[int]], int], list[str]]
"""``decode(prompt_ids, max_new_tokens) -> texts``: one continuation per token-id prompt."""


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS ids ending a generation: the model's ``generation_config.eos_token_id``, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


def _cut_and_decode(tokenizer: Any, tokens: list[int], eos: set[int]) -> str:
    cut = next((i for i, tok in enumerate(tokens) if tok in eos), len(tokens))
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True)


class StaticCaches:
    """The transformers ``StaticCache`` that ``generate()`` runs over (engine ``static``), held one at a time and
    reset between calls while the batch size and capacity stay the same: capacities are rounded up to
    :data:`CAPACITY_STEP_TOKENS`, so the batches of one RULER length share one cache shape and, on CUDA, one
    compiled decode step (``generate()`` compiles the forward of a static-cache decode step itself:
    ``GenerationConfig.compile_config``).

    Raises:
        ValueError: a HyLo model (its latent / state caches are the native engine's).
    """

    def __init__(self, model: Any):
        if is_hylo(model):
            raise ValueError("engine 'static' (transformers' StaticCache generate) serves transformer models; a HyLo "
                             "model decodes through engine 'native' (its latent / state caches)")
        self.model = model
        self.key: tuple[int, int] | None = None
        self.cache: Any = None

    def get(self, batch: int, tokens: int) -> Any:
        """A reset ``StaticCache`` for ``batch`` rows of at least ``tokens`` (prompt + new) positions; call it in
        inference mode (the cache's tensors are made there)."""
        from transformers import StaticCache

        key = (batch, -(-tokens // CAPACITY_STEP_TOKENS) * CAPACITY_STEP_TOKENS)
        if key != self.key:
            self.cache = None  # free the old cache before allocating the new one
            self.cache, self.key = StaticCache(config=self.model.config, max_cache_len=key[1]), key
        self.cache.reset()
        return self.cache


def generate_batch(model: Any, tokenizer: Any, prompt_ids: list[list[int]], max_new_tokens: int,
                   caches: StaticCaches | None = None) -> list[str]:
    """Greedy continuations of a batch of token-id prompts through ``model.generate``, new tokens only.

    Prompts are left-padded to a [B, T] ``input_ids``/``attention_mask`` pair; each continuation is cut at its
    first EOS (:func:`eos_ids`) and decoded with ``skip_special_tokens=True``. With ``caches`` the generation runs
    over a preallocated ``StaticCache`` (:class:`StaticCaches`) instead of transformers' growing dynamic cache.
    """
    import torch

    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    width = max(len(ids) for ids in prompt_ids)
    input_ids_BT = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids_BT[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask_BT[row, width - len(ids) :] = 1
    with torch.inference_mode():  # the cache's tensors are made (and reset) in inference mode
        cache = {} if caches is None else {"past_key_values": caches.get(len(prompt_ids), width + max_new_tokens)}
        out_BT = model.generate(
            input_ids=input_ids_BT.to(device),
            attention_mask=mask_BT.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            **cache,
        )
    eos = eos_ids(model, tokenizer)
    return [_cut_and_decode(tokenizer, row, eos) for row in out_BT[:, width:].tolist()]


def is_hylo(model: Any) -> bool:
    """True for a ``HyLoForCausalLM`` (its config lists ``mixer_types``)."""
    return hasattr(getattr(model, "config", None), "mixer_types")


def _device_type(model: Any) -> str:
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return "cpu" if param is None else param.device.type


def resolve_engine(model: Any, engine: str) -> str:
    """``generate``, ``static`` or ``native``: ``auto`` picks native for a HyLo model on CUDA, generate otherwise.

    Raises:
        ValueError: an unknown engine name.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "auto":
        return "native" if is_hylo(model) and _device_type(model) == "cuda" else "generate"
    return engine


class NativeDecoder:
    """Greedy decoding through :func:`hylo_bench.decode.engine.make_engine`: stops at the first EOS
    (:func:`eos_ids`) or after ``max_new_tokens``, as ``generate`` does. Decoding is pure greedy argmax: logits
    processors in the model's ``generation_config`` (e.g. ``repetition_penalty``) are not applied (a warning says
    so). The engine is rebuilt when a prompt needs more cache than it holds; CUDA graphs are used for HyLo models on
    CUDA.

    With ``batch_size`` > 1 a HyLo model's prompts go through continuous batching
    (:func:`hylo_bench.decode.batching.continuous_generate`: ``batch_size`` cache slots, a finished prompt's slot
    refilled by the next), with the same tokens per prompt as one at a time; other models decode one prompt at a
    time (a warning says so).

    ``prefill_chunk``: tokens per prefill chunk of the engine (default :data:`PREFILL_CHUNK_TOKENS`).
    ``prefix_sharing``: continuous batching prefills the whole blocks a prompt shares with an earlier prompt of the
    same call only once (``continuous_generate``'s ``share_prefixes``; the tokens are the same either way, up to the
    rounding of a prefill chunk cut at a shared length). On CUDA
    it prefills up to :data:`PREFILL_STREAMS` prompts at once when several slots are free.

    Raises:
        ValueError: a model the engine cannot serve (not HyLo, not a Llama / Qwen3-style transformer), or
            ``batch_size`` / ``prefill_chunk`` < 1.
    """

    def __init__(self, model: Any, tokenizer: Any, batch_size: int = 1, prefill_chunk: int | None = None,
                 prefix_sharing: bool = True):
        if not (is_hylo(model) or hasattr(getattr(model, "model", None), "layers")):
            raise ValueError(f"engine='native' serves HyLoForCausalLM and Llama/Qwen3-style transformers; got "
                             f"{type(model).__name__}. Use engine='generate'")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.prefill_chunk = PREFILL_CHUNK_TOKENS if prefill_chunk is None else prefill_chunk
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token, got {self.prefill_chunk}")
        if batch_size > 1 and not is_hylo(model):
            logger.warning("batch_size=%d: the native engine batches HyLo models only; decoding %s one prompt at a "
                           "time", batch_size, type(model).__name__)
            batch_size = 1
        self.model, self.tokenizer = model, tokenizer
        self.batch_size = batch_size
        self.prefix_sharing = prefix_sharing
        self.eos = eos_ids(model, tokenizer)
        self.cuda_graphs = is_hylo(model) and _device_type(model) == "cuda"
        self.engine: Any = None
        self.capacity = 0
        from hylo_bench.decode.batching import BatchStats

        self.stats = BatchStats(batch_size=batch_size)  # continuous batching's prefill / decode time, summed over calls
        gen_cfg = getattr(model, "generation_config", None)
        penalty = getattr(gen_cfg, "repetition_penalty", None)
        if penalty not in (None, 1.0):
            logger.warning("generation_config.repetition_penalty=%s is not applied by the native engine (pure "
                           "greedy); use engine='generate' to apply it", penalty)
        self._ensure(1)  # fail now for a model the engine cannot serve

    @property
    def requests_per_call(self) -> int:
        """Prompts worth passing per call: several per slot, so refilled slots keep the batch full."""
        return 1 if self.batch_size == 1 else 4 * self.batch_size

    def _ensure(self, needed_tokens: int) -> Any:
        if needed_tokens > self.capacity:
            from hylo_bench.decode.engine import make_engine

            self.engine = None  # free the old caches before allocating larger ones
            capacity = -(-needed_tokens // CAPACITY_STEP_TOKENS) * CAPACITY_STEP_TOKENS
            self.engine = make_engine(self.model, self.batch_size, capacity, self.prefill_chunk,
                                      cuda_graphs=self.cuda_graphs)
            self.capacity = capacity
        return self.engine

    def tokens(self, ids: list[int], max_new_tokens: int, should_stop: Callable[[list[int]], bool] | None = None
               ) -> list[int]:
        """Greedy continuation token ids of one prompt, before the first EOS, at most ``max_new_tokens``.

        Args:
            ids: the prompt's token ids (no padding).
            max_new_tokens: generation budget in tokens.
            should_stop: optional predicate on the tokens so far (e.g. a stop string was decoded); True ends the
                generation keeping the last token (see ``Engine.generate_until``).
        """
        return self.tokens_many([ids], max_new_tokens, should_stop)[0]

    def tokens_many(self, prompts: list[list[int]], max_new_tokens: int,
                    should_stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
        """:meth:`tokens` of every prompt (in order); through continuous batching when ``batch_size`` > 1."""
        import torch

        if not prompts:
            return []
        engine = self._ensure(max(len(ids) for ids in prompts) + max_new_tokens - 1)
        if self.batch_size == 1:
            return [engine.generate_until(torch.tensor([ids], dtype=torch.long), max_new_tokens, self.eos,
                                          should_stop) for ids in prompts]
        from hylo_bench.decode.batching import Request, continuous_generate

        return continuous_generate(engine, [Request(ids=ids, max_new_tokens=max_new_tokens, should_stop=should_stop)
                                            for ids in prompts], self.eos, stats=self.stats,
                                   share_prefixes=self.prefix_sharing,
                                   prefill_streams=PREFILL_STREAMS if _device_type(self.model) == "cuda" else 1)

    def __call__(self, prompt_ids: list[list[int]], max_new_tokens: int) -> list[str]:
        return [self.tokenizer.decode(tokens, skip_special_tokens=True)
                for tokens in self.tokens_many(prompt_ids, max_new_tokens)]


def make_decoder(model: Any, tokenizer: Any, engine: str, batch_size: int = 1,
                 prefill_chunk: int | None = None, prefix_sharing: bool = True) -> Decoder:
    """The decode function of ``engine`` (:func:`resolve_engine`) for ``model``: ``generate`` left-pads batches of
    ``batch_size`` prompts, ``static`` does the same over a preallocated ``StaticCache`` (:class:`StaticCaches`;
    transformer models), ``native`` serves a HyLo model's prompts with continuous batching over ``batch_size``
    slots (:class:`NativeDecoder`, ``prefill_chunk`` tokens per prefill chunk, ``prefix_sharing``; the other
    engines ignore both).

    Raises:
        ValueError: unknown engine, ``static`` for a HyLo model, or ``native`` for a model the engine cannot serve.
    """
    resolved = resolve_engine(model, engine)
    if resolved == "generate":
        return functools.partial(generate_batch, model, tokenizer)
    if resolved == "static":
        return functools.partial(generate_batch, model, tokenizer, caches=StaticCaches(model))
    return NativeDecoder(model, tokenizer, batch_size, prefill_chunk, prefix_sharing)
