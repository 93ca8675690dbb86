"""The stage loop: AdamW + cosine schedule, grad accumulation, clipping, progress, manifest and resume.

One function, :func:`train_stage`, runs an ILD or KD stage on a fixed tensor of windows. Every
``save_every`` optimizer steps it writes ``resume.pt`` atomically: student weights, optimizer, step and
losses, so an interrupted stage restarts from the last save with the same next batches. Every step also goes
to ``OUT/train_log.jsonl`` (and TensorBoard) through :class:`hylo_bench.upcycle.train.metrics.TrainLog`.

Under ``torchrun`` (a :class:`~hylo_bench.upcycle.train.distributed.DistContext` given, models FSDP2-sharded) each
rank trains on its slice of every optimizer step's windows, the logged losses are averaged over ranks, only rank 0
logs, and the mid-stage state is a ``torch.distributed.checkpoint`` directory instead of ``resume.pt``.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from hylo_bench.io_utils import atomic_write_bytes, fault_point, utc_now
from hylo_bench.upcycle.stages import Stage
from hylo_bench.upcycle.train import distributed as dist_utils
from hylo_bench.upcycle.train.distributed import DistContext
from hylo_bench.upcycle.train.losses import ild_loss, kd_loss
from hylo_bench.upcycle.train.metrics import TrainLog, peak_memory_bytes


@dataclass(kw_only=True, slots=True)
class StageOptions:
    """Optimisation settings of one stage (training-recipe.md §2.3, §3.3)."""

    lr: float
    batch_size: int = 1
    grad_accum: int = 1
    warmup_ratio: float = 0.01
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    kl_chunk_size: int = 4096
    save_every: int = 50
    log_every: int = 1
    autocast_dtype: torch.dtype | None = None
    seed: int = 42
    stage_index: int = 0  # position of the stage in the run (train_log.jsonl, TensorBoard run name)
    flops_per_token: float | None = None  # training FLOPs per token (metrics.train_flops_per_token); None: no MFU
    peak_flops: float | None = None  # device peak FLOP/s for MFU; None: no MFU


@dataclass
class StageResult:
    """What a stage did: steps, tokens, and the logged losses (``[{"step","loss","tokens",...}]``)."""

    steps: int = 0
    tokens_seen: int = 0
    losses: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    peak_memory_gib: float | None = None


def cosine_lr(step: int, total: int, warmup_ratio: float) -> float:
    """LR multiplier: linear warmup over ceil(warmup_ratio * total) steps, then cosine decay to 0."""
    warm = max(1, math.ceil(warmup_ratio * total))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def _save_resume(path: Path, student, opt, step: int, result: StageResult) -> None:
    buf = io.BytesIO()
    torch.save({"model": student.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "tokens_seen": result.tokens_seen, "losses": result.losses, "seconds": result.seconds}, buf)
    atomic_write_bytes(path, buf.getvalue())


_PROGRESS_KEYS = ("step", "tokens_seen", "losses", "seconds", "world_size")


def _save_resume_dcp(path: Path, student, opt, step: int, result: StageResult, ctx: DistContext) -> None:
    progress = dict(zip(_PROGRESS_KEYS, (step, result.tokens_seen, result.losses, result.seconds, ctx.world_size)))
    dist_utils.save_checkpoint(path, student, opt, progress, ctx)


def _mfu(tokens_per_s: float, opts: StageOptions, n_devices: int) -> float | None:
    """Model FLOPs utilisation over ``n_devices`` x ``opts.peak_flops``; None when FLOPs or peak are unknown."""
    if not (opts.flops_per_token and opts.peak_flops):
        return None
    return tokens_per_s * opts.flops_per_token / (opts.peak_flops * n_devices)


def _log_step(train_log: TrainLog, stage: Stage, opts: StageOptions, result: StageResult, *, loss: float, lr: float,
              grad_norm: float, tokens_per_s: float, step_time_s: float, terms: dict, device: torch.device,
              memory: tuple[int, str] | None = None, n_devices: int = 1) -> None:
    """One ``train_log.jsonl`` record for the step just finished (keys: :func:`train_stage`).

    ``memory``: (bytes, kind) to log instead of this process's peak; ``n_devices``: devices sharing
    ``tokens_per_s`` (MFU is over their summed peak).
    """
    mem, mem_kind = memory if memory is not None else peak_memory_bytes(device)
    mfu = _mfu(tokens_per_s, opts, n_devices)
    train_log.log({"stage": stage.name, "stage_index": opts.stage_index, "kind": stage.kind, "step": result.steps,
                   "tokens_seen": result.tokens_seen, "loss": loss, "kl": loss if stage.kind == "kd" else None,
                   "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s, "mfu": mfu,
                   "peak_memory_bytes": mem, "memory_kind": mem_kind, "step_time_s": step_time_s,
                   "wall_time_s": result.seconds, "time_utc": utc_now("milliseconds")}
                  | {k: v for k, v in terms.items() if k != "kl"})


def train_stage(student, teacher, stage: Stage, windows: torch.Tensor, opts: StageOptions, resume_path: Path,
                on_log: Callable[[StageResult], None] | None = None, train_log: TrainLog | None = None,
                position_ids: torch.Tensor | None = None, dist_ctx: DistContext | None = None,
                kl_mask: torch.Tensor | None = None) -> StageResult:
    """Train ``student`` for one stage on ``windows`` [N, seq_len] (N = steps * batch * accum).

    Args:
        student: ``HyLoForCausalLM`` (fp32 master weights). teacher: HF causal LM, frozen.
        stage: kind and length. windows: the stage's token windows, consumed in order.
        opts: optimiser settings. resume_path: where the mid-stage state lives (loaded if present).
        on_log: called after each logged step (the caller updates the manifest).
        train_log: receives one record per optimizer step: ``stage``, ``stage_index``, ``kind``, ``step``,
            ``tokens_seen`` (this stage), ``loss``, ``kl`` (KD; None for ILD), ``lr``, ``grad_norm``,
            ``tokens_per_s``, ``mfu`` (fraction of ``opts.peak_flops``; None when FLOPs or peak are unknown),
            ``peak_memory_bytes`` + ``memory_kind``, ``step_time_s``, ``wall_time_s`` (stage training seconds,
            kept across resumes), ``time_utc``, and the loss terms (``ild_hidden``, ``ild_mixer``).
        position_ids: [N, seq_len] per-document positions of ``windows`` (``hylo_bench.upcycle.packing``): packed
            documents, no attention or recurrent state across them. None: plain causal windows.
        kl_mask: [N, seq_len] bool, the positions whose KL counts in a KD stage (``PackedRows.kl_mask``:
            ``--kl-tokens assistant``); None: every position.
        dist_ctx: set under torchrun: ``student`` and ``teacher`` are FSDP2-sharded
            (:func:`hylo_bench.upcycle.train.distributed.shard_model`), every rank holds the same ``windows`` and
            takes an equal slice of each step's ``batch_size * grad_accum`` windows; ``resume_path`` is a DCP
            directory; losses, tokens/s and MFU are global (MFU over ``world_size`` x ``opts.peak_flops``), peak
            memory is the largest over ranks; pass ``on_log`` / ``train_log`` on rank 0 only.

    Raises:
        ValueError: the budget is less than one optimizer step, or the ranks cannot split the global batch.
    """
    per_step = opts.batch_size * opts.grad_accum
    total_steps = len(windows) // per_step
    if total_steps == 0:
        raise ValueError(f"stage {stage.name}: budget {stage.token_budget} tokens is less than one optimizer step "
                         f"({per_step} x {stage.seq_len_tokens} tokens)")
    ctx = dist_ctx
    device = torch.device(ctx.device) if ctx else next(student.parameters()).device
    world, rank = (ctx.world_size, ctx.rank) if ctx else (1, 0)
    micro_bs, accum = dist_utils.rank_microbatches(opts.batch_size, opts.grad_accum, world) if ctx \
        else (opts.batch_size, opts.grad_accum)
    params = [p for p in student.parameters() if p.requires_grad]
    if stage.kind == "ild":  # embeddings / head get no ILD gradient (teacher forcing); keep them out
        head = {id(student.lm_head.weight), id(student.model.embed_tokens.weight)}
        params = [p for p in params if id(p) not in head]
    opt = torch.optim.AdamW(params, lr=opts.lr, betas=(0.9, 0.999), weight_decay=0.0)
    result, start = StageResult(), 0
    if ctx is not None and resume_path.exists():
        st = dist_utils.load_checkpoint(resume_path, student, opt)
        start, result.tokens_seen, result.losses, result.seconds = st["step"], st["tokens_seen"], st["losses"], \
            st["seconds"]
    elif ctx is None and resume_path.is_file():
        st = torch.load(resume_path, map_location=device, weights_only=False)
        student.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        start, result.tokens_seen, result.losses, result.seconds = st["step"], st["tokens_seen"], st["losses"], \
            st["seconds"]
    student.train()
    torch.manual_seed(opts.seed + start)  # the RNG state is a function of the step: resumes draw the same numbers
    if train_log is not None:
        train_log.start_stage(opts.stage_index, stage.name, start)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    columns = [TextColumn("[bold]{task.description}"), BarColumn(bar_width=12),
               TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[tps]:>6.0f} tok/s"),
               TextColumn(("KL" if stage.kind == "kd" else "loss") + " {task.fields[loss]:.4f}"),
               TimeRemainingColumn(), TextColumn("{task.fields[mfu]}"), TextColumn("lr {task.fields[lr]:.1e}"),
               TextColumn("{task.fields[mem]}"), TimeElapsedColumn()]
    with Progress(*columns, transient=False, disable=rank != 0) as progress:
        bar = progress.add_task(stage.name, total=total_steps, completed=start, tps=0.0, loss=float("nan"), lr=0.0,
                                mfu="", mem="")
        for step in range(start, total_steps):
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = opts.lr * cosine_lr(step, total_steps, opts.warmup_ratio)
            opt.zero_grad(set_to_none=True)
            logs: dict[str, float] = {}
            loss_sum = 0.0
            for micro in range(accum):
                # this rank's slice of the step's windows: [rank * per_step / world, (rank + 1) * per_step / world)
                i0 = step * per_step + rank * (per_step // world) + micro * micro_bs
                x = windows[i0:i0 + micro_bs].to(device)
                pos = None if position_ids is None else position_ids[i0:i0 + micro_bs].to(device)
                km = None if kl_mask is None else kl_mask[i0:i0 + micro_bs].to(device)
                with torch.autocast(device.type, dtype=opts.autocast_dtype, enabled=opts.autocast_dtype is not None):
                    if stage.kind == "ild":
                        loss, logs = ild_loss(student, teacher, x, position_ids=pos)
                    else:
                        loss, logs = kd_loss(student, teacher, x, opts.temperature, opts.kl_chunk_size,
                                             position_ids=pos, kl_mask=km)
                (loss / accum).backward()
                loss_sum += loss.item() / accum
                fault_point("train:micro_backward")
            grad_norm = dist_utils.grad_norm_value(torch.nn.utils.clip_grad_norm_(params, opts.max_grad_norm))
            opt.step()
            fault_point("train:optimizer_step")
            memory = None
            if ctx is not None:  # global numbers for the log (every rank joins these all-reduces)
                logs = dist_utils.mean_over_ranks({"loss": loss_sum} | logs, ctx.device)
                loss_sum = logs.pop("loss")
                mem, mem_kind = peak_memory_bytes(device)
                memory = (dist_utils.max_over_ranks(mem, ctx.device), mem_kind)
            result.steps = step + 1
            result.tokens_seen += per_step * windows.shape[1]
            dt = time.perf_counter() - t0
            result.seconds += dt
            tps = per_step * windows.shape[1] / dt
            if (step + 1) % opts.log_every == 0 or step + 1 == total_steps:
                result.losses.append({"step": step + 1, "loss": loss_sum, "tokens": result.tokens_seen,
                                      "lr": opt.param_groups[0]["lr"], "grad_norm": grad_norm,
                                      "tokens_per_s": tps} | logs)
                if on_log:
                    on_log(result)
            if memory is not None and device.type == "cuda":
                result.peak_memory_gib = memory[0] / 2 ** 30
            elif device.type == "cuda":
                result.peak_memory_gib = torch.cuda.max_memory_allocated(device) / 2 ** 30
            if train_log is not None:
                _log_step(train_log, stage, opts, result, loss=loss_sum, lr=opt.param_groups[0]["lr"],
                          grad_norm=grad_norm, tokens_per_s=tps, step_time_s=dt, terms=logs, device=device,
                          memory=memory, n_devices=world)
                fault_point("train:logged")
            mfu = _mfu(tps, opts, world)
            peak_gib = result.peak_memory_gib if result.peak_memory_gib is not None else \
                peak_memory_bytes(device)[0] / 2 ** 30
            progress.update(bar, completed=step + 1, tps=tps, loss=loss_sum, lr=opt.param_groups[0]["lr"],
                            mfu="" if mfu is None else f"MFU {100 * mfu:.1f}%", mem=f"{peak_gib:.1f} GiB")
            if (step + 1) % opts.save_every == 0 and step + 1 < total_steps:
                if ctx is not None:
                    _save_resume_dcp(resume_path, student, opt, step + 1, result, ctx)
                else:
                    _save_resume(resume_path, student, opt, step + 1, result)
                fault_point("train:resume_saved")
    student.eval()
    return result
