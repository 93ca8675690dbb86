"""The settings of one ``hylo-bench upcycle`` run (:class:`UpcycleConfig`), their checks that need no model, and
how flags and a recipe resolve into them (:func:`resolve_upcycle_cli`).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

from hylo_bench.config.recipes import Recipe, RecipeError, load_recipe, mixer_dims, stages_spec
from hylo_bench.config.units import parse_length, parse_token_count

DEFAULT_STAGES = "2k:ild,8k"
DEFAULT_ILD_LR, DEFAULT_KD_LR = 2e-4, 6e-5  # the paper's (training-recipe.md)
DEMO_STAGES = "1k:ild@750k,1k@250k"  # about 5 minutes on 2 CPU cores
DEMO_ILD_LR, DEMO_KD_LR = 4e-3, 3e-4
"""Demo defaults (tiny 1.6M-parameter teacher, 1K windows). Chosen by a sweep on the H200 (student RULER at 1K,
20 samples per task): ILD carries the teacher's retrieval into the MLA layers (750K ILD tokens at 4e-3: 100 /
100 / 60 on niah_single_1 / niah_single_2 / niah_multikey_1), while KD at 1e-3 or more erased it (0-30 on
niah_single_1 after ILD); a short KD at 3e-4 keeps it and lowers the KL."""


@dataclass(kw_only=True, slots=True)
class UpcycleConfig:
    """Settings of one upcycling run (CLI flags map 1:1 onto these fields; this class is the only home of their
    defaults, so ``run(UpcycleConfig(out=...))`` and ``hylo-bench upcycle --out ...`` train the same run).

    ``stages``, ``ild_lr`` and ``kd_lr`` left at None resolve by base: the demo teacher gets the tuned demo schedule
    (:data:`DEMO_STAGES`, :data:`DEMO_ILD_LR`, :data:`DEMO_KD_LR`), any other base the paper's
    (:data:`DEFAULT_STAGES`, :data:`DEFAULT_ILD_LR`, :data:`DEFAULT_KD_LR`).
    """

    out: str
    base: str = "demo"
    teacher: str | None = None
    layout: str | None = None  # "7MLA21GDN", or "auto:7MLA21GDN" to place the MLA layers by score (select.py)
    mla_layers: list[int] | None = None
    linear_type: str = "gdn"  # of the layers not in mla_layers (a --layout name carries its own)
    recipe: str | None = None  # the --recipe this config was resolved from (recorded in the manifest)
    # "demo", a path (.txt / .jsonl / .parquet / folder / mixture .yaml), or a recipe's inline mixture
    # {"source": recipe file, "mixture": {...}} (its ``data:`` block)
    data: Any = "demo"
    stages: str | None = None  # None: DEMO_STAGES for --base demo, else DEFAULT_STAGES
    tokens_per_stage: int = 1_000_000
    batch_size: int = 4
    batch_tokens: int | None = None  # tokens per micro-batch: each stage's batch = batch_tokens // its length
    grad_accum: int = 1
    ild_lr: float | None = None  # None: DEMO_ILD_LR for --base demo, else DEFAULT_ILD_LR
    kd_lr: float | None = None  # None: DEMO_KD_LR for --base demo, else DEFAULT_KD_LR
    temperature: float = 1.0
    kl_chunk_size: int = 2048
    eval_windows: int = 8
    select_windows: int = 8  # calibration windows for --layout auto:... (from --data)
    peak_tflops: float | None = None  # device peak for MFU in train_log.jsonl (default: known GPUs' dense bf16 peak)
    tensorboard: bool = True  # OUT/tb/ events when the tensorboard package is installed
    decontam: list[str] = field(default_factory=list)  # eval sets to decontaminate against (decontam.py)
    # packed documents keep their boundaries (no attention / recurrent state across them; packing.py) in
    # "kd" stages only, "all" stages (ILD too) or "off" (plain causal windows, Zebra-Llama's packing).
    # None: "kd", except "off" for --data demo, whose text documents are paragraphs of one book (splitting them
    # would shorten every training context; the demo's settings were tuned on plain windows).
    doc_boundaries: str | None = None
    save_every: int = 50
    device: str | None = None
    seed: int = 42
    save_stage_checkpoints: bool = True
    gradient_checkpointing: bool = False
    compile: bool = False  # torch.compile each decoder layer of student and teacher (train/compile.py)
    mixer_overrides: dict = field(default_factory=dict)
    kl_tokens: str = "all"  # KD positions that count: "all", or "assistant" (the next token is an assistant token)
    chat_template: str | None = None  # renders conversational data (None: the base tokenizer's; a recipe's)
    allow_demo_data: bool = False  # --data demo with a base other than the demo teacher (refused otherwise)
    init: str = "svd"  # student mixers: "svd" (from the attention weights, paper §3.1) or "random" (fresh init)
    init_from: str | None = None  # start from this HyLo checkpoint (e.g. a shared ILD run) instead of the init
    overwrite: bool = False  # write into an --out that holds files this run did not write (checks.check_out_dir)

    def __post_init__(self) -> None:
        demo = self.base == "demo"
        if self.stages is None:
            self.stages = DEMO_STAGES if demo else DEFAULT_STAGES
        if self.ild_lr is None:
            self.ild_lr = DEMO_ILD_LR if demo else DEFAULT_ILD_LR
        if self.kd_lr is None:
            self.kd_lr = DEMO_KD_LR if demo else DEFAULT_KD_LR

    def to_dict(self) -> dict:
        return asdict(self)

    def doc_boundaries_mode(self) -> str:
        """The packing mode this run uses (``doc_boundaries`` with its data-dependent default resolved)."""
        return self.doc_boundaries or ("off" if self.data == "demo" else "kd")


def upcycle_default(name: str) -> Any:
    """The default of :class:`UpcycleConfig` field ``name`` (what the CLI's help quotes).

    Raises:
        KeyError: no such field, or a field without a plain default (``out``, list / dict factories).
    """
    from dataclasses import MISSING, fields

    f = next((f for f in fields(UpcycleConfig) if f.name == name), None)
    if f is None or f.default is MISSING:
        raise KeyError(f"UpcycleConfig.{name}: no such field with a plain default")
    return f.default


KL_TOKENS = ("all", "assistant")
INITS = ("svd", "random")
DOC_BOUNDARIES = ("kd", "all", "off")


def check_demo_data(cfg: UpcycleConfig) -> None:
    """Refuse the demo text for a real base unless asked for: checked after every path and number, so a run with
    a wrong flag hears about that flag first.

    Raises:
        ValueError: ``--data demo`` with a base other than the demo teacher and no ``allow_demo_data``.
    """
    if cfg.data == "demo" and cfg.base != "demo" and not cfg.allow_demo_data:
        raise ValueError(f"--data demo distils --base {cfg.base} on the shipped demo text (one small book and "
                         f"synthetic retrieval rows), which is not a real run: pass --data PATH (a .jsonl / .parquet "
                         f"/ .txt file or folder, a mixture .yaml, or `hylo-bench make-data` output) or a --recipe "
                         f"with data, or add --allow-demo-data to use the demo text anyway")


def validate_config(cfg: UpcycleConfig) -> None:
    """Checks that need no model: fail before anything is loaded.

    Raises:
        ValueError: an unknown ``--kl-tokens`` / ``--init`` / ``--doc-boundaries``, ``--init-from`` together with
            a layout or ``--init``.
    """
    if cfg.kl_tokens not in KL_TOKENS:
        raise ValueError(f"--kl-tokens {cfg.kl_tokens!r}: expected one of {', '.join(KL_TOKENS)}")
    if cfg.init not in INITS:
        raise ValueError(f"--init {cfg.init!r}: expected one of {', '.join(INITS)}")
    if cfg.doc_boundaries_mode() not in DOC_BOUNDARIES:
        raise ValueError(f"--doc-boundaries {cfg.doc_boundaries!r}: expected one of {', '.join(DOC_BOUNDARIES)}")
    if cfg.batch_tokens is not None and cfg.batch_tokens < 1:
        raise ValueError(f"--batch-tokens {cfg.batch_tokens}: expected a positive token count")
    if cfg.init_from is not None:
        if cfg.layout is not None or cfg.mla_layers is not None:
            raise ValueError(f"--init-from {cfg.init_from}: the layout comes from that checkpoint; drop --layout / "
                             f"--mla-layers")
        if cfg.init != "svd":
            raise ValueError(f"--init-from {cfg.init_from}: starts from trained weights; drop --init {cfg.init}")


def check_linear_type(linear_type: str) -> None:
    """Raises ValueError unless ``linear_type`` is ``"gdn"`` or ``"mamba"`` (the mixer of the non-MLA layers)."""
    if linear_type not in ("gdn", "mamba"):
        raise ValueError(f"linear_type {linear_type!r}: expected 'gdn' or 'mamba'")


def upcycle_config_from_recipe(recipe: Recipe | None, out: str, flags: dict[str, Any]):
    """Resolve ``hylo-bench upcycle`` settings: explicit flags > recipe > built-in defaults.

    Args:
        recipe: the recipe, or None for a flag-only run.
        out: output directory.
        flags: CLI values by ``UpcycleConfig`` field name; None means "not given on the command line".
            ``kv_lora_rank`` / ``q_lora_rank`` are mixer overrides.

    Returns:
        ``UpcycleConfig`` (its own defaults for whatever neither sets). From a recipe: base/teacher =
        backbone/teacher, mla_layers + linear_type, stages,
        ild/kd lr, batch = the KD stage's per-device batch with grad_accum = global / per-device batch (one
        process reproduces the global batch), temperature, seed, mixer dims and YaRN.
    """
    given = {k: v for k, v in flags.items() if v is not None}
    mixer = {k: given.pop(k) for k in ("kv_lora_rank", "q_lora_rank") if k in given}
    kw: dict[str, Any] = {}
    if recipe is not None:
        kd = recipe.stage("kd") if any(s.kind == "kd" for s in recipe.stages) else None  # an ILD-only recipe
        kw.update(base=recipe.backbone, teacher=recipe.teacher, mla_layers=list(recipe.mla_layers),
                  linear_type=recipe.linear_type, stages=stages_spec(recipe),
                  temperature=float(recipe.loss.get("temperature", 1.0)), seed=recipe.seed)
        if kd is not None:
            kw["kd_lr"] = float(kd.lr)
        if any(s.kind == "ild" for s in recipe.stages):
            kw["ild_lr"] = float(recipe.stage("ild").lr)
        if kd is not None and kd.per_device_batch_sequences:
            kw["batch_size"] = kd.per_device_batch_sequences
            if kd.global_batch_sequences:
                kw["grad_accum"] = max(1, kd.global_batch_sequences // kd.per_device_batch_sequences)
        kw["mixer_overrides"] = mixer_dims(recipe)
        if recipe.data is not None:
            kw["data"] = {"source": recipe.source, "mixture": copy.deepcopy(recipe.data)}
        if recipe.chat_template is not None:
            kw["chat_template"] = recipe.chat_template
        if "layout" in given or "mla_layers" in given or "init_from" in given:  # another layer plan
            kw.pop("mla_layers")
            if "layout" in given or "init_from" in given:
                kw.pop("linear_type")
        if "init_from" in given:  # the checkpoint brings its own dims
            kw["mixer_overrides"] = {}
    kw.update(given)  # what is still unset takes UpcycleConfig's defaults
    kw["mixer_overrides"] = {**kw.get("mixer_overrides", {}), **mixer}
    if recipe is not None:
        kw["recipe"] = recipe.name
    return UpcycleConfig(out=out, **kw)


def resolve_upcycle_cli(recipe_name: str | None, sets: dict[str, Any], out: str, flags: dict[str, Any]):
    """``hylo-bench upcycle`` flags -> ``UpcycleConfig`` (see :func:`upcycle_config_from_recipe`).

    Args:
        recipe_name: ``--recipe`` or None. sets: ``--set KEY=VALUE`` overrides of recipe keys.
        flags: CLI values; None = not given. ``tokens_per_stage`` is text such as ``"20M"``.

    Raises:
        RecipeError / ValueError: unknown recipe, bad recipe field, ``--set`` without ``--recipe``.
    """
    if sets and recipe_name is None:
        raise RecipeError(f"--set {', '.join(sets)}: overrides recipe keys and needs --recipe NAME")
    recipe = load_recipe(recipe_name, overrides=sets) if recipe_name is not None else None
    flags = dict(flags)
    if flags.get("tokens_per_stage") is not None:
        flags["tokens_per_stage"] = parse_token_count(flags["tokens_per_stage"])
    if isinstance(flags.get("batch_tokens"), str):
        try:
            flags["batch_tokens"] = parse_length(flags["batch_tokens"])
        except ValueError as e:
            raise ValueError(f"--batch-tokens: {e}") from None
    cfg = upcycle_config_from_recipe(recipe, out, flags)
    if cfg.layout is None and cfg.mla_layers is not None:  # fail before any download, not after
        check_linear_type(cfg.linear_type)
    return cfg
