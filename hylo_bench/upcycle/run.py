"""``hylo-bench upcycle``: init -> Enhanced-ILD -> staged KL distillation, saving after every stage.

Output directory layout::

    OUT/manifest.json            run settings, per-stage status, tokens seen, losses, held-out KL
    OUT/stages/<i>-<name>/       the student after stage i (released layout + tokenizer)
    OUT/resume.pt                mid-stage state (removed when the stage completes)
    OUT/resume_dcp/              the same under torchrun: a torch.distributed.checkpoint directory (sharded)
    OUT/train_log.jsonl          one JSON line per optimizer step (metrics.TrainLog); OUT/tb/ TensorBoard events
    OUT/decontamination.json     training documents dropped for a 13-gram overlap with --decontam eval sets
    OUT/layer_selection.json     per-layer scores and chosen MLA layers (``--layout auto:...`` only)
    OUT/config.json, hybrid_config.json, model.safetensors, tokenizer files   the final student

Re-running the same command on an existing OUT resumes: finished stages are skipped (their checkpoint is
loaded), an interrupted stage continues from ``resume.pt``.

Under ``torchrun`` (``WORLD_SIZE`` set) the run is data-parallel with FSDP2 (student and teacher sharded per
decoder layer; see :mod:`hylo_bench.upcycle.train.distributed`): every rank builds the same windows and trains
on its slice of each global batch, rank 0 writes the manifest, logs and the merged ``model.safetensors`` after each
stage (same files as a single-process run), and ``OUT`` must be on a filesystem all ranks share. Without
``WORLD_SIZE`` nothing changes: one process, ``resume.pt``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from hylo_bench import __version__
from hylo_bench.config.hybrid import default_mla_layers, parse_layout
from hylo_bench.config.upcycle import UpcycleConfig, check_demo_data, check_linear_type, validate_config
from hylo_bench.io_utils import OnResult, atomic_write_json, fault_point, git_sha, utc_now, weights_sha256
from hylo_bench.upcycle.checks import check_upcycle_config
from hylo_bench.upcycle.decontam import REPORT_FILE as DECONTAM_FILE
from hylo_bench.upcycle.stages import Stage, parse_stages

if TYPE_CHECKING:  # torch and the training modules load in run(), after the settings are checked
    import torch

    from hylo_bench.upcycle.train.distributed import DistContext

logger = logging.getLogger(__name__)

def stage_batch_size(cfg: UpcycleConfig, seq_len: int) -> int:
    """Sequences per micro-batch of a stage: ``batch_tokens // seq_len`` (at least 1) when ``batch_tokens`` is
    set, so stages of different lengths take the same tokens per step; else ``batch_size``."""
    return max(1, cfg.batch_tokens // seq_len) if cfg.batch_tokens else cfg.batch_size


def embeddings_note(base_config) -> dict:
    """What upcycling did to the embeddings (for the manifest and ``info``): the released hybrid layout has its
    own ``lm_head``; a tied base's head starts as a copy of its embedding and trains on its own."""
    tied = bool(getattr(base_config, "tie_word_embeddings", False))
    return {"base_tied": tied, "lm_head": "untied",
            "note": "lm_head initialised as a copy of the base's tied embedding, then trained untied" if tied
            else "lm_head copied from the base's lm_head"}


def resolve_layout(cfg: UpcycleConfig, n_layer: int) -> tuple[list[int], str]:
    """(mla_layers, linear_type) from ``--mla-layers`` or ``--layout`` (default: 2 of 4 for the demo, else 1/4).

    Raises:
        ValueError: when both are given, or on a malformed layout / index.
    """
    if cfg.mla_layers is not None and cfg.layout is not None:
        raise ValueError("give either --layout or --mla-layers, not both")
    if cfg.mla_layers is not None:
        bad = [i for i in cfg.mla_layers if not 0 <= i < n_layer]
        if bad or len(set(cfg.mla_layers)) != len(cfg.mla_layers):
            raise ValueError(f"--mla-layers {cfg.mla_layers}: expected distinct indices in [0, {n_layer}) for this "
                             f"{n_layer}-layer base model")
        check_linear_type(cfg.linear_type)
        return sorted(cfg.mla_layers), cfg.linear_type
    if cfg.layout is not None:
        return parse_layout(cfg.layout, n_layer)
    return default_mla_layers(n_layer, max(1, round(n_layer / (2 if n_layer <= 4 else 4)))), "gdn"


