"""The ``hylo-bench`` command line (typer). Each command builds a config and calls one public function.

A model argument is a hub id, a local checkpoint directory, or ``demo`` (the embedded teacher).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.logging import RichHandler

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Upcycle Transformers into HyLo hybrids (MLA + Gated DeltaNet) and benchmark them.")
console = Console(stderr=True)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False)])


def _fail(e: Exception) -> None:
    console.print(f"[bold red]error:[/] {e}")
    raise typer.Exit(2)


def _int_list(text: Optional[str]) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: expected comma-separated layer indices, e.g. 1,5,9") from None


@app.command()
def upcycle(
    out: Path = typer.Option(..., "--out", help="Output directory (resumes if it holds an earlier run)."),
    base: str = typer.Option("demo", "--base", help="Llama / Qwen3 checkpoint: hub id, local dir or 'demo'."),
    teacher: Optional[str] = typer.Option(None, "--teacher", help="Distillation teacher (default: the base)."),
    layout: Optional[str] = typer.Option(None, "--layout", help="e.g. 7MLA21GDN (default placement)."),
    mla_layers: Optional[str] = typer.Option(None, "--mla-layers", help="Explicit MLA layer indices, e.g. 1,5,9."),
    data: str = typer.Option("demo", "--data", help="'demo', or a .txt/.jsonl file or directory."),
    stages: Optional[str] = typer.Option(None, "--stages", help="LEN[:ild|kd][@TOKENS],... e.g. 2k:ild@20M,8k@100M."),
    tokens_per_stage: str = typer.Option("1M", "--tokens-per-stage", help="Budget for stages without @TOKENS."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per micro-batch."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    ild_lr: float = typer.Option(2e-4, "--ild-lr"),
    kd_lr: Optional[float] = typer.Option(None, "--kd-lr", help="Default 6e-5 (paper), 1e-3 for the demo."),
    kv_lora_rank: Optional[int] = typer.Option(None, "--kv-lora-rank"),
    q_lora_rank: Optional[int] = typer.Option(None, "--q-lora-rank"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu / cuda (default: cuda if available)."),
    seed: int = typer.Option(42, "--seed"),
    stage_checkpoints: bool = typer.Option(True, "--stage-checkpoints/--no-stage-checkpoints",
                                           help="Save the student after every stage (OUT/stages/)."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing", help="Recompute each layer."),
    eval_windows: int = typer.Option(8, "--eval-windows", help="Held-out windows for the KL before/after."),
) -> None:
    """Upcycle a Transformer into a HyLo hybrid: init, Enhanced-ILD, staged KL distillation."""
    from hylo_bench.upcycle.run import DEMO_STAGES, UpcycleConfig, run
    from hylo_bench.upcycle.stages import parse_token_count

    try:
        demo = base == "demo"
        cfg = UpcycleConfig(out=str(out), base=base, teacher=teacher, layout=layout, mla_layers=_int_list(mla_layers),
                            data=data, stages=stages if stages is not None else (DEMO_STAGES if demo else "2k:ild,8k"),
                            tokens_per_stage=parse_token_count(tokens_per_stage), batch_size=batch_size,
                            grad_accum=grad_accum, ild_lr=ild_lr, kd_lr=kd_lr or (1e-3 if demo else 6e-5),
                            device=device, seed=seed, save_stage_checkpoints=stage_checkpoints,
                            gradient_checkpointing=gradient_checkpointing, eval_windows=eval_windows,
                            mixer_overrides={"kv_lora_rank": kv_lora_rank, "q_lora_rank": q_lora_rank})
        manifest = run(cfg)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        _fail(e)
    kl0, kl1 = manifest["kl_init"], manifest["stages"][-1].get("kl_after")
    note = f" (held-out KL {kl0:.3f} -> {kl1:.3f} nats/token)" if kl0 is not None and kl1 is not None else ""
    console.print(f"[green]student saved to {out}[/]{note}")


@app.command()
def ruler(
    model: Optional[str] = typer.Option(None, "--model", help="Hub id, local dir or 'demo'."),
    lengths: str = typer.Option("4k", "--lengths", help="Comma-separated context lengths (k = 1024)."),
    tasks: str = typer.Option("all", "--tasks", help="'all' or comma-separated task names."),
    samples: int = typer.Option(20, "--samples", help="Samples per task and length."),
    seed: int = typer.Option(42, "--seed"),
    results_dir: Path = typer.Option(Path("hylo-results"), "--results-dir"),
    haystack: Optional[Path] = typer.Option(None, "--haystack", help="Text file for the essay haystack."),
    batch_size: int = typer.Option(1, "--batch-size"),
    chat_template: bool = typer.Option(False, "--chat-template/--no-chat-template"),
    device: Optional[str] = typer.Option(None, "--device"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the scores."),
    list_tasks: bool = typer.Option(False, "--list-tasks", help="Print the task names and exit."),
) -> None:
    """Score a model on RULER tasks at the given context lengths."""
    from hylo_bench.tasks import ruler as R
    from hylo_bench.upcycle.stages import parse_length

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
        cfg = R.RulerConfig(model=model, lengths=length_list,
                            tasks=R.list_tasks() if tasks == "all" else [t.strip() for t in tasks.split(",") if t.strip()],
                            samples=samples, seed=seed, results_dir=str(results_dir),
                            haystack_path=str(haystack) if haystack else None, batch_size=batch_size,
                            chat_template=chat_template, device=device)
        result = R.run(cfg, console=console)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
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
    db: Optional[str] = typer.Option(None, "--db", help="Read from this results store (path or SQLAlchemy URL)."),
) -> None:
    """Write one self-contained HTML report from a results directory or the results store."""
    from hylo_bench.reports import build_report

    try:
        path = build_report(results_dir, output, title=title, db=db)
    except (ValueError, FileNotFoundError) as e:
        _fail(e)
    console.print(f"[green]report written to {path}[/]")


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
        outcomes = store.import_files(store.open_store(db, results_dir), files)
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
    paper: Optional[Path] = typer.Option(None, "--paper", help="hylo_paper_tables.json (default: shared/paper)."),
) -> None:
    """Per-metric deltas CAND - BASE with 95 % CIs; exit 1 if any metric regresses beyond the threshold and CI."""
    from hylo_bench.reports import compare as C, store

    try:
        stored = not all(side.startswith("paper:") for side in (base, cand))
        engine = store.open_store(db, results_dir, create=False) if stored else None
        result = C.compare_sides(C.resolve_side(engine, base, paper), C.resolve_side(engine, cand, paper), threshold)
    except ValueError as e:
        _fail(e)
    C.write_outputs(result, md, html_out)
    typer.echo(C.to_markdown(result))
    raise typer.Exit(1 if result.num_regressions else 0)


if __name__ == "__main__":
    app()
