"""Native serving engine: preallocated caches, chunked prefill, greedy decode with measured TTFT / per-step times,
for a ``HyLoForCausalLM`` (MLA latent cache + GDN / Mamba-2 states) and, as the baseline, a plain transformers
Llama / Qwen3 causal LM (preallocated GQA K/V cache). Works on token ids only.

Legend: B batch, T prompt tokens, Tm max context (cache capacity), D hidden, V vocab.

Prefill runs in chunks of ``prefill_chunk`` tokens through every layer (bounded activations); only the last
position's hidden state reaches the LM head, so [T, V] logits are never built. Decode feeds one token per
sequence; MLA layers use the absorbed-weight form (checkpoint-format.md §6, :mod:`hylo_bench.decode.mla_layer`),
linear layers their recurrent step (:mod:`hylo_bench.decode.linear_layer`). With ``cuda_graphs=True`` (HyLo,
CUDA only) the decode step is captured once per batch size and replayed. Timings synchronise the device.
:meth:`Engine.prefill_row` (or :meth:`Engine.prefill_rows_shared`, several rows at once) and
:meth:`_EngineBase.decode_step` (per-row positions) serve continuous batching
(:mod:`hylo_bench.decode.batching`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hylo_bench.decode.fused import Prologue, merge_mlp, mlp_forward, project
from hylo_bench.decode.linear_layer import LinearServing
from hylo_bench.decode.mla_layer import MLACacheSlot, MLAServing
from hylo_bench.decode.transformer_layer import START_KWARG, PrefixKVCache, use_prefix_attention
from hylo_bench.kernels.gemv import GEMV_BACKENDS, select_gemv_backend
from hylo_bench.kernels.layer_glue import add_rms_norm, rms_norm, select_layer_glue_backend, silu_mul
from hylo_bench.models.cache import map_state

logger = logging.getLogger(__name__)
GIB = 2 ** 30
FUSED_GEMVS = ("in", "out", "gate_up", "down", "head", "mlp_chain")
DEFAULT_FUSED_GEMVS = ("in", "out", "gate_up", "down")  # lm_head: cuBLAS read it at 97 %, the Triton GEMV at 87 %
# Prefix sharing's granularity (tokens; Engine.prefix_block is this or the prefill chunk, whichever is smaller). A kept
# length off the chunk grid cuts its chunk in two, and the two pieces are attention shapes of their own: cuDNN builds a
# few execution graphs per distinct cut length, once per process (kernels/prefix_attention.py). 4096 bounds those
# lengths to 12 below 64K (16K chunks) while sharing most of what single tokens would: RULER 64K, demo tokenizer,
# 24 samples of niah_single_1: 606,208 of 1,565,791 prompt tokens shared at 16K, 757,760 at 4K, 799,651 at 1.
PREFIX_BLOCK = 4096


def default_prefix_block(prefill_chunk: int) -> int:
    """An :class:`Engine`'s prefix block when none is given: :data:`PREFIX_BLOCK` or ``prefill_chunk`` (tokens),
    whichever is smaller."""
    return min(PREFIX_BLOCK, prefill_chunk)


@dataclasses.dataclass(kw_only=True, slots=True)
class RowPrefix:
    """A prompt prefix kept by :meth:`Engine.prefill_row_shared` for a later prompt that starts with it.

    Attributes:
        row: the engine row whose latent cache rows [0, length) hold the prefix's MLA latents (not copied: they stay
            valid while that row's sequence decodes, and until the row is prefilled again).
        length: tokens, a whole number of the engine's prefix blocks (``Engine.prefix_block``).
        ids: [length] int64 on the host, the prefix's token ids (checked against the prompt that reuses it).
        linear: per layer, a copy of the row's linear state (GDN / Mamba-2 state and conv caches) after ``length``
            tokens; None for MLA layers.
    """

    row: int
    length: int
    ids: torch.Tensor
    linear: list


@dataclasses.dataclass(kw_only=True, slots=True)
class Timings:
    """Measured times of one ``generate`` call (seconds) and peak device memory (GiB; None on CPU).

    ``ttft_s``: prefill plus the first token (device synchronised); ``decode_step_s``: one entry per decode step
    after the first token (CUDA events on GPU, wall clock on CPU).
    """

    batch_size: int
    prompt_tokens: int
    new_tokens: int
    ttft_s: float
    decode_step_s: list[float]
    prefill_peak_gib: float | None = None
    decode_peak_gib: float | None = None
    cuda_graphs: bool = False

    @property
    def tpot_s(self) -> float | None:
        """Median time per output token after the first (s); None without decode steps."""
        return statistics.median(self.decode_step_s) if self.decode_step_s else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decoded tokens per second over all sequences: B * steps / total decode time."""
        total = sum(self.decode_step_s)
        return self.batch_size * len(self.decode_step_s) / total if total > 0 else None

    def to_dict(self) -> dict:
        return {"batch_size": self.batch_size, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
                "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "tokens_per_s": self.decode_tokens_per_s,
                "prefill_tokens_per_s": self.batch_size * self.prompt_tokens / self.ttft_s if self.ttft_s else None,
                "prefill_peak_gib": self.prefill_peak_gib, "decode_peak_gib": self.decode_peak_gib,
                "cuda_graphs": self.cuda_graphs}


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op elsewhere. Timings call it before reading the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _on_stream(stream):
    """``torch.cuda.stream(stream)``, or nothing for None (the current stream)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _join(streams: list) -> None:
    """The current stream waits for every side stream of :meth:`Engine.prefill_rows_shared`."""
    for s in streams:
        if s is not None:
            torch.cuda.current_stream(s.device).wait_stream(s)


def peak_gib(device: torch.device) -> float | None:
    """Peak allocated memory on a CUDA device since the last reset, GiB (2**30 bytes); None off CUDA."""
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


class _EngineBase:
    """Shared generate loop. Subclasses implement ``_prefill(ids, start) -> last hidden [B, 1, D]``,
    ``_decode(tokens [B], positions [B]) -> next tokens [B]`` and ``reset()``."""

    def __init__(self, model, max_batch: int, max_context: int, prefill_chunk: int):
        for name, val in (("max_batch", max_batch), ("max_context", max_context), ("prefill_chunk", prefill_chunk)):
            if val < 1:
                raise ValueError(f"Engine {name} must be >= 1; got {val}")
        self.model = model.eval()
        self.max_batch, self.max_context, self.prefill_chunk = max_batch, max_context, prefill_chunk
        self.device = next(model.parameters()).device
        self.cuda_graphs = False

    def _check(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[int, int]:
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [B, T] with T >= 1 (equal-length prompts); got "
                             f"{tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if B > self.max_batch:
            raise ValueError(f"batch {B} > max_batch {self.max_batch}; build the Engine with max_batch >= {B}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if T + max_new_tokens - 1 > self.max_context:
            raise ValueError(f"prompt {T} + {max_new_tokens} new tokens needs {T + max_new_tokens - 1} cache slots "
                             f"> max_context {self.max_context}; build the Engine with a larger max_context")
        return B, T

    def _logits_to_token(self, hidden_B1D: torch.Tensor) -> torch.Tensor:
        return greedy_token(self._lm_logits(hidden_B1D)[:, -1])

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Chunked prefill of ``input_ids`` [B, T] from an empty cache; returns the last position's logits [B, V].

        Raises:
            ValueError: bad shapes or a prompt longer than ``max_context``.
        """
        _, T = self._check(input_ids, 1)
        self.reset()
        ids = input_ids.to(self.device)
        hidden = None
        for start in range(0, T, self.prefill_chunk):
            hidden = self._prefill(ids[:, start:start + self.prefill_chunk], start)
        return self._lm_logits(hidden)[:, -1]

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, Timings]:
        """Greedy generation (no EOS stop: exactly ``max_new_tokens`` tokens per sequence).

        Args:
            input_ids: [B, T] int64 prompts of equal length (no padding), B <= max_batch.
            max_new_tokens: tokens to generate (>= 1); T + max_new_tokens - 1 <= max_context.

        Returns:
            (tokens [B, max_new_tokens] int64 on CPU, :class:`Timings`).

        Raises:
            ValueError: bad shapes, batch or context beyond the engine's capacity.
        """
        B, T = self._check(input_ids, max_new_tokens)
        dev = self.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        sync_device(dev)
        t0 = time.perf_counter()
        logits = self.prefill(input_ids)
        tok = logits.argmax(-1)
        sync_device(dev)
        ttft = time.perf_counter() - t0
        prefill_peak = peak_gib(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        out = [tok]
        pos = torch.full((B,), T, dtype=torch.long, device=dev)
        self._prepare_decode(tok, pos)
        steps = self._timed_decode(tok, pos, max_new_tokens - 1, out)
        timings = Timings(batch_size=B, prompt_tokens=T, new_tokens=max_new_tokens, ttft_s=ttft, decode_step_s=steps,
                          prefill_peak_gib=prefill_peak, decode_peak_gib=peak_gib(dev), cuda_graphs=self.cuda_graphs)
        return torch.stack(out, dim=1).cpu(), timings

    @torch.inference_mode()
    def generate_until(self, input_ids: torch.Tensor, max_new_tokens: int, stop_ids: set[int],
                       should_stop: Callable[[list[int]], bool] | None = None) -> list[int]:
        """Greedy generation of one prompt that stops at the first token in ``stop_ids`` (not returned) or after
        ``max_new_tokens`` tokens, as transformers' ``generate`` with ``eos_token_id=stop_ids`` does. Untimed.

        Args:
            input_ids: [1, T] int64 prompt.
            max_new_tokens: most tokens to generate (>= 1); T + max_new_tokens - 1 <= max_context.
            stop_ids: token ids that end the generation (EOS ids).
            should_stop: called with the tokens so far after each appended token; True ends the generation with
                that token kept (stop strings, as transformers' ``StoppingCriteria`` do).

        Returns:
            The generated token ids before the first stop token (at most ``max_new_tokens``).

        Raises:
            ValueError: a batch other than 1, bad shapes, or a context beyond the engine's capacity.
        """
        B, T = self._check(input_ids, max_new_tokens)
        if B != 1:
            raise ValueError(f"generate_until takes one prompt ([1, T]); got batch {B}")
        tok = self.prefill(input_ids).argmax(-1)
        pos = torch.full((1,), T, dtype=torch.long, device=self.device)
        self._prepare_decode(tok, pos)
        out: list[int] = []
        while True:
            token = int(tok.item())
            if token in stop_ids:
                return out
            out.append(token)
            if len(out) == max_new_tokens or (should_stop is not None and should_stop(out)):
                return out
            tok = self._decode(tok, pos)
            pos = pos + 1

    @torch.inference_mode()
    def decode_step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One greedy decode step: ``tok`` [B] int64 (each row's last token) at ``pos`` [B] int64 (its position,
        per row) -> next tokens [B] int64 on the device; writes each row's cache entry at ``pos``. The first call
        for a batch size captures the CUDA graph when the engine uses them."""
        tok, pos = tok.to(self.device), pos.to(self.device)
        self._prepare_decode(tok, pos)
        return self._decode(tok, pos)

    def _prepare_decode(self, tok: torch.Tensor, pos: torch.Tensor) -> None:
        """Hook run after prefill, before the timed decode loop (CUDA-graph capture)."""

    def _timed_decode(self, tok: torch.Tensor, pos: torch.Tensor, n: int, out: list[torch.Tensor]) -> list[float]:
        """Run n greedy decode steps from ``tok`` at ``pos`` [B], appending tokens to ``out``; seconds per step."""
        dev = self.device
        steps: list[float] = []
        events = []
        for _ in range(n):
            if dev.type == "cuda":
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                tok = self._decode(tok, pos)
                e1.record()
                events.append((e0, e1))
            else:
                s0 = time.perf_counter()
                tok = self._decode(tok, pos)
                steps.append(time.perf_counter() - s0)
            out.append(tok)
            pos = pos + 1
        sync_device(dev)
        if events:
            steps = [a.elapsed_time(b) / 1e3 for a, b in events]
        return steps

    @torch.inference_mode()
    def decode_benchmark(self, batch: int, context_tokens: int, steps: int, seed: int = 0) -> Timings:
        """Decode ``steps`` tokens after a synthetic context: the caches are filled with random values instead of
        running the prefill (decode cost does not depend on the values; Zebra-Llama's throughput benchmark does the
        same). ``ttft_s`` is 0 (not measured).

        Raises:
            ValueError: batch or context beyond the engine's capacity.
        """
        self._check(torch.zeros(batch, context_tokens, dtype=torch.long), steps + 1)
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        self._fill_synthetic(context_tokens, gen)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        tok = torch.randint(0, self.model.config.vocab_size, (batch,), device=dev, generator=gen)
        pos = torch.full((batch,), context_tokens, dtype=torch.long, device=dev)
        self._prepare_decode(tok, pos)
        out: list[torch.Tensor] = []
        step_s = self._timed_decode(tok, pos, steps, out)
        return Timings(batch_size=batch, prompt_tokens=context_tokens, new_tokens=steps, ttft_s=0.0,
                       decode_step_s=step_s, decode_peak_gib=peak_gib(dev), cuda_graphs=self.cuda_graphs)

    @torch.inference_mode()
    def time_prefill_chunk(self, batch: int, start: int, length: int, seed: int = 0) -> float:
        """Seconds for one prefill chunk of ``length`` tokens at offset ``start`` (device synchronised), over
        whatever the cache holds (use after :meth:`decode_benchmark` or a prefill). For TTFT estimates at contexts
        whose full prefill is too slow: chunk cost grows linearly with the offset.
        """
        self._check(torch.zeros(batch, start + length, dtype=torch.long), 1)
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.model.config.vocab_size, (batch, length), generator=gen).to(self.device)
        sync_device(self.device)
        t0 = time.perf_counter()
        self._lm_logits(self._prefill(ids, start))
        sync_device(self.device)
        return time.perf_counter() - t0


class Engine(_EngineBase):
    """Serving engine for a ``HyLoForCausalLM``.

    Caches (allocated once, here): per MLA layer a latent cache [max_batch, max_context, R + P] (+ [.., G] key
    scales for Qwen3 q/k-norm models, see :mod:`hylo_bench.decode.mla_layer`); per GDN layer the recurrent state
    [max_batch, H, K, Vd] fp32 + conv inputs; per Mamba-2 layer the SSM state [max_batch, H, P, N] + conv inputs.

    Args:
        model: ``HyLoForCausalLM`` (any device / dtype; bf16 on GPU in practice).
        max_batch: most sequences per ``generate`` call.
        max_context: cache capacity in tokens (prompt + new tokens - 1).
        prefill_chunk: tokens per prefill chunk (bounds activation memory).
        prefix_block: granularity of prefix sharing (:meth:`prefill_row_shared`; tokens, default the smaller of
            :data:`PREFIX_BLOCK` and ``prefill_chunk``: :func:`default_prefix_block`).
        cuda_graphs: capture the decode step in a CUDA graph (CUDA only; ignored with a warning on CPU).
        mla_decode_backend: "auto", "torch" or "triton" (:func:`hylo_bench.kernels.mla_decode.mla_decode`).
        gdn_decode_backend: "auto", "torch", "fla" or "triton" (the whole token in one kernel, the CUDA default;
            :func:`hylo_bench.kernels.gated_delta.select_gdn_decode_backend`).
        compile: trace the decode step with ``torch.compile`` (``fullgraph``, static shapes; the MLA, GDN and GEMV
            kernels are opaque custom ops, the ``ops`` module beside each kernel, e.g.
            :mod:`hylo_bench.kernels.gemv.ops`) so Inductor fuses the small element-wise kernels around them;
            composes with ``cuda_graphs`` (the compiled step is what gets captured). The first step
            per batch size compiles (tens of seconds to minutes).
        compile_mode: ``torch.compile`` mode (default "default": Inductor fuses the element-wise kernels, the GEMVs
            stay cuBLAS calls; the engine captures its own CUDA graph). On the H200 at 64K this beat
            "max-autotune-no-cudagraphs" (38.1 % vs 37.5 % of the bandwidth bound) and sets up (compile included) in
            about 45 s instead of 105-165 s. compile_backend: ``torch.compile`` backend (default "inductor").
        compile_options: Inductor options instead of a mode (e.g. ``{"max_autotune": True,
            "coordinate_descent_tuning": False}``: autotuned GEMMs without turning batch-1 GEMVs into reductions).
        merge_projections: per layer, read the projections that share an input with one GEMV (GDN q/k/v/a/b/g, MLA
            first query projection + kv_a, MLP gate + up; :mod:`hylo_bench.decode.fused`). The model's weights are
            rebound as row views of the merged buffers: same values, same memory. None (default): merge, except
            under a "max-autotune" compile mode, whose coordinate-descent tuning turns batch-1 GEMVs into fused
            Triton reductions that ran faster unmerged (H200, 64K: 36.8 % vs 34.9 % of the bandwidth bound; with
            cuBLAS GEMVs merging won, 30.8 % vs 26.7 %; ``benchmarks/results/decode_profile_run*.json``).
        gemv_backend: "torch" (``F.linear`` / cuBLAS, the element-wise work around it left to Inductor), "triton"
            (decode GEMVs on :func:`hylo_bench.kernels.gemv.fused_gemv`'s Triton kernel with the layer's RMSNorms,
            SwiGLU and residual adds fused into them, :mod:`hylo_bench.decode.fused`) or "auto" (default: triton
            with merged projections on CUDA when Triton imports, torch otherwise). With the GDN pre-step kernel
            (``gdn_prestep_backend``) this took the H200's 64K decode step from 2.75 to 2.05 ms
            (``benchmarks/results/decode_profile.json``). Needs merged
            projections; layers it cannot fuse (a Mamba-2 mixer, a biased projection, a non-SiLU MLP) keep the
            torch path for that part. CUDA batches of at most 16 sequences (larger ones take the torch reference).
            With it, each MLA layer also runs ``q_b_proj`` on the Triton GEMV and its query / cache-row glue and
            ``W_UV`` on two Triton kernels (:meth:`hylo_bench.decode.mla_layer.MLAServing.prep_triton`; with the
            GDN token kernel, 64K decode 1.87 -> 1.70 ms, 60.1 % of the bound:
            ``decode_profile_64k_tuned_at_64k.json``).
        fused_gemvs: with gemv_backend "triton", which GEMVs take the fused kernel (the others stay cuBLAS with
            their element-wise neighbours separate): "in" (the mixer's merged first projection + RMSNorm), "out"
            (``o_proj`` / ``out_proj`` + residual), "gate_up" (+ RMSNorm), "down" (SwiGLU + ``down_proj`` +
            residual), "head" (final norm + ``lm_head``). Default: all but "head" (cuBLAS reads the 622 MB
            Qwen3 lm_head at 97 % of copy bandwidth, the Triton GEMV at 87 %). "mlp_chain" (experimental, off by
            default): at batch 1 the whole MLP (norm, gate_up, SwiGLU, down, residual) in one persistent kernel
            with a grid barrier between its GEMVs (:mod:`hylo_bench.kernels.gemv.chain`); slower than the two
            GEMVs on an H100 (64K step 2.58 against 2.01-2.08 ms, ``decode_mlp_chain_h100_7cc825e.json``).
        gdn_prestep_backend: a GDN decode token's convolutions, SiLU and gates when ``gdn_decode_backend`` is
            "fla" or "torch": "torch", "triton" (one kernel instead of about 11) or "auto" (default: triton on CUDA;
            :class:`LinearServing`). The "triton" GDN decode back end does them in its own kernel.
        layer_glue_backend: a prefill chunk's RMSNorms, residual adds and SwiGLU: "torch" (the modules), "fla"
            (fla's one-pass kernels) or "auto" (default: fla for CUDA inference; :mod:`hylo_bench.kernels.layer_glue`).
            Layers with other norms or activations keep the modules.

    Raises:
        ValueError: not a HyLo model (use :class:`TransformerEngine`), non-positive sizes, unknown ``gemv_backend``
            or "triton" without merged projections, an unknown ``fused_gemvs`` entry, a ``gdn_prestep_backend``
            :class:`LinearServing` refuses, or an unknown ``layer_glue_backend`` ("fla" off CUDA).
        ImportError: ``layer_glue_backend="fla"`` without flash-linear-attention.
        torch.cuda.OutOfMemoryError: the caches do not fit.
    """

    def __init__(self, model, max_batch: int, max_context: int, prefill_chunk: int = 8192, *,
                 cuda_graphs: bool = False, mla_decode_backend: str = "auto", gdn_decode_backend: str = "auto",
                 compile: bool = False, compile_mode: str | None = None, compile_backend: str = "inductor",
                 compile_options: dict | None = None, merge_projections: bool | None = None,
                 gemv_backend: str = "auto", fused_gemvs: tuple[str, ...] = DEFAULT_FUSED_GEMVS,
                 gdn_prestep_backend: str = "auto", layer_glue_backend: str = "auto", prefix_block: int | None = None):
        if not hasattr(getattr(model, "config", None), "mixer_types"):
            raise ValueError(f"Engine serves HyLoForCausalLM models; got {type(model).__name__}. Use "
                             f"TransformerEngine (or make_engine) for a plain transformer")
        super().__init__(model, max_batch, max_context, prefill_chunk)
        self.prefix_block = default_prefix_block(prefill_chunk) if prefix_block is None else prefix_block
        if self.prefix_block < 1:
            raise ValueError(f"Engine prefix_block must be >= 1; got {prefix_block}")
        if cuda_graphs and self.device.type != "cuda":
            logger.warning("cuda_graphs=True ignored: the model is on %s", self.device)
            cuda_graphs = False
        self.use_graphs = cuda_graphs
        self.layers = list(model.model.layers)
        mode = compile_mode or "default"
        if merge_projections is None:
            merge_projections = not (compile and compile_options is None and mode.startswith("max-autotune"))
        self.merged_projections = merge_projections
        if gemv_backend not in GEMV_BACKENDS + ("auto",):
            raise ValueError(f"gemv_backend={gemv_backend!r}; expected 'auto' or one of {GEMV_BACKENDS}")
        if gemv_backend == "auto":
            gemv_backend = select_gemv_backend(self.device, next(model.parameters()).dtype, merge_projections)
        if gemv_backend == "triton" and not merge_projections:
            raise ValueError("gemv_backend='triton' fuses norms into the merged projections: it needs "
                             "merge_projections=True (or None with a non-max-autotune compile mode)")
        self.gemv_backend = gemv_backend
        unknown = set(fused_gemvs) - set(FUSED_GEMVS)
        if unknown:
            raise ValueError(f"fused_gemvs {sorted(unknown)} unknown; expected a subset of {FUSED_GEMVS}")
        self.fused_gemvs = frozenset(fused_gemvs) if gemv_backend == "triton" else frozenset()
        self.mixers, self.slots = [], []
        for layer in self.layers:
            if layer.mixer_type == "mla":
                srv = MLAServing(layer.mixer, decode_backend=mla_decode_backend, merge_projections=merge_projections)
                slot = srv.new_slot(max_batch, max_context)
            else:
                srv = LinearServing(layer.mixer, layer.mixer_type, gdn_decode_backend=gdn_decode_backend,
                                    merge_projections=merge_projections, prestep_backend=gdn_prestep_backend)
                slot = srv.new_state(max_batch)
            self.mixers.append(srv)
            self.slots.append(slot)
        self.merged_mlps = [merge_mlp(layer.mlp) if merge_projections else None for layer in self.layers]
        if layer_glue_backend != "auto":  # fail now for an unknown name, or fla off CUDA / not installed
            select_layer_glue_backend(layer_glue_backend, self.device, torch.float32, False)
        glue_ok = getattr(self.model.config, "hidden_act", None) in ("silu", "swish") and all(
            isinstance(layer.input_layernorm, LlamaRMSNorm) and isinstance(layer.post_attention_layernorm, LlamaRMSNorm)
            for layer in self.layers)
        self.layer_glue_backend = layer_glue_backend if glue_ok else "torch"
        self.fused = [self._fusable(i) for i in range(len(self.layers))] if gemv_backend == "triton" else None
        head = self.model.lm_head
        self.fused_head = "head" in self.fused_gemvs and getattr(head, "bias", None) is None and isinstance(
            self.model.model.norm, LlamaRMSNorm)
        self._graphs: dict[int, tuple] = {}
        self._side_streams: list = []  # prefill_rows_shared's, made on first use
        self.graph_error: str | None = None
        self.compiled = compile
        # Through a weak reference: a bound method kept on the engine is a reference cycle, and the engine's caches
        # and CUDA graphs would then outlive the last reference until the garbage collector's next full pass (a
        # larger engine built meanwhile, as NativeDecoder does when a prompt outgrows the cache, holds both).
        self._step_fn = _weak_step(self)
        if compile:
            how = {"options": compile_options} if compile_options is not None else {"mode": mode}
            self._step_fn = torch.compile(self._step_fn, fullgraph=True, dynamic=False, backend=compile_backend, **how)
            logger.info("decode step compiled with torch.compile (%s, backend %s)", how, compile_backend)

    def cache_bytes(self) -> dict[str, int]:
        """Bytes allocated for caches: ``{"mla_latent", "mla_key_scale", "linear_state"}``."""
        out = {"mla_latent": 0, "mla_key_scale": 0, "linear_state": 0}
        for slot in self.slots:
            for name, t in self._slot_tensors(slot):
                out[name] += t.numel() * t.element_size()
        return out

    @staticmethod
    def _slot_tensors(slot):
        from hylo_bench.decode.mla_layer import MLACacheSlot

        if isinstance(slot, MLACacheSlot):
            return [("mla_latent", slot.latent)] + ([("mla_key_scale", slot.key_scale)] if slot.key_scale is not None
                                                     else [])
        tensors: list[torch.Tensor] = []
        from hylo_bench.models.cache import map_state

        map_state(slot, lambda t: tensors.append(t) or t)
        return [("linear_state", t) for t in tensors]

    def _linear_tensors(self) -> list[torch.Tensor]:
        return [t for slot in self.slots for name, t in self._slot_tensors(slot) if name == "linear_state"]

    def reset(self) -> None:
        """Zero the recurrent / conv states (latent rows are overwritten before they are read)."""
        for t in self._linear_tensors():
            t.zero_()

    def _fusable(self, i: int) -> tuple[bool, bool]:
        """(mixer, MLP) of layer i can take the fused Triton GEMVs: merged, bias-free, LlamaRMSNorm, SiLU."""
        layer, srv, mlp = self.layers[i], self.mixers[i], self.layers[i].mlp
        out = layer.mixer.out_proj if isinstance(srv, MLAServing) else getattr(layer.mixer, "o_proj", None)
        mixer = (srv.merged is not None and out is not None and out.bias is None
                 and isinstance(layer.input_layernorm, LlamaRMSNorm))
        mlp_ok = (self.merged_mlps[i] is not None and mlp.down_proj.bias is None
                  and getattr(self.model.config, "hidden_act", None) in ("silu", "swish")
                  and isinstance(layer.post_attention_layernorm, LlamaRMSNorm))
        return mixer, mlp_ok

    def _layer(self, i: int, h: torch.Tensor, start: int | None, pos: torch.Tensor | None,
               slots: list | None = None, glue: str = "torch", last_only: bool = False) -> torch.Tensor:
        """Decoder layer i in serving form: a prefill chunk at ``start`` (int), or one decode token per row at
        ``pos`` [B]; ``slots``: the caches to use instead of ``self.slots`` (row views, :meth:`prefill_row`);
        ``glue``: a prefill chunk's resolved layer-glue back end (:mod:`hylo_bench.kernels.layer_glue`);
        ``last_only``: a prefill chunk's mixer runs over every token (its cache and state need them all), the rest
        of the layer over the chunk's last position only, which is returned ([B, 1, D]).

        The structure is ``HyLoDecoderLayer.forward``'s (``h + mixer(input_layernorm(h))``, then
        ``h + mlp(post_attention_layernorm(h))``) on the same modules and weights; the mixer runs in its serving
        form over the engine's caches (MLA absorbed over the latent cache, the linear recurrence step). Decode
        tokens on the fused Triton GEMVs (``gemv_backend="triton"``) hand the norms to the GEMVs' prologues and the
        residual adds to their epilogues (:class:`hylo_bench.decode.fused.Prologue`) instead of running them apart.
        """
        layer, srv = self.layers[i], self.mixers[i]
        slot = (self.slots if slots is None else slots)[i]
        mla = isinstance(srv, MLAServing)
        if not mla:
            slot = self._rows(slot, h.shape[0])
        if pos is None:  # a prefill chunk: norms, residual adds and SwiGLU through the layer glue
            x = rms_norm(h, layer.input_layernorm, glue)
            mixed = srv.prefill(x, slot, start) if mla else srv.prefill(x, slot)
            if last_only:
                mixed, h = mixed[:, -1:], h[:, -1:]
            y, h = add_rms_norm(mixed, h, layer.post_attention_layernorm, glue)
            return h + self._mlp(i, y, glue)
        fuse_mixer, fuse_mlp = self.fused[i] if self.fused is not None else (False, False)
        fg = self.fused_gemvs
        pro = Prologue(layer.input_layernorm if "in" in fg else None, h if "out" in fg else None) if fuse_mixer \
            else None
        x = h if pro is not None and pro.norm is not None else layer.input_layernorm(h)
        mixed = srv.decode(x, slot, pos, pro) if mla else srv.decode(x, slot, pro)
        h = mixed if pro is not None and pro.residual is not None else h + mixed
        post, mlp, merged = layer.post_attention_layernorm, layer.mlp, self.merged_mlps[i]
        if not fuse_mlp:
            return h + mlp_forward(mlp, merged, post(h))
        if "mlp_chain" in fg and h.shape[0] * h.shape[1] == 1:
            from hylo_bench.kernels.gemv.ops import mlp_chain_op

            return mlp_chain_op(h, post.weight, post.variance_epsilon, merged.weight, mlp.down_proj.weight)
        gate_up = project(h, merged.weight, Prologue(post)) if "gate_up" in fg else F.linear(post(h), merged.weight)
        if "down" in fg:
            return project(gate_up, mlp.down_proj.weight, Prologue(residual=h), glu=True)
        gate, up = gate_up.split(merged.splits, dim=-1)
        return h + mlp.down_proj(mlp.act_fn(gate) * up)

    def _mlp(self, i: int, y: torch.Tensor, glue: str) -> torch.Tensor:
        """Layer i's MLP on the normalised y [B, T, D] (SwiGLU's product through the layer glue)."""
        mlp, merged = self.layers[i].mlp, self.merged_mlps[i]
        if glue == "torch":
            return mlp_forward(mlp, merged, y)
        gate, up = merged(y) if merged is not None else (mlp.gate_proj(y), mlp.up_proj(y))
        return mlp.down_proj(silu_mul(gate, up, glue))

    def _forward(self, ids: torch.Tensor, start: int | None, pos: torch.Tensor | None,
                 slots: list | None = None) -> torch.Tensor:
        """The decoder stack: ids [B, T] (a prefill chunk at ``start``) or [B, 1] (decode at ``pos`` [B]) ->
        hidden states before the final norm: [B, 1, D] at the chunk's last position for a prefill chunk, [B, 1, D]
        for decode. Only the last position of a prompt reaches the LM head, so the last layer's MLP (and its
        residual adds and norm) run on that position alone: 1/L of a prefill's MLP work, with the caches and states
        unchanged. A prefill chunk resolves the layer glue's back end once (:mod:`hylo_bench.kernels.layer_glue`;
        "auto": fla's kernels for CUDA inference)."""
        h = self.model.model.embed_tokens(ids)
        glue = "torch"
        if pos is None and self.layer_glue_backend != "torch":
            glue = select_layer_glue_backend(self.layer_glue_backend, h.device, h.dtype,
                                             torch.is_grad_enabled() and h.requires_grad)
        last = len(self.layers) - 1
        for i in range(len(self.layers)):
            h = self._layer(i, h, start, pos, slots, glue, last_only=pos is None and i == last)
        return h

    def _prefill(self, ids: torch.Tensor, start: int, slots: list | None = None) -> torch.Tensor:
        return self._forward(ids, start, None, slots)

    def _row_slots(self, row: int) -> list:
        """Every layer's cache restricted to batch row ``row`` (views of size 1: writes reach the buffers)."""
        out = []
        for slot in self.slots:
            if isinstance(slot, MLACacheSlot):
                out.append(MLACacheSlot(slot.latent[row:row + 1],
                                        None if slot.key_scale is None else slot.key_scale[row:row + 1]))
            else:
                out.append(map_state(slot, lambda t: t[row:row + 1]))
        return out

    @torch.inference_mode()
    def prefill_row(self, row: int, input_ids: torch.Tensor) -> torch.Tensor:
        """Chunked prefill of one prompt into batch row ``row`` of the caches, from an empty state for that row;
        the other rows keep their caches and states (continuous batching: a finished sequence's row takes the next
        request while the others keep decoding, :mod:`hylo_bench.decode.batching`).

        Args:
            row: 0 <= row < max_batch. input_ids: [1, T] int64, T <= max_context.

        Returns:
            The last position's logits [1, V].

        Raises:
            ValueError: a row outside the batch, bad shapes or a prompt longer than ``max_context``.
        """
        return self.prefill_row_shared(row, input_ids)[0]

    @torch.inference_mode()
    def prefill_row_shared(self, row: int, input_ids: torch.Tensor, reuse: RowPrefix | None = None,
                           keep: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, RowPrefix]]:
        """:meth:`prefill_row` that starts from a prefix kept earlier and / or keeps prefixes of this prompt for
        later ones (prefix sharing, as vLLM's prefix caching of hybrid models: whole blocks only).

        Prefixes are whole prefix blocks (``prefix_block`` tokens). A prompt is prefilled in pieces cut at every
        multiple of ``prefill_chunk`` and at every kept length (:meth:`prefill_pieces`); a prefill from a kept prefix
        starts from bitwise the latent rows and states that the prefill which kept it reached, so its logits,
        caches and states equal bit for bit those of a full prefill of the prompt cut at the same positions. With
        every cut a multiple of ``prefill_chunk`` that is :meth:`prefill_row` itself; a cut between chunk
        boundaries changes the results by floating-point rounding only (the kernels tile a shorter piece).

        Args:
            row, input_ids: as :meth:`prefill_row`.
            reuse: a prefix kept by an earlier call (:class:`RowPrefix`) whose tokens start this prompt; its latent
                rows are copied from ``reuse.row`` (which must still hold them: rows before a sequence's prompt end
                never change while it decodes) and its linear states loaded, and prefill starts at ``reuse.length``.
            keep: positions, each a multiple of ``prefix_block`` from ``reuse.length`` (0 without ``reuse``,
                exclusive) up to T: this prompt's prefix of each length is returned as a :class:`RowPrefix` (the
                linear states are copied when the prefill reaches them; at ``reuse.length``, ``reuse``'s own).

        Returns:
            (logits [1, V] of the last position, {length: the kept :class:`RowPrefix`}).

        Raises:
            ValueError: as :meth:`prefill_row`; a ``reuse`` that is not a whole number of prefix blocks, not shorter
                than the prompt or not its prefix; a ``keep`` position that is not a multiple of ``prefix_block``
                between ``reuse.length`` (or 1) and T.
        """
        return self.prefill_rows_shared([(row, input_ids, reuse, keep)])[0]

    @torch.inference_mode()
    def prefill_rows_shared(self, jobs: Sequence[tuple[int, torch.Tensor, RowPrefix | None, Sequence[int]]]
                            ) -> list[tuple[torch.Tensor, dict[int, RowPrefix]]]:
        """:meth:`prefill_row_shared` for several prompts into distinct rows at once: on CUDA each prompt's chunks
        run on a stream of their own, piece c of every prompt launched before piece c + 1 of any, so one prompt's
        low-occupancy kernels (the GDN state pass, norms, small launches) overlap another's GEMMs and attention.
        Rows never interact, so each prompt's logits, latent rows and states equal those of its own
        :meth:`prefill_row_shared` bit for bit (same kernels, same pieces); off CUDA the pieces simply interleave.
        Activation memory grows with the number of prompts (one chunk's activations each).

        Args:
            jobs: (row, input_ids, reuse, keep) per prompt, as :meth:`prefill_row_shared`'s arguments; rows
                distinct. A ``reuse`` prefix's latent rows are copied (and its states loaded) before any prompt of
                the call is prefilled, so ``reuse.row`` may be the row of another job, unless that job also takes a
                prefix (its copy would overwrite the rows being read).

        Returns:
            Per job, in order: (logits [1, V] of its last position, {length: kept :class:`RowPrefix`}).

        Raises:
            ValueError: as :meth:`prefill_row_shared` for any job (checked for all before any work), a row
                named twice, or a ``reuse.row`` that another job of the call fills from a prefix of its own.
        """
        rows = [job[0] for job in jobs]
        if len(set(rows)) != len(rows):
            raise ValueError(f"prefill_rows_shared: rows {rows} repeat; each prompt needs a row of its own")
        copied_into = {row for row, _, reuse, _ in jobs if reuse is not None}
        clash = [reuse.row for row, _, reuse, _ in jobs
                 if reuse is not None and reuse.row != row and reuse.row in copied_into]
        if clash:
            raise ValueError(f"prefill_rows_shared: rows {clash} hold a reused prefix and also take one; prefill "
                             f"those prompts in separate calls")
        plans = [self._check_row_job(*job) for job in jobs]
        works = []  # per job: row slots, device ids, first position, kept prefixes
        for (row, input_ids, reuse, keep), start0 in zip(jobs, plans):
            slots = self._row_slots(row)
            kept: dict[int, RowPrefix] = {}
            if reuse is not None:
                self._load_prefix(row, slots, reuse)
                if start0 in keep:
                    kept[start0] = dataclasses.replace(reuse, row=row)
            else:
                for slot in slots:  # the row's recurrent / conv states restart; latent rows are written before read
                    if not isinstance(slot, MLACacheSlot):
                        map_state(slot, lambda t: t.zero_())
            works.append((slots, input_ids.to(self.device), start0, kept))
        streams = self._job_streams(len(jobs))
        try:
            return self._interleaved_prefill(jobs, works, streams)
        finally:  # also on an error (out of memory): later work on this stream must wait for the side streams
            _join(streams)

    def prefill_pieces(self, start0: int, T: int, keep: Sequence[int] = ()) -> list[tuple[int, int]]:
        """The [start, end) pieces in which :meth:`prefill_rows_shared` prefills positions ``start0 .. T - 1``: cut at
        every multiple of ``prefill_chunk`` and every ``keep`` position in between (e.g. chunk 8, T 21, keep [4, 12]:
        (0, 4), (4, 8), (8, 12), (12, 16), (16, 21))."""
        chunk = self.prefill_chunk
        cuts = sorted({*range((start0 // chunk + 1) * chunk, T, chunk), *(k for k in keep if start0 < k < T), T})
        return list(zip([start0] + cuts[:-1], cuts))

    def _interleaved_prefill(self, jobs, works, streams) -> list[tuple[torch.Tensor, dict[int, RowPrefix]]]:
        """The piece loop of :meth:`prefill_rows_shared` (:meth:`prefill_pieces`): piece c of every job (each on
        ``streams[k]``) before piece c + 1 of any; then each job's logits. works: per job (row slots, device ids,
        first position, kept)."""
        hidden: list[torch.Tensor | None] = [None] * len(jobs)
        pieces = [self.prefill_pieces(start0, ids.shape[1], job[3]) for job, (_, ids, start0, _) in zip(jobs, works)]
        for c in range(max(map(len, pieces))):
            for k, ((row, input_ids, _, keep), (slots, ids, _, kept)) in enumerate(zip(jobs, works)):
                if c >= len(pieces[k]):
                    continue
                start, end = pieces[k][c]
                with _on_stream(streams[k]):
                    hidden[k] = self._prefill(ids[:, start:end], start, slots)
                    if end in keep:
                        kept[end] = RowPrefix(row=row, length=end, ids=input_ids[0, :end].cpu().clone(),
                                              linear=[None if isinstance(s, MLACacheSlot) else map_state(s, torch.clone)
                                                      for s in slots])
        out = []
        for k, (_, _, _, kept) in enumerate(works):
            with _on_stream(streams[k]):
                out.append((self._lm_logits(hidden[k])[:, -1], kept))
        return out

    def _check_row_job(self, row: int, input_ids: torch.Tensor, reuse: RowPrefix | None,
                       keep: Sequence[int]) -> int:
        """Validate one :meth:`prefill_rows_shared` job; its first prefilled position (``reuse.length`` or 0)."""
        if not 0 <= row < self.max_batch:
            raise ValueError(f"row {row} outside the engine's batch of {self.max_batch}")
        B, T = self._check(input_ids, 1)
        if B != 1:
            raise ValueError(f"prefill_row takes one prompt ([1, T]); got batch {B}")
        block = self.prefix_block
        start0 = 0 if reuse is None else reuse.length
        if reuse is not None and (start0 % block or not 0 < start0 < T
                                  or not torch.equal(reuse.ids, input_ids[0, :start0].cpu())):
            raise ValueError(f"reuse: a {start0}-token prefix (prefix_block={block}) must be a positive whole "
                             f"number of blocks below the prompt's {T} tokens and equal its first {start0} tokens")
        bad = [k for k in keep if k % block or not max(start0, 1) <= k <= T]
        if bad:
            raise ValueError(f"keep={sorted(keep)}: positions must be multiples of prefix_block={block} from "
                             f"{max(start0, 1)} up to the prompt's {T} tokens; {bad} are not")
        return start0

    def _job_streams(self, n: int) -> list:
        """n streams for :meth:`prefill_rows_shared`, each after the work queued so far on the current stream; [None]
        (the current stream) for one job or off CUDA."""
        if n == 1 or self.device.type != "cuda":
            return [None] * n
        while len(self._side_streams) < n:
            self._side_streams.append(torch.cuda.Stream(self.device))
        streams = self._side_streams[:n]
        main = torch.cuda.current_stream(self.device)
        for s in streams:
            s.wait_stream(main)
        return streams

    def _load_prefix(self, row: int, slots: list, prefix: RowPrefix) -> None:
        """Copy ``prefix``'s latent rows from its row into ``row`` and load its linear states into ``slots``."""
        n = prefix.length
        for full, slot, state in zip(self.slots, slots, prefix.linear):
            if isinstance(full, MLACacheSlot):
                if prefix.row != row:
                    full.latent[row, :n].copy_(full.latent[prefix.row, :n])
                    if full.key_scale is not None:
                        full.key_scale[row, :n].copy_(full.key_scale[prefix.row, :n])
            else:
                for (_, dst), (_, src) in zip(self._slot_tensors(slot), self._slot_tensors(state)):
                    dst.copy_(src)

    def _rows(self, state, B: int):
        """A view of the first B rows of a linear state (in-place updates reach the preallocated buffers)."""
        from hylo_bench.models.cache import map_state

        return state if B == self.max_batch else map_state(state, lambda t: t[:B])

    def _lm_logits(self, hidden_B1D: torch.Tensor) -> torch.Tensor:
        if self.fused_head:  # final norm in the lm_head GEMV's prologue
            return project(hidden_B1D, self.model.lm_head.weight, Prologue(self.model.model.norm))
        return self.model.lm_head(self.model.model.norm(hidden_B1D))

    def _step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._logits_to_token(self._forward(tok[:, None], None, pos))

    def _fill_synthetic(self, context_tokens: int, gen: torch.Generator) -> None:
        from hylo_bench.decode.mla_layer import MLACacheSlot

        self.reset()
        for slot in self.slots:
            if isinstance(slot, MLACacheSlot):
                slot.latent[:, :context_tokens].normal_(generator=gen)
                if slot.key_scale is not None:
                    slot.key_scale[:, :context_tokens].fill_(1.0)

    def _prepare_decode(self, tok: torch.Tensor, pos: torch.Tensor) -> None:
        if self.use_graphs and tok.shape[0] not in self._graphs:
            saved = [t.clone() for t in self._linear_tensors()]
            try:
                self._graphs[tok.shape[0]] = self._capture(tok.shape[0], tok, pos)
            except Exception as exc:  # noqa: BLE001 - an op that cannot be captured: decode eagerly instead
                self.use_graphs, self.graph_error = False, f"{type(exc).__name__}: {exc}"[:300]
                logger.warning("CUDA-graph capture failed, decoding eagerly: %s", self.graph_error)
                torch.cuda.synchronize(self.device)
            for dst, src in zip(self._linear_tensors(), saved):
                dst.copy_(src)

    def _decode(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not self.use_graphs:
            return self._step_fn(tok, pos)
        B = tok.shape[0]
        if B not in self._graphs:
            self._graphs[B] = self._capture(B, tok, pos)
        graph, s_tok, s_pos, s_out = self._graphs[B]
        s_tok.copy_(tok)
        s_pos.copy_(pos)
        graph.replay()
        return s_out.clone()

    def _capture(self, B: int, tok: torch.Tensor, pos: torch.Tensor):
        """Capture ``_step`` for batch B. Warm-up and capture run real steps, so the caller saves the linear states
        first and restores them afterwards (the latent row they write at ``pos`` is rewritten by the real step)."""
        s_tok, s_pos = tok.clone(), pos.clone()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton compile / autotune (and torch.compile) outside the capture
                self._step_fn(s_tok, s_pos)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            s_out = self._step_fn(s_tok, s_pos)
        self.cuda_graphs = True
        logger.info("decode step captured in a CUDA graph (batch %d)", B)
        return graph, s_tok, s_pos, s_out


class TransformerEngine(_EngineBase):
    """Baseline engine for a plain transformers Llama / Qwen3 causal LM (GQA attention, rotate-half RoPE).

    Runs the model's own decoder layers (:mod:`hylo_bench.decode.transformer_layer`) over a preallocated K/V cache
    [max_batch, n_kv, max_context, d_h] per layer (bf16 on GPU: L * 2 * n_kv * d_h * 2 bytes per token, the
    backbone row of ``hylo-bench kv``). Prefill chunks attend over the cached prefix with SDPA (lower-right causal
    mask, GQA without repeating K/V: flash on GPU); decode attends over the filled prefix. Eager only. The model is
    switched to the engine's attention function (transformers' SDPA for any other caller).

    Raises:
        ValueError: a model whose layers lack ``self_attn.{q,k,v,o}_proj``.
    """

    def __init__(self, model, max_batch: int, max_context: int, prefill_chunk: int = 8192, *,
                 cuda_graphs: bool = False):
        super().__init__(model, max_batch, max_context, prefill_chunk)
        if cuda_graphs:
            logger.warning("cuda_graphs=True is not supported by TransformerEngine; decoding eagerly")
        inner = model.model
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError(f"{type(model).__name__}: TransformerEngine needs Llama/Qwen3-style attention "
                             f"(self_attn.q_proj/k_proj/v_proj/o_proj)")
        cfg = model.config
        d_h = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w = attn.q_proj.weight
        self.kv = PrefixKVCache(len(self.layers), max_batch, cfg.num_key_value_heads, max_context, d_h, w.dtype,
                                w.device)
        use_prefix_attention(model)
        self.length = 0

    def cache_bytes(self) -> dict[str, int]:
        """``{"kv": bytes}`` of the preallocated K/V cache."""
        return {"kv": sum(t.numel() * t.element_size() for t in self.kv.tensors())}

    def reset(self) -> None:
        self.length = 0

    def _fill_synthetic(self, context_tokens: int, gen: torch.Generator) -> None:
        for t in self.kv.tensors():
            t[:, :, :context_tokens].normal_(generator=gen)
        self.length = context_tokens

    def _forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [B, T] at positions ``start ..`` through the model's layers -> last hidden state [B, 1, D]."""
        B, T = ids.shape
        inner = self.model.model
        pos = torch.arange(start, start + T, device=ids.device).expand(B, T)
        h = inner.embed_tokens(ids)
        rope = inner.rotary_emb(h, pos)
        self.kv.start, self.kv.batch = start, B
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_ids=pos, past_key_values=self.kv, use_cache=True,
                        position_embeddings=rope, **{START_KWARG: start})
            h = out[0] if isinstance(out, tuple) else out  # transformers < 5 returned a tuple
        self.length = start + T
        return h[:, -1:]

    def _prefill(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        return self._forward(ids, start)

    def _lm_logits(self, hidden_B1D: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden_B1D))

    def _decode(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self._logits_to_token(self._forward(tok[:, None], self.length))


def greedy_token(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``logits.argmax(-1)`` for logits [B, V] -> [B] int64, in two stages: the maximum of each ``chunk`` of the
    vocabulary, then the best chunk. Same result (the first maximal index, as ``torch.argmax``; NaN-free logits),
    but under ``torch.compile`` the first stage runs B * V / chunk programs instead of one per row: a batch-1
    argmax over Qwen3's 151,936 logits took 34 us on the H200 as one reduction (benchmarks/decode_profile.py)."""
    B, V = logits.shape
    if V <= chunk:
        return logits.argmax(-1)
    groups = -(-V // chunk)
    padded = F.pad(logits, (0, groups * chunk - V), value=float("-inf"))
    best, where = padded.view(B, groups, chunk).max(-1)  # [B, G]: first maximal index within each chunk
    g = best.argmax(-1)  # the first chunk holding the maximum
    return g * chunk + where.gather(-1, g[:, None])[:, 0]


def _weak_step(engine: Engine) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``engine._step`` reached through a weak reference (``torch.compile`` traces through it)."""
    ref = weakref.ref(engine)

    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return ref()._step(tok, pos)

    return step


def make_engine(model, max_batch: int, max_context: int, prefill_chunk: int = 8192, **kw):
    """:class:`Engine` for a HyLo model, :class:`TransformerEngine` for anything else (``cuda_graphs`` is
    passed to both; the backend switches only to :class:`Engine`)."""
    if hasattr(getattr(model, "config", None), "mixer_types"):
        return Engine(model, max_batch, max_context, prefill_chunk, **kw)
    return TransformerEngine(model, max_batch, max_context, prefill_chunk,
                             cuda_graphs=kw.get("cuda_graphs", False))