def uses_doc_boundaries(mode: str, kind: str) -> bool:
    """Whether a stage of ``kind`` ("ild" / "kd") trains on packed documents with boundaries under ``mode``."""
    return mode == "all" or (mode == "kd" and kind == "kd")


SELECT_SEED_OFFSET = 104_729  # calibration windows: a stream apart from the stage (seed + i) and held-out ones


def _auto_select(cfg: UpcycleConfig, base, tokenizer, seq_len: int, out: Path, corpus) -> dict:
    """Layer selection for ``--layout auto:...``: reuse OUT/layer_selection.json when it matches, else score.

    Raises:
        ValueError: with ``--mla-layers`` also given, or a malformed layout (from ``select.select_layers``).
    """
    from rich.console import Console

    from hylo_bench.upcycle.select import SELECTION_FILE, auto_layout, render_selection, select_layers

    if cfg.mla_layers is not None:
        raise ValueError(f"--layout {cfg.layout}: chooses the MLA layers itself; drop --mla-layers")
    if cfg.select_windows < 1:
        raise ValueError(f"--select-windows {cfg.select_windows}: needs at least 1 calibration window")
    seed = cfg.seed + SELECT_SEED_OFFSET
    source = {"data": cfg.data, "seed": seed} | ({"decontam": list(cfg.decontam)} if cfg.decontam else {})
    calib = source | {"num_windows": cfg.select_windows, "seq_len_tokens": seq_len}
    path = out / SELECTION_FILE
    old = json.loads(path.read_text()) if path.is_file() else None
    if old and old.get("layout") == cfg.layout.strip() and old.get("calibration") == calib:
        logger.info("--layout %s: reusing the layer selection in %s: MLA layers %s", cfg.layout, path,
                    old["mla_layers"])
        return old
    windows = corpus.windows(tokenizer, seq_len, cfg.select_windows, seed=seed)
    result = select_layers(base, windows, auto_layout(cfg.layout), seed=cfg.seed, mixer_overrides=cfg.mixer_overrides,
                           calibration=source)
    Console().print(render_selection(result))
    logger.info("--layout %s: MLA layers %s (scores in nats/token: %s)", cfg.layout, result["mla_layers"],
                ", ".join(f"{s:.4f}" for s in result["scores"]))
    return result


def _mixture_stage_windows(mixture, entries: list[dict], i: int, tokenizer, seq_len: int, n_windows: int,
                           chat_template: str | None = None):
    """Stage ``i``'s windows (``PackedRows``) from the run's mixture stream, continuing where stage ``i - 1`` stopped.

    The sampler state at the stage's start is kept in its manifest entry (``sampler_state``), so a resumed stage
    redraws the same windows; the state after the draw (``sampler_state_end``) starts the next stage, and
    ``mixture_draws`` records documents and tokens per source.
    """
    from hylo_bench.upcycle.mixture import MixtureSampler, mixture_rows

    sampler = MixtureSampler(mixture, seq_len=seq_len)
    start = entries[i].get("sampler_state") or (entries[i - 1].get("sampler_state_end") if i else None)
    if start is not None:
        sampler.load_state_dict(start)
    entries[i]["sampler_state"] = sampler.state_dict()
    rows, drawn = mixture_rows(sampler, tokenizer, seq_len, n_windows, chat_template)
    entries[i]["sampler_state_end"] = sampler.state_dict()
    entries[i]["mixture_draws"] = {s.name: {"docs": d, "tokens": t}
                                   for s, d, t in zip(mixture.sources, drawn["docs"], drawn["tokens"])}
    return rows


def _load_hf(spec: str, device: str, dtype: torch.dtype, flag: str = "--base"):
    """The frozen base / teacher named by ``flag``: (model in eval mode, gradients off; its tokenizer; its resolved
    directory).

    Raises:
        FileNotFoundError / ValueError: from :func:`hylo_bench.upcycle.checks.check_model_spec` (run on the resolved
            directory, so a hub download is checked as a local folder is) and
            :func:`hylo_bench.models.loading.load_causal_lm`, with ``flag`` and ``spec`` named.
    """
    from hylo_bench.models.loading import load_causal_lm, load_tokenizer
    from hylo_bench.upcycle.checks import check_model_spec

    model, info = load_causal_lm(spec, device, dtype, flag=flag, check=lambda d: check_model_spec(str(d), flag))
    model.requires_grad_(False)
    d = Path(info["path"])
    return model, load_tokenizer(d), d


