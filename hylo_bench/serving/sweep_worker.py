"""One serving-sweep point in its own process: build / load the model, run the engine, write one flat record.

Usage (what :mod:`hylo_bench.serving.sweep` runs): ``python -m hylo_bench.serving.sweep_worker SPEC.json OUT.json``.
A ``torch.cuda.OutOfMemoryError`` becomes ``status: "oom"``; any other exception ``status: "error"``.
With a time budget (spec key ``time_left_s``) a native-engine point whose full prefill would not fit is measured in
``mode: "estimated"`` (:func:`run_point`).
Test hook: ``HYLO_BENCH_SWEEP_OOM_AT=<tokens>`` raises a simulated OutOfMemoryError for points with
``seq_len >= tokens`` (after the model is built), so CPU tests can exercise the OOM path.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

OOM_HOOK_ENV = "HYLO_BENCH_SWEEP_OOM_AT"
GIB = 2 ** 30


def memory_model_gib(model, info: dict[str, Any], batch: int, tokens: int) -> dict[str, float | None]:
    """``hylo-bench kv`` memory-model predictions (GiB) for bf16 weights and caches."""
    import torch

    from hylo_bench.models import memory as M

    n = sum(p.numel() for p in model.parameters())
    n_fp32 = sum(p.numel() for p in model.parameters() if p.dtype == torch.float32)
    cfg = info["config"]
    if info["kind"] == "hybrid":
        est = M.estimate(cfg, weight_params=n, fp32_params=n_fp32)
        kw = dict(weight_bytes=est["weight_bytes"], batch=batch, tokens=tokens,
                  state_bytes_per_sequence=est["state_bytes_per_sequence"])
        pure = M.serving_peak_bytes(kv_bytes_per_token=est["kv_cache_bytes_per_token"], **kw)
        engine = M.serving_peak_bytes(kv_bytes_per_token=est["kv_cache_bytes_per_token"]
                                      + M.engine_extra_bytes_per_token(cfg), **kw)
    else:
        d_h = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * d_h * M.BF16_BYTES
        pure = engine = M.serving_peak_bytes(weight_bytes=n * M.BF16_BYTES, batch=batch, tokens=tokens,
                                             kv_bytes_per_token=kv)
    return {"kv_model_gib": pure / GIB, "kv_model_engine_gib": engine / GIB}


def prefill_attention_flops(config, batch: int, tokens: int) -> float:
    """FLOPs of the prefill's attention scores and weighted values under the causal mask: query t sees t + 1 keys,
    so ``B * 2 * T (T + 1) / 2 * (d_qk + d_v) * n_heads`` per attention layer (2 FLOPs per multiply-add; softmax
    not counted). HyLo: its MLA layers (``qk_head_dim``, ``v_head_dim``); a transformer: every layer,
    ``d_qk = d_v = head_dim``. The linear layers' cost is linear in T and not counted; this is what makes long
    prefills slow."""
    pairs = float(tokens) * (tokens + 1) / 2
    if hasattr(config, "mixer_types"):
        per_layer = 2.0 * pairs * (config.qk_head_dim + config.v_head_dim) * config.num_attention_heads
        return batch * per_layer * len(config.mla_layers)
    d_h = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return batch * 2.0 * pairs * 2 * d_h * config.num_attention_heads * config.num_hidden_layers


def _hf_generate_timed(model, ids, steps: int):
    """Eager transformers loop (the ``hf`` backend): one full prefill forward with ``logits_to_keep=1``, then
    one forward per token with the model's own cache. Returns (tokens [B, steps], Timings)."""
    import torch

    from hylo_bench.decode.engine import Timings, peak_gib, sync_device

    dev = ids.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    with torch.inference_mode():
        sync_device(dev)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1)
        sync_device(dev)
        ttft = time.perf_counter() - t0
        prefill_peak = peak_gib(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        cache, toks, steps_s = out.past_key_values, [tok], []
        for _ in range(steps - 1):
            sync_device(dev)
            s0 = time.perf_counter()
            out = model(input_ids=tok[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1)
            sync_device(dev)
            steps_s.append(time.perf_counter() - s0)
            toks.append(tok)
    return torch.stack(toks, 1).cpu(), Timings(batch_size=ids.shape[0], prompt_tokens=ids.shape[1], new_tokens=steps,
                                               ttft_s=ttft, decode_step_s=steps_s, prefill_peak_gib=prefill_peak,
                                               decode_peak_gib=peak_gib(dev))


class _StepClock:
    """A logits processor that timestamps every generated token of ``generate`` (called once per token, right
    after its forward): CUDA events on GPU (no host synchronisation inside the loop), wall clock on CPU."""

    def __init__(self, device):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.marks: list = []

    def mark(self):
        import torch

        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def __call__(self, input_ids, scores):
        self.marks.append(self.mark())
        return scores

    def seconds(self, start) -> list[float]:
        """Seconds from ``start`` to the first token, then between consecutive tokens (device synchronised)."""
        import itertools

        import torch

        pairs = itertools.pairwise([start, *self.marks])
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


def _hf_static_generate_timed(model, ids, steps: int, compile: bool, warmup: bool):
    """transformers' own fast path (the ``static`` baseline engines): ``generate`` with a ``StaticCache`` of
    T + steps tokens, greedy, exactly ``steps`` tokens; with ``compile`` its automatic ``torch.compile`` of the decode
    forward (``CompileConfig(mode="reduce-overhead")``: Inductor plus CUDA graphs), else ``disable_compile``.
    Per-token times come from a logits processor (:class:`_StepClock`). The warm-up runs a 3-token generation over
    the first 64 prompt tokens with the same cache (same shapes: the compiled step is reused).
    Returns (tokens [B, steps], Timings).

    Public APIs only: ``StaticCache``, ``CompileConfig``, ``LogitsProcessorList`` (transformers >= 4.48).
    """
    import torch
    from transformers import CompileConfig, LogitsProcessorList, StaticCache

    from hylo_bench.decode.engine import Timings, peak_gib, sync_device

    dev = ids.device
    B, T = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=T + steps)
    kw = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0, "past_key_values": cache,
          "compile_config": CompileConfig(fullgraph=False, mode="reduce-overhead") if compile else None,
          "disable_compile": not compile}

    def gen(x, n, clock=None):
        cache.reset()
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              logits_processor=LogitsProcessorList([clock] if clock else []), **kw)

    with torch.inference_mode():
        if warmup:
            gen(ids[:, : min(T, 64)], 3)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        clock = _StepClock(dev)
        sync_device(dev)
        start = clock.mark()
        out = gen(ids, steps, clock)
        secs = clock.seconds(start)
    return out[:, T:].cpu(), Timings(batch_size=B, prompt_tokens=T, new_tokens=steps, ttft_s=secs[0],
                                     decode_step_s=secs[1:], decode_peak_gib=peak_gib(dev), cuda_graphs=compile)


