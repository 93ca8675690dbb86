"""RULER samples per second on one GPU: Qwen3-1.7B-shaped 7MLA21GDN hybrid vs the Qwen3-1.7B-shaped transformer.

Both models are built from their configs with random bf16 weights (speed and memory do not depend on weight
values; with random weights no answer stops early, so every sample decodes its task's full ``max_gen_toks``:
an upper bound on time). Prompts come from the real RULER pipeline (``hylo_bench.tasks.ruler``) sized with the
demo tokenizer (prompt lengths are what matter), generated once and shared by both models (same cache, same
prompts). Each (model, engine, length) is timed around ``evaluate_model`` (prefill + greedy decode + scoring, at
``--batch-size``: the hybrid's continuous-batching slots, the transformer's left-padded ``generate()`` batch). The
transformer runs once per ``--transformer-engines`` entry (``generate``: dynamic cache, eager; ``static``: a
preallocated ``StaticCache``, whose decode step transformers compiles on CUDA). A model's first point includes
its one-time costs (CUDA-graph capture, compilation).

Writes benchmarks/results/ruler_throughput.json (one record per model and length: ``samples_per_s``,
``seconds``, ``num_samples``, ``peak_memory_gib``, ``status`` ok|oom; with continuous batching also ``prefill_s``,
``decode_s`` and ``other_s``: the engine's prefill and decode seconds and the rest, host work and one-time costs;
``prefill_first_s``, ``prefill_median_s``, ``prefill_max_s``: one prompt's prefill, the first of the point and
the median and slowest of all (prompts prefilled together, ``prefill_streams`` > 1, each count their group's wall
time over its size); ``prefill_tokens`` and ``prefix_reused_tokens``: prompt tokens, and those taken from
a shared prefix instead of prefilled, ``--prefix-sharing``; ``decode_step_first_s``, ``decode_step_median_s``,
``decode_step_max_s``: one decode step, host work included; ``decode_rows``: the rows of every decode step summed
(the occupied slots rounded up to a multiple of 8); ``prefill_streams``: prompts prefilled at
once, ``--prefill-streams``; ``host_engine_build_s`` and ``host_encode_wait_s``: the parts of ``other_s`` spent
building engines and waiting for prompts' token ids) after every point. ``--samples 8,24`` runs a point per
sample count: a point's one-time costs (the first prompts' tokenisation, the engine's set-up, the first decode
step's CUDA-graph capture) weigh less in a longer run, as in a full RULER run of hundreds of samples a task.
Usage (H200): python benchmarks/ruler_throughput.py --lengths 8k,32k,64k,128k --samples 2
(``--lengths 64k --samples 4 --batch-size 8 --transformer-engines static``: the batched 64K point of issue 22)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import result_envelope, write_result  # noqa: E402

QWEN3_17B = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=262144,
                 head_dim=128, num_key_value_heads=8, hidden_act="silu", bos_token_id=0, eos_token_id=1,
                 hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 tie_word_embeddings=True)
RECIPE = "HyLo-Qwen-7MLA21GDN-8K-SFT"


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("A_log") or name.endswith("dt_bias"):
                continue  # keep the module's own init (ones / the GDN decay init)
            p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def build_transformer():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**QWEN3_17B)
    cfg._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return _randomize(model), {"name": "qwen3-1.7b-shaped", "path": "random", "hash": "random", "layout": "28ATTN",
                               "kind": "transformer"}


def build_hybrid():
    from hylo_bench.config import recipes as R
    from hylo_bench.models.hybrid import HyLoForCausalLM

    cfg = R.recipe_hybrid_config(R.load_recipe(RECIPE))
    with torch.device("cuda"):
        model = HyLoForCausalLM(cfg).to(torch.bfloat16)
    return _randomize(model), {"name": "7MLA21GDN-qwen3-1.7b-shaped", "path": "random", "hash": "random",
                               "layout": "7MLA21GDN", "kind": "hylo"}


class HostTimers:
    """Seconds of two host costs inside ``evaluate_model``, for the records' ``other_s`` split: building engines
    (``hylo_bench.decode.engine.make_engine``, caches included) and waiting for prompts' token ids
    (``PromptEncoder.submit(...).result()`` and ``submit_many``'s). Installed by wrapping those public entry points."""

    def __init__(self) -> None:
        import hylo_bench.decode.engine as engine_mod
        from hylo_bench.tasks.ruler import runner

        self.engine_build_s = self.encode_wait_s = 0.0
        make = engine_mod.make_engine
        submit, submit_many = runner.PromptEncoder.submit, runner.PromptEncoder.submit_many
        timers = self

        def timed_make(*a, **kw):
            t0 = time.perf_counter()
            try:
                return make(*a, **kw)
            finally:
                timers.engine_build_s += time.perf_counter() - t0

        class TimedFuture:
            def __init__(self, fut) -> None:
                self.fut = fut

            def result(self, timeout=None):
                t0 = time.perf_counter()
                try:
                    return self.fut.result(timeout)
                finally:
                    timers.encode_wait_s += time.perf_counter() - t0

            def cancel(self) -> bool:
                return self.fut.cancel()

        engine_mod.make_engine = timed_make
        runner.PromptEncoder.submit = lambda enc, prompt: TimedFuture(submit(enc, prompt))
        runner.PromptEncoder.submit_many = lambda enc, prompts: [TimedFuture(f) for f in submit_many(enc, prompts)]

    def take(self) -> dict:
        out = {"host_engine_build_s": round(self.engine_build_s, 3), "host_encode_wait_s": round(self.encode_wait_s, 3)}
        self.engine_build_s = self.encode_wait_s = 0.0
        return out


class HostSampler:
    """Where the main thread spends the time that is neither prefill nor decode: a daemon thread reads the main
    thread's stack every ``interval_s`` and counts, for samples outside ``prefill_rows_shared`` and ``decode_step``,
    the innermost frame of this project's code (file:line function). ``take()`` returns the top entries as one
    string, "frame seconds s; ..." (a flat record field)."""

    ENGINE = ("prefill_rows_shared", "decode_step")

    def __init__(self, interval_s: float = 0.002) -> None:
        import collections
        import threading

        self.interval_s = interval_s
        self.counts: collections.Counter = collections.Counter()
        self.main = threading.main_thread().ident
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="host-sampler")
        self.thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self.stop.wait(self.interval_s):
            now = time.perf_counter()
            dt, last = now - last, now  # the wait oversleeps: count the time that passed, not the interval
            frame = sys._current_frames().get(self.main)
            ours, inside = None, False
            while frame is not None:
                code = frame.f_code
                if code.co_name in self.ENGINE:
                    inside = True
                    break
                if ours is None and ("hylo_bench" in code.co_filename or "benchmarks" in code.co_filename):
                    ours = f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"
                frame = frame.f_back
            if not inside:
                self.counts[ours or "other"] += dt

    def take(self, top: int = 12) -> str:
        out = "; ".join(f"{k} {v:.3f} s" for k, v in self.counts.most_common(top))  # records stay flat
        self.counts.clear()
        return out