RESUME_FILE, RESUME_DCP_DIR = "resume.pt", "resume_dcp"


def _save_student(student, tokenizer, d: Path, ctx: DistContext | None = None) -> None:
    """Write the student in the released layout; a sharded student is merged first (collective) and written by
    rank 0 only."""
    from hylo_bench.models.checkpoint import save_hylo
    from hylo_bench.upcycle.train import distributed as dist_utils

    if ctx is None:
        save_hylo(student, d)
        tokenizer.save_pretrained(d)
        return
    full = dist_utils.full_state_dict(student)  # every rank joins; rank 0 receives the tensors
    if ctx.is_main:
        save_hylo(student, d, state_dict=full)
        tokenizer.save_pretrained(d)
    dist_utils.barrier()


def _load_stage_checkpoint(stage_dir: Path, student, device: str, ctx: DistContext | None):
    """The student saved after a finished stage: a fresh model, or loaded into the sharded one under torchrun."""
    import torch

    from hylo_bench.models.hybrid import load_hylo

    if ctx is None:
        return load_hylo(stage_dir, dtype=torch.float32, device=device)
    from safetensors.torch import load_file

    from hylo_bench.models.checkpoint import WEIGHTS_NAME
    from hylo_bench.upcycle.train import distributed as dist_utils

    dist_utils.load_full_state_dict(student, {k: v.float() for k, v in load_file(stage_dir / WEIGHTS_NAME).items()})
    return student


def _resume_path(out: Path, ctx: DistContext | None) -> Path:
    """``OUT/resume.pt`` (one process) or ``OUT/resume_dcp/`` (torchrun).

    Raises:
        ValueError: the other kind of mid-stage state is present (the stage would silently restart from step 0).
    """
    if ctx is not None:
        mine, other, where, how = RESUME_DCP_DIR, RESUME_FILE, "in one process", "without torchrun"
    else:
        mine, other, where, how = RESUME_FILE, RESUME_DCP_DIR, "under torchrun", "under torchrun"
    if (out / other).exists():
        raise ValueError(f"{out / other}: this stage was interrupted {where}; resume it {how}, or delete "
                         f"{out / other} to restart the stage")
    return out / mine


def _write_json(path: Path, obj, ctx: DistContext | None) -> None:
    """``atomic_write_json`` on rank 0 only (every rank keeps the same object in memory)."""
    if ctx is None or ctx.is_main:
        atomic_write_json(path, obj)


def run(cfg: UpcycleConfig, on_result: OnResult | None = None) -> dict:
    """Upcycle ``cfg.base`` into a hybrid and distil it; returns the final manifest (also in OUT/manifest.json).

    Under ``torchrun`` joins the process group (NCCL on GPU, gloo on CPU), trains with FSDP2 and leaves the group
    at the end; see the module docstring.

    Every setting and path is checked first, before torch is imported (:mod:`hylo_bench.upcycle.checks`).
    ``on_result(manifest, manifest_path)`` is called (on rank 0) after every stage and at the end, when the manifest
    with the training log so far has been written (the CLI: the results store); None writes the files alone.

    Raises:
        ValueError: on bad settings (layout, stages, data, an --out holding another model) with the flag named.
        FileNotFoundError: unresolvable base/teacher/data.
    """
    validate_config(cfg)
    check_upcycle_config(cfg)
    check_demo_data(cfg)
    from hylo_bench.upcycle.train import distributed as dist_utils

    ctx = dist_utils.init_distributed(cfg.device)
    try:
        return _run(cfg, ctx, on_result)
    finally:
        if ctx is not None:
            dist_utils.shutdown()