FULL_RUN_MARGIN = 1.15, 20.0
"""A full run is chosen when ``1.15 * estimated TTFT + 20 s`` fits the time left: the chunk estimate was up to 10 %
low at 2M tokens on an H200, and the decode steps and CUDA-graph capture come on top of the prefill."""


def _prefill_estimate(engine, B: int, T: int, chunk: int, rec: dict[str, Any]) -> float:
    """TTFT estimate (s) from two timed prefill chunks, written into ``rec`` (``first_chunk_s``, ``last_chunk_s``,
    ``ttft_estimated_s``, ``prefill_chunk_peak_gib``); 0.0 below 3 chunks (the full prefill is then at most two
    chunks). Chunk cost grows linearly with its offset, so TTFT ~= n_chunks * (first + last) / 2."""
    import torch

    from hylo_bench.decode.engine import peak_gib

    n_chunks = -(-T // chunk)
    if n_chunks < 3:
        return 0.0
    engine.time_prefill_chunk(B, 0, chunk)  # untimed: kernel compilation / autotune
    t_first = engine.time_prefill_chunk(B, 0, chunk)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    t_last = engine.time_prefill_chunk(B, T - chunk, chunk)
    est = n_chunks * (t_first + t_last) / 2
    rec.update(prefill_chunk_peak_gib=peak_gib(engine.device), ttft_estimated_s=est, first_chunk_s=t_first,
               last_chunk_s=t_last)
    return est


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one point; returns the flat record (raises on failure; :func:`main` turns that into a status).

    Spec keys: ``model`` (see :func:`hylo_bench.serving.build.build_model`), ``backend`` ("native" | "hf"),
    ``seq_len``, ``batch_size``, ``decode_steps``, ``prefill_chunk``, ``cuda_graphs``, ``compile`` (optional),
    ``device``, ``dtype``, ``warmup`` (bool), ``seed``, ``engine`` (optional: ``"static"`` runs a transformer through
    transformers' static-cache ``generate``, :func:`_hf_static_generate_timed`, compiled with CUDA graphs when
    ``compile`` or ``cuda_graphs`` is set on CUDA).

    ``time_left_s`` (optional, seconds from this call; the sweep's budget less what later points need): with the
    native engine the first and last prefill chunk are timed (:func:`_prefill_estimate`) and, when the full run
    would not fit (:data:`FULL_RUN_MARGIN`), decode is measured after a synthetic context of ``seq_len`` tokens
    instead (``Engine.decode_benchmark``; decode cost does not depend on the cache values): ``mode: "estimated"``,
    ``ttft_s`` None, ``ttft_estimated_s`` and ``why_estimated`` set. A full run with the estimate records
    ``ttft_estimate_ratio`` (estimate / measured).

    Every record carries its decode bound (:func:`hylo_bench.serving.bound.bound_fields`: ``bound_tpot_s``,
    ``fraction_of_bound``, the byte counts), ``mode`` (``"full"``: a full prefill was timed), ``params`` (parameter
    count) and ``prefill_attention_flops`` (:func:`prefill_attention_flops`).
    """
    import torch

    from hylo_bench.config.device import default_device, default_dtype, parse_dtype
    from hylo_bench.decode.engine import make_engine
    from hylo_bench.serving.build import build_model

    start = time.perf_counter()
    device = spec.get("device") or default_device()
    dtype = parse_dtype(spec.get("dtype")) or default_dtype(device)
    T, B, steps = spec["seq_len"], spec["batch_size"], spec["decode_steps"]
    t0 = time.perf_counter()
    model, info = build_model(spec["model"], device, dtype)
    rec: dict[str, Any] = {"model": info["name"], "layout": info["layout"], "kind": info["kind"],
                           "weights": info["weights"], "device": torch.cuda.get_device_name(device)
                           if device.startswith("cuda") else "cpu", "dtype": str(dtype).removeprefix("torch."),
                           "build_s": time.perf_counter() - t0}
    rec["params"] = sum(p.numel() for p in model.parameters())
    rec.update(memory_model_gib(model, info, B, T + steps))
    rec["prefill_attention_flops"] = prefill_attention_flops(model.config, B, T)
    hook = os.environ.get(OOM_HOOK_ENV)
    if hook and T >= int(hook):
        raise torch.cuda.OutOfMemoryError(f"simulated by {OOM_HOOK_ENV}={hook}")
    gen = torch.Generator().manual_seed(spec.get("seed", 0))
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=gen).to(device)
    if spec.get("engine") == "static":
        if info["kind"] == "hybrid":
            raise ValueError("engine 'static' (transformers' static-cache generate) serves transformer baselines; "
                             "HyLo models use the native engine")
        fast = bool(spec.get("compile") or spec.get("cuda_graphs")) and device.startswith("cuda")
        _, timings = _hf_static_generate_timed(model, ids, steps, fast, spec.get("warmup", True))
        rec["engine"] = "transformers-static" + ("-compiled" if fast else "")
    elif spec["backend"] == "hf":
        if spec.get("warmup", True):
            _hf_generate_timed(model, ids[:, : min(T, 64)], 2)
        _, timings = _hf_generate_timed(model, ids, steps)
        rec["engine"] = "transformers-eager"
    else:
        chunk = min(spec["prefill_chunk"], T)
        kw = {"compile": True} if spec.get("compile") else {}  # make_engine passes it to HyLo engines only
        engine = make_engine(model, B, T + steps, chunk, cuda_graphs=spec.get("cuda_graphs", False), **kw)
        rec["prefill_chunk"] = chunk
        rec["kv_cache_gib"] = sum(engine.cache_bytes().values()) / GIB
        w0 = time.perf_counter()
        if spec.get("warmup", True):  # compiles / autotunes kernels and captures the decode graph
            engine.generate(ids[:, :chunk], min(steps, 3))
        rec["warmup_s"] = time.perf_counter() - w0
        left = spec.get("time_left_s")
        est = _prefill_estimate(engine, B, T, chunk, rec) if left is not None else 0.0
        if left is not None:
            left -= time.perf_counter() - start
        factor, margin = FULL_RUN_MARGIN
        if left is None or est * factor + margin < left:
            _, timings = engine.generate(ids, steps)
            rec["mode"] = "full"
            if est:
                rec["ttft_estimate_ratio"] = est / timings.ttft_s
        else:
            timings = engine.decode_benchmark(B, T, steps, seed=spec.get("seed", 0))
            rec["mode"] = "estimated"
            rec["why_estimated"] = (f"full prefill estimated at {est:.3g} s (first/last chunk timing): with the "
                                    f"decode more than the {max(left, 0.0):.0f} s left in the budget" if est else
                                    f"budget exhausted ({max(left, 0.0):.0f} s left after the reserve)")
        rec["engine"] = type(engine).__name__
        rec["graph_error"] = getattr(engine, "graph_error", None)
    rec.update(timings.to_dict())
    from hylo_bench.serving.bound import bound_fields

    rec.setdefault("mode", "full")
    if rec["mode"] == "estimated":
        rec["ttft_s"] = None  # decode ran after a synthetic context: no prefill was timed
    rec.update(bound_fields(model, B, T, timings.tpot_s, device))
    peaks = [p for p in (timings.prefill_peak_gib, rec.get("prefill_chunk_peak_gib"), timings.decode_peak_gib)
             if p is not None]
    rec["peak_memory_gib"] = max(peaks) if peaks else None
    if timings.decode_peak_gib is not None and dtype == torch.bfloat16:
        for key in ("kv_model", "kv_model_engine"):
            rec[f"{key}_err_pct"] = 100.0 * (timings.decode_peak_gib - rec[f"{key}_gib"]) / rec[f"{key}_gib"]
    return rec


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    out_path = argv[1]
    t0 = time.perf_counter()
    rec: dict[str, Any] = {}
    try:
        rec = run_point(spec)
        rec["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - every failure becomes a recorded status
        import torch

        rec["status"] = "oom" if isinstance(exc, torch.cuda.OutOfMemoryError) else "error"
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:500]
        if rec["status"] == "error":
            traceback.print_exc()
    rec["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    rec["peak_memory_source"] = "cuda_max_allocated" if rec.get("peak_memory_gib") is not None else "rss"
    if rec["status"] == "ok" and rec.get("peak_memory_gib") is None:  # CPU: the process's peak RSS
        rec["peak_memory_gib"] = rec["peak_rss_gib"]
    rec["wall_s"] = time.perf_counter() - t0
    from hylo_bench.io_utils import atomic_write_json

    atomic_write_json(out_path, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