def main() -> None:
    from hylo_bench.config.units import parse_length
    from hylo_bench.decode import batching, greedy
    from hylo_bench.decode import engine as engine_mod
    from hylo_bench.decode.greedy import PREFILL_CHUNK_TOKENS, resolve_engine
    from hylo_bench.models.checkpoint import demo_teacher_dir
    from hylo_bench.models.loading import load_tokenizer
    from hylo_bench.tasks.ruler import RulerConfig, evaluate_model
    from hylo_bench.tasks.ruler.cache import load_or_generate, tokenizer_hash
    from hylo_bench.text.haystack import default_haystack_text

    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8k,32k,64k,128k")
    ap.add_argument("--tasks", default="niah_single_1,niah_multikey_2,ruler_vt,ruler_cwe")
    ap.add_argument("--samples", default="2", help="samples per task, comma-separated (one point each: a point's "
                    "one-time costs, the first prompts' tokenisation and the engine's set-up, weigh less in a "
                    "longer one)")
    ap.add_argument("--work", default="/tmp/ruler-throughput")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ruler_throughput.json"))
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new points after this many seconds")
    ap.add_argument("--engine", default="auto", help="ruler --engine for the hybrid (auto: the native engine on CUDA)")
    ap.add_argument("--transformer-engines", default="generate,static",
                    help="ruler --engine values for the transformer, comma-separated, one record each ('' = none)")
    ap.add_argument("--batch-size", default="1", help="ruler --batch-size, comma-separated (one point each; more "
                    "slots read the weights once per decode step for more rows)")
    ap.add_argument("--prefill-chunks", default="",
                    help="ruler --prefill-chunk values for the hybrid, comma-separated, one point each ('' = default)")
    ap.add_argument("--prefix-sharing", default="on",
                    help="ruler --prefix-sharing for the hybrid: on, off or on,off (one point each; 'on' passes "
                    "nothing, so a checkout without the option runs too)")
    ap.add_argument("--prefill-streams", default="",
                    help="prompts the hybrid's continuous batching prefills at once (hylo_bench.decode.greedy."
                    "PREFILL_STREAMS), comma-separated, one point each ('' = the library's default)")
    ap.add_argument("--sample-host", action="store_true", help="record where the host's time outside prefill and "
                    "decode goes (a stack sampler on the main thread; ``host_hotspots`` in each record)")
    ap.add_argument("--prefix-blocks", default="",
                    help="hylo_bench.decode.engine.PREFIX_BLOCK values for the hybrid (the granularity of prefix "
                    "sharing, tokens), comma-separated, one point each ('' = the library's)")
    ap.add_argument("--switch-interval-ms", default="",
                    help="sys.setswitchinterval values for the hybrid, in ms, comma-separated, one point each ('' = "
                    "Python's 5 ms): how long the main thread, which launches the GPU's work, may wait for the GIL "
                    "that a prompt-encoding thread holds")
    ap.add_argument("--decode-row-multiples", default="",
                    help="hylo_bench.decode.batching.DECODE_ROW_MULTIPLE values for the hybrid, comma-separated, one "
                         "point each ('' = the library's): a decode step's rows are the occupied slots rounded up to "
                         "a multiple of this (the batch size: every slot at every step)")
    ap.add_argument("--repeat", type=int, default=1, help="run each point this many times in the same process (the "
                    "first pays the one-time costs; later ones are the steady state)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    default_switch = sys.getswitchinterval()
    default_rows = batching.DECODE_ROW_MULTIPLE
    default_block = engine_mod.PREFIX_BLOCK
    host = HostTimers()
    sampler = HostSampler() if args.sample_host else None
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    tasks = args.tasks.split(",")
    sample_counts = [int(v) for v in args.samples.split(",")]
    batch_sizes = [int(v) for v in args.batch_size.split(",")]
    tok = load_tokenizer(demo_teacher_dir())
    tok.model_max_length = 1 << 30
    work = Path(args.work)
    doc = result_envelope("ruler_throughput")
    doc.update(tasks=tasks, samples_per_task=sample_counts, tokenizer="hylo-bench demo tokenizer (vocab 3148)",
               models={"transformer": "Qwen3-1.7B-shaped (28 attention layers), random bf16",
                       "hybrid": f"{RECIPE} layout (7 MLA + 21 GDN), random bf16"})
    # same prompts for both models: generate every sample once into the shared cache, timed separately
    text = default_haystack_text()
    for length in lengths:
        t0 = time.perf_counter()
        for task in tasks:
            load_or_generate(task, tok, length, max(sample_counts), seed=42, haystack_text=text, chat_template=False,
                             cache_dir=work / "cache", tok_hash=tokenizer_hash(tok))
        doc.setdefault("sample_generation_s", {})[str(length)] = round(time.perf_counter() - t0, 3)
        print(f"samples at {length}: {time.perf_counter() - t0:.1f} s", flush=True)
    transformer_engines = [e for e in args.transformer_engines.split(",") if e]
    plan = [(build_hybrid, [args.engine])] + ([(build_transformer, transformer_engines)] if transformer_engines else [])
    chunks = [parse_length(c) for c in args.prefill_chunks.split(",") if c] or [None]
    for build, engines in plan:
        model, info = build()
        hybrid = info["kind"] == "hylo"
        sharing = args.prefix_sharing.split(",") if hybrid else ["on"]
        # repeats outermost: an A/B's variants alternate after the first point has paid the one-time costs
        streams = [int(v) for v in args.prefill_streams.split(",") if v] if hybrid else []
        switch = [float(v) for v in args.switch_interval_ms.split(",") if v] if hybrid else []
        row_multiples = [int(v) for v in args.decode_row_multiples.split(",") if v] if hybrid else []
        blocks = [parse_length(v) for v in args.prefix_blocks.split(",") if v] if hybrid else []
        points = [(e, n, c, sh, st, k, bs, sw, r, rm, pb) for r in range(args.repeat) for e in engines for n in lengths
                  for c in (chunks if hybrid else [None]) for sh in sharing for st in (streams or [None])
                  for k in sample_counts for bs in batch_sizes for sw in (switch or [None])
                  for rm in (row_multiples or [None]) for pb in (blocks or [None])]
        for (engine, length, chunk, share, n_streams, samples, batch_size, switch_ms, repeat, row_multiple,
             block) in points:
            if time.perf_counter() - t_start > args.budget_s:
                doc["records"].append({"model": info["name"], "layout": info["layout"], "seq_len": length,
                                       "engine": engine, "batch_size": batch_size,
                                       "status": "skipped_time_budget"})
                write_result(Path(args.out), doc)
                continue
            extra = {} if chunk is None else {"prefill_chunk": chunk}  # (a checkout without the option: default)
            if share == "off":
                extra["prefix_sharing"] = False
            if n_streams is not None:
                greedy.PREFILL_STREAMS = n_streams
            sys.setswitchinterval(default_switch if switch_ms is None else switch_ms / 1000)
            batching.DECODE_ROW_MULTIPLE = default_rows if row_multiple is None else row_multiple
            engine_mod.PREFIX_BLOCK = default_block if block is None else block
            cfg = RulerConfig(model=info["name"], lengths=[length], tasks=tasks, samples=samples,
                              results_dir=str(work), device="cuda", engine=engine, batch_size=batch_size,
                              beyond_context=True, **extra)  # random weights: speed, not scores, past 40,960 tokens
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            host.take()
            if sampler is not None:
                sampler.take()
            t0 = time.perf_counter()
            rec = {"model": info["name"], "layout": info["layout"], "seq_len": length, "batch_size": batch_size,
                   "num_samples": len(tasks) * samples, "samples_per_task": samples,
                   "engine": resolve_engine(model, engine),
                   "prefill_chunk": (chunk or PREFILL_CHUNK_TOKENS) if hybrid else None, "repeat": repeat,
                   "prefix_sharing": share if hybrid else None,
                   "prefill_streams": getattr(greedy, "PREFILL_STREAMS", None) if hybrid else None,
                   "switch_interval_ms": round(sys.getswitchinterval() * 1000, 3),
                   "decode_row_multiple": batching.DECODE_ROW_MULTIPLE if hybrid else None,
                   "prefix_block": (engine_mod.default_prefix_block(chunk or PREFILL_CHUNK_TOKENS) if hybrid
                                    else None)}
            try:
                out = evaluate_model(model, tok, info, cfg)
                torch.cuda.synchronize()
                secs = time.perf_counter() - t0
                rec.update(status="ok", seconds=round(secs, 3), samples_per_s=round(rec["num_samples"] / secs, 4),
                           mean_score=out["mean"][str(length)])
                st = out.get("engine_stats")
                if st:  # where the time went: the engine's prefill and decode; the rest is host work
                    rec.update(prefill_s=round(st["prefill_s"], 3), decode_s=round(st["decode_s"], 3),
                               prefills=st["prefills"], decode_steps=st["decode_steps"],
                               generated_tokens=st["generated_tokens"],
                               prefill_tokens=st.get("prefill_tokens"),
                               prefix_reused_tokens=st.get("prefix_reused_tokens"),  # None: a checkout without it
                               decode_rows=st.get("decode_rows"),
                               **{k: round(st[k], 5) for k in ("prefill_first_s", "prefill_median_s",
                                                               "prefill_max_s", "decode_step_first_s",
                                                               "decode_step_median_s", "decode_step_max_s")
                                  if st.get(k) is not None},
                               other_s=round(secs - st["prefill_s"] - st["decode_s"], 3), **host.take())
                if sampler is not None:
                    rec["host_hotspots"] = sampler.take()
            except torch.cuda.OutOfMemoryError as exc:
                rec.update(status="oom", error=str(exc).splitlines()[0][:200])
            rec["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            doc["records"].append({k: v for k, v in rec.items() if v is not None})  # the store drops nulls
            write_result(Path(args.out), doc)
            print(rec, flush=True)
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