def _run(cfg: UpcycleConfig, ctx: DistContext | None, on_result: OnResult | None = None) -> dict:
    import torch

    from hylo_bench.config.device import check_device, default_device
    from hylo_bench.config.student import hybrid_config_for
    from hylo_bench.upcycle.data import load_corpus
    from hylo_bench.upcycle.documents import load_documents
    from hylo_bench.upcycle.select import auto_layout, save_selection
    from hylo_bench.upcycle.train import distributed as dist_utils
    from hylo_bench.upcycle.train.losses import eval_heldout
    from hylo_bench.upcycle.train.metrics import TrainLog, peak_flops_for
    from hylo_bench.upcycle.transfer import init_student

    out = Path(cfg.out)
    device = ctx.device if ctx is not None else check_device(cfg.device or default_device())
    main = ctx is None or ctx.is_main
    logger.info("%s", ctx.describe() if ctx is not None else f"single process on {device} (no torchrun)")
    stages: list[Stage] = parse_stages(cfg.stages, cfg.tokens_per_stage)
    # the data is read before any model loads: a bad document fails in seconds, and before OUT is created
    corpus = load_corpus(cfg.data, cfg.decontam, cfg.chat_template)
    if corpus.docs is None and corpus.mixture is None and cfg.data != "demo":
        corpus.docs = load_documents(cfg.data)
    decontam_report = corpus.decontam_report
    teacher_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    base, tokenizer, base_dir = _load_hf(cfg.base, device, torch.float32)
    teacher = base if cfg.teacher in (None, cfg.base) else _load_hf(cfg.teacher, device, teacher_dtype,
                                                                    "--teacher")[0]
    if teacher.config.vocab_size != base.config.vocab_size:
        raise ValueError(f"--teacher vocab size {teacher.config.vocab_size} != base vocab size "
                         f"{base.config.vocab_size}; distillation needs the same tokenizer")
    held_len = min(stages[0].seq_len_tokens, 1024)
    selection, init_from = None, None
    if cfg.init_from is not None:
        from hylo_bench.models.checkpoint import resolve_checkpoint_dir
        from hylo_bench.models.hybrid import load_hylo

        init_dir = resolve_checkpoint_dir(cfg.init_from)
        student = load_hylo(init_dir, dtype=torch.float32, device=device)
        hcfg = student.config
        init_from = {"path": str(init_dir), "weights_hash": weights_sha256(init_dir)}
    else:
        if auto_layout(cfg.layout) is not None:
            selection = _auto_select(cfg, base, tokenizer, held_len, out, corpus)
            mla_layers, linear_type = selection["mla_layers"], selection["linear_type"]
        else:
            mla_layers, linear_type = resolve_layout(cfg, base.config.num_hidden_layers)
        hcfg = hybrid_config_for(base.config, mla_layers, linear_type, **cfg.mixer_overrides)
        if cfg.data == "demo" and cfg.base != "demo":
            logger.warning("--data demo: distilling on the shipped demo text + retrieval samples (--allow-demo-data)")
        torch.manual_seed(cfg.seed)  # the GDN-specific parameters keep a (seeded) random init
        student = init_student(base, hcfg, mixers="random" if cfg.init == "random" else "attention")
    if cfg.gradient_checkpointing:
        student.model.gradient_checkpointing = True
    if ctx is not None:  # FSDP2: student in bf16 compute over fp32 master weights on GPU; fp32 on CPU (gloo)
        dist_utils.shard_model(student, ctx, mixed_precision=device.startswith("cuda"))
        for frozen in {id(m): m for m in (base, teacher)}.values():
            dist_utils.shard_model(frozen, ctx, mixed_precision=False)
    if cfg.compile:
        from hylo_bench.upcycle.train.compile import compile_decoder_layers

        compile_decoder_layers(*{id(m): m for m in (student, base, teacher)}.values())

    manifest_path = out / "manifest.json"
    settings = {"base": cfg.base, "teacher": cfg.teacher or cfg.base, "layout": hcfg.mla_layers,
                "stages": [s.to_dict() for s in stages], "data": cfg.data, "seed": cfg.seed,
                "batch_size": cfg.batch_size, "batch_tokens": cfg.batch_tokens, "grad_accum": cfg.grad_accum,
                "ild_lr": cfg.ild_lr, "kd_lr": cfg.kd_lr,
                "doc_boundaries": cfg.doc_boundaries_mode(),
                "mixer_overrides": {k: v for k, v in cfg.mixer_overrides.items() if v is not None},
                "kl_tokens": cfg.kl_tokens, "init": cfg.init, "init_from": init_from,
                "chat_template": "base tokenizer's" if cfg.chat_template is None else cfg.chat_template}
    if cfg.decontam:
        settings["decontam"] = list(cfg.decontam)
    manifest = json.loads(manifest_path.read_text(encoding="utf-8")) if manifest_path.is_file() else None
    dist_utils.barrier()  # every rank has read the old manifest before rank 0 rewrites it
    if manifest and manifest.get("settings") != settings:
        old = manifest.get("settings", {})
        diff = {k: (old.get(k), settings[k]) for k in settings if old.get(k) != settings[k]}
        raise ValueError(f"{manifest_path}: {out} holds a run with other settings "
                         f"({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in diff.items())}); use a new --out")
    out.mkdir(parents=True, exist_ok=True)
    if selection is not None and main:
        save_selection(out, selection)
    if decontam_report is not None:
        _write_json(out / DECONTAM_FILE, decontam_report, ctx)
    if manifest is not None:
        done = [e["name"] for e in manifest["stages"] if e["status"] == "done"]
        logger.info("resuming the run in %s (finished stages: %s)", out, ", ".join(done) or "none")
    if manifest is None:
        manifest = {"kind": "upcycle", "hylo_bench_version": __version__, "git_sha": git_sha(),
                    "created_utc": utc_now(), "settings": settings, "recipe": cfg.recipe, "config": cfg.to_dict(),
                    "base_dir": str(base_dir), "device": device,
                    "hybrid_config": hcfg.to_hybrid_dict(), "embeddings": embeddings_note(base.config),
                    "stages": [s.to_dict() | {"status": "pending", "tokens_seen": 0, "losses": []} for s in stages]}
    if selection is not None:
        manifest["layer_selection"] = selection
    if decontam_report is not None:
        manifest["decontamination"] = {k: v for k, v in decontam_report.items() if k != "dropped"} | {
            "dropped_doc_ids": [d["doc_id"] for d in decontam_report["dropped"]], "report": str(out / DECONTAM_FILE)}
    if corpus.mixture is not None:
        manifest["mixture"] = corpus.mixture.to_dict()
    manifest["distributed"] = {"world_size": ctx.world_size, "backend": ctx.backend, "fsdp": "fully_shard"} \
        if ctx is not None else None
    held_out = corpus.windows(tokenizer, held_len, cfg.eval_windows, seed=cfg.seed + 7919) if cfg.eval_windows \
        else None
    if "kl_init" not in manifest:
        manifest["heldout_init"] = eval_heldout(student, teacher, held_out) if held_out is not None else None
        manifest["kl_init"] = manifest["heldout_init"]["kl"] if held_out is not None else None
        if held_out is not None:
            h = manifest["heldout_init"]
            logger.info("held-out of the initialised student: KL %.4f nats/token, perplexity %.2f (teacher %.2f)",
                        h["kl"], h["student_ppl"], h["teacher_ppl"])
    _write_json(manifest_path, manifest, ctx)

    train_log = TrainLog(out, tensorboard=cfg.tensorboard)
    peak_flops = cfg.peak_tflops * 1e12 if cfg.peak_tflops else peak_flops_for(device)
    try:
        student = _run_stages(cfg, stages, manifest, student, base, teacher, tokenizer, held_out, device,
                              train_log if main else None, peak_flops, corpus, ctx, on_result)
    finally:
        train_log.close()
    _save_student(student, tokenizer, out, ctx)
    fault_point("upcycle:final_saved")
    manifest["final_checkpoint"] = str(out)
    manifest["model_hash"] = weights_sha256(out)  # the identity `ruler` / `eval` record for this checkpoint
    manifest["finished_utc"] = utc_now()
    _write_json(manifest_path, manifest, ctx)
    if main and on_result is not None:
        on_result(manifest, manifest_path)
    return manifest


def _run_stages(cfg: UpcycleConfig, stages: list[Stage], manifest: dict, student, base, teacher, tokenizer, held_out,
                device: str, train_log, peak_flops: float | None, corpus, ctx: DistContext | None = None,
                on_result: OnResult | None = None):
    """Train the unfinished stages in order (loading the checkpoint of finished ones); returns the student."""
    import torch

    from hylo_bench.upcycle.train import distributed as dist_utils
    from hylo_bench.upcycle.train.losses import eval_heldout
    from hylo_bench.upcycle.train.metrics import train_flops_per_token
    from hylo_bench.upcycle.train.trainer import StageOptions, train_stage

    out = Path(cfg.out)
    manifest_path = out / "manifest.json"
    for i, (stage, entry) in enumerate(zip(stages, manifest["stages"])):
        stage_dir = out / "stages" / f"{i}-{stage.name}"
        if entry["status"] == "done":
            if not (stage_dir / "model.safetensors").is_file():
                raise ValueError(f"{stage_dir}: stage {stage.name} finished but its checkpoint is missing (the run "
                                 f"used --no-stage-checkpoints), so it cannot resume; use a new --out")
            student = _load_stage_checkpoint(stage_dir, student, device, ctx)
            continue
        batch = stage_batch_size(cfg, stage.seq_len_tokens)
        per_step = batch * cfg.grad_accum
        n_windows = max(1, stage.token_budget // (per_step * stage.seq_len_tokens)) * per_step
        if corpus.mixture is not None:
            rows = _mixture_stage_windows(corpus.mixture, manifest["stages"], i, tokenizer, stage.seq_len_tokens,
                                          n_windows, cfg.chat_template)
        else:
            rows = corpus.rows(tokenizer, stage.seq_len_tokens, n_windows, seed=cfg.seed + i)
        keep_bounds = uses_doc_boundaries(cfg.doc_boundaries_mode(), stage.kind)
        windows, position_ids = rows.input_ids, (rows.position_ids if keep_bounds else None)
        kl_mask = rows.kl_mask(cfg.kl_tokens) if stage.kind == "kd" else None
        entry["packing"] = rows.summary() | {"doc_boundaries": keep_bounds}
        if kl_mask is not None:
            entry["packing"]["kl_positions"] = int(kl_mask.sum())
        opts = StageOptions(lr=cfg.ild_lr if stage.kind == "ild" else cfg.kd_lr, batch_size=batch,
                            grad_accum=cfg.grad_accum, temperature=cfg.temperature, kl_chunk_size=cfg.kl_chunk_size,
                            autocast_dtype=torch.bfloat16 if device.startswith("cuda") else None, seed=cfg.seed + i,
                            save_every=cfg.save_every, stage_index=i, peak_flops=peak_flops,
                            flops_per_token=train_flops_per_token(student, base if stage.kind == "ild" else teacher,
                                                                  stage.kind))
        resume = _resume_path(out, ctx)
        if entry["status"] == "pending" and resume.exists():
            # this stage never logged a step, so the mid-stage state is an earlier, finished stage's (a kill
            # between that stage's "done" and the removal of its state): loading it would skip or mix steps
            logger.info("%s: left by a finished stage; stage %s starts from its first step", resume, stage.name)
            if ctx is None:
                resume.unlink()
            else:
                dist_utils.remove_checkpoint(resume, ctx)
        entry["status"] = "running"

        def on_log(res, entry=entry):
            entry.update(tokens_seen=res.tokens_seen, steps=res.steps, losses=res.losses, seconds=res.seconds,
                         peak_memory_gib=res.peak_memory_gib)
            _write_json(manifest_path, manifest, ctx)

        res = train_stage(student, base if stage.kind == "ild" else teacher, stage, windows, opts,
                          resume, on_log=on_log if ctx is None or ctx.is_main else None,
                          train_log=train_log, dist_ctx=ctx, position_ids=position_ids, kl_mask=kl_mask)
        on_log(res)
        fault_point("upcycle:stage_trained")
        entry["heldout_after"] = eval_heldout(student, teacher, held_out) if held_out is not None else None
        entry["kl_after"] = entry["heldout_after"]["kl"] if held_out is not None else None
        if cfg.save_stage_checkpoints:
            _save_student(student, tokenizer, stage_dir, ctx)
            entry["checkpoint"] = str(stage_dir)
            if "sampler_state_end" in entry:
                _write_json(stage_dir / "sampler_state.json", entry["sampler_state_end"], ctx)
        fault_point("upcycle:stage_saved")
        entry["status"] = "done"
        entry["finished_utc"] = utc_now()
        _write_json(manifest_path, manifest, ctx)
        fault_point("upcycle:stage_done")
        if (ctx is None or ctx.is_main) and on_result is not None:
            on_result(manifest, manifest_path)
        if ctx is None:
            (out / RESUME_FILE).unlink(missing_ok=True)
        else:
            dist_utils.remove_checkpoint(out / RESUME_DCP_DIR, ctx)
    return student
