"""``hylo-bench sweep``: serving benchmarks over contexts x batch sizes, one subprocess per point, tidy records.

Each point (model, backend, context, batch) runs in its own ``python -m hylo_bench.serving.sweep_worker`` process,
so an out-of-memory point cannot poison the next. Records (TTFT s, decode tokens/s, TPOT s, peak memory GiB,
memory-model prediction, the decode step's bandwidth bound ``bound_tpot_s`` and ``fraction_of_bound``
(:mod:`hylo_bench.serving.bound`), ``status`` ok | oom | error | timeout | skipped) are appended to a
benchmark-format JSON
(``{"benchmark", "kind": "sweep", "git_sha", "device", "versions", "records": [...]}``, atomic rewrite after every
point) handed to ``on_result`` after every point (``hylo-bench sweep``: the results store, kind ``sweep``:
re-imports extend, never duplicate). This process never touches the GPU itself.

With a time budget (``budget_s``) the sweep ends on time: a native-engine point whose full prefill would not fit
the time left is measured in ``mode: "estimated"`` (TTFT from two timed prefill chunks, decode after a synthetic
context; :func:`hylo_bench.serving.sweep_worker.run_point`), a running point is stopped :data:`BUDGET_GRACE_S`
after the budget (status ``timeout``) and points not started by then are recorded as ``skipped``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hylo_bench.io_utils import OnResult, atomic_write_json, git_sha, package_version, utc_now

logger = logging.getLogger(__name__)
BACKENDS = ("native", "hf")
BUDGET_GRACE_S = 20.0
"""Seconds a point may run past ``budget_s`` before it is stopped: a point that chose its full run just inside the
budget still gets to finish its decode steps."""


@dataclasses.dataclass(kw_only=True, slots=True)
class SweepConfig:
    """One ``hylo-bench sweep``.

    Attributes:
        model: checkpoint directory, hub id, ``demo``, or a recipe name (random weights of the real shapes).
        contexts_tokens: prompt lengths (tokens).
        batch_sizes: sequences per point.
        out: results JSON path (benchmark format).
        backend: ``native`` (hylo-bench engine) or ``hf`` (eager transformers loop). vLLM serves HyLo through
            its own benchmarks (``hylo-bench export-vllm``, docs/vllm.md), not through this sweep.
        baseline: a second model swept the same way: ``backbone`` (the recipe's backbone, random weights, when
            ``model`` is a recipe), a recipe-qualified ``backbone:<recipe>``, or a checkpoint / hub id.
        baseline_static: also sweep the baseline through transformers' static-cache ``generate`` (series
            ``baseline-static``; with ``compile`` or ``cuda_graphs`` on CUDA its ``torch.compile`` + CUDA graphs),
            the way a performance-minded user runs a transformer, besides the ``baseline`` series (eager).
        decode_steps: tokens generated per point (TPOT over all but the first).
        prefill_chunk_tokens: native engine prefill chunk.
        cuda_graphs: capture the native decode step in a CUDA graph (HyLo models on CUDA).
        compile: ``torch.compile`` the native decode step (HyLo models; see ``Engine(compile=...)``).
        find_max: after the grid, search the largest context that fits per (model, batch): doubling from the
            largest one that fitted, then bisection down to ``find_max_resolution_tokens``.
        stop_after_oom: skip larger contexts of a (model, batch) series once one OOMs (recorded as skipped).
        device, dtype: passed to the workers (default: cuda if available; bf16 on GPU, fp32 on CPU).
        point_timeout_s: wall-clock limit per point (status ``timeout``).
        budget_s: wall-clock limit of the whole sweep (s; None: none), counted from the start of the run: see the
            module docstring. Points not started within it are ``skipped``; a running one is stopped
            :data:`BUDGET_GRACE_S` after it.
        reserve_s: with ``budget_s``, seconds each point leaves to the points after it when it chooses between a
            full and an estimated run.
    """

    model: str
    contexts_tokens: list[int]
    batch_sizes: list[int]
    out: Path
    backend: str = "native"
    baseline: str | None = None
    baseline_static: bool = True
    decode_steps: int = 128
    prefill_chunk_tokens: int = 8192
    cuda_graphs: bool = False
    compile: bool = False
    find_max: bool = False
    find_max_resolution_tokens: int = 1024
    find_max_limit_tokens: int = 2 ** 26
    stop_after_oom: bool = True
    device: str | None = None
    dtype: str | None = None
    point_timeout_s: float = 1800.0
    budget_s: float | None = None
    reserve_s: float = 0.0
    warmup: bool = True

    def __post_init__(self) -> None:
        if self.backend == "vllm":
            raise ValueError("--backend vllm: the sweep runs its points in hylo-bench's own workers; serve HyLo with "
                             "vLLM through `hylo-bench export-vllm` (docs/vllm.md) and its benchmarks, or use "
                             "--backend native")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if not self.contexts_tokens or min(self.contexts_tokens) < 1:
            raise ValueError(f"--contexts: need at least one positive length, got {self.contexts_tokens}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch: need at least one positive batch size, got {self.batch_sizes}")
        for name in ("decode_steps", "prefill_chunk_tokens", "find_max_resolution_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.budget_s is not None and not self.budget_s >= 0:
            raise ValueError(f"--budget-s {self.budget_s}: expected seconds >= 0")
        if not self.reserve_s >= 0:
            raise ValueError(f"--reserve-s {self.reserve_s}: expected seconds >= 0")
        self.out = Path(self.out)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v)
                for f in dataclasses.fields(self)}


def resolve_baseline(model: str, baseline: str | None) -> str | None:
    """``backbone`` -> ``backbone:<recipe>`` when ``model`` is a recipe name; anything else unchanged.

    Raises:
        ValueError: ``backbone`` for a model that is not a recipe name.
    """
    if baseline != "backbone":
        return baseline
    from hylo_bench.config import recipes as R

    if Path(model).expanduser().exists() or R.find_recipe(model) is None:
        raise ValueError(f"--baseline backbone needs a recipe name as CKPT (got {model!r}); pass the backbone "
                         f"checkpoint instead, e.g. --baseline Qwen/Qwen3-1.7B")
    return f"backbone:{model}"


def _versions() -> dict[str, str | None]:
    return {pkg: package_version(pkg)
            for pkg in ("torch", "transformers", "triton", "flash-linear-attention", "fla-core", "vllm")}


def new_envelope(cfg: SweepConfig) -> dict[str, Any]:
    """The results JSON before any record: benchmark envelope + ``kind: sweep``, a sweep id and the config."""
    return {"benchmark": "sweep", "kind": "sweep", "sweep_id": uuid.uuid4().hex, "model": cfg.model,
            "baseline": cfg.baseline, "backend": cfg.backend, "git_sha": git_sha(), "device": None,
            "versions": _versions(), "created_utc": utc_now(),
            "config": cfg.to_dict(), "records": []}


def run_worker(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one point in a fresh ``sweep_worker`` process; always returns a record (with ``status``)."""
    with tempfile.TemporaryDirectory(prefix="hylo-sweep-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "record.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        cmd = [sys.executable, "-m", "hylo_bench.serving.sweep_worker", str(spec_path), str(out_path)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "error": f"point exceeded {timeout_s:.0f} s", "wall_s": timeout_s}
        if out_path.is_file():
            rec = json.loads(out_path.read_text(encoding="utf-8"))
            if rec.get("status") == "error":
                logger.warning("point failed: %s\n%s", rec.get("error"), proc.stderr[-2000:])
            return rec
        killed = proc.returncode in (-9, 137)
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        return {"status": "oom" if killed else "error", "wall_s": time.perf_counter() - t0,
                "error": ("worker killed (SIGKILL: host out of memory?)" if killed else
                          f"worker exited with code {proc.returncode}: {tail[0]}")[:500]}


class SweepRun:
    """Runs the points of one sweep, saving the JSON (and handing it to ``on_result``) after every record.

    ``env``: the results document the records are appended to (default :func:`new_envelope`); a driver with its
    own envelope (``benchmarks/serving_sweep.py``) passes it and may override :meth:`save`. The budget clock
    (``cfg.budget_s``) starts here.
    """

    def __init__(self, cfg: SweepConfig, on_record: Callable[[dict[str, Any]], None] | None = None,
                 on_result: OnResult | None = None, env: dict[str, Any] | None = None):
        self.cfg = cfg
        self.t0 = time.monotonic()
        self.env = new_envelope(cfg) if env is None else env
        self.on_record = on_record
        self.on_result = on_result

    def left_s(self) -> float | None:
        """Seconds left of ``cfg.budget_s`` (negative once spent); None without a budget."""
        return None if self.cfg.budget_s is None else self.cfg.budget_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        atomic_write_json(self.cfg.out, self.env)
        if self.on_result is not None:
            self.on_result(self.env, self.cfg.out)

    def skip(self, series: str, spec_model: str, seq_len: int, batch: int, why: str) -> dict[str, Any]:
        """Add a ``skipped`` grid record (nothing measured) saying ``why``."""
        return self.add({"model": spec_model, "series": series, "spec": spec_model, "backend": self.cfg.backend,
                         "point": "grid", "seq_len": seq_len, "batch_size": batch, "status": "skipped",
                         "error": why})

    def measure(self, series: str, spec_model: str, seq_len: int, batch: int, kind: str = "grid",
                engine: str | None = None, *, variant: str = "", cuda_graphs: bool | None = None,
                compile: bool | None = None, reserve_s: float | None = None) -> dict[str, Any]:
        """Run one point in its worker process and return its record, not added yet (see :meth:`point`).

        Args:
            series: the record's series name. spec_model: the model spec the worker builds. seq_len: prompt tokens.
            batch: sequences. kind: ``grid`` | ``probe``. engine: worker engine (``"static"``), else the backend's.
            variant: the record's variant name (default: ``engine`` or ""), so reports draw it as its own series.
            cuda_graphs, compile: this point's setting instead of the config's.
            reserve_s: with a budget, this point's reserve instead of ``cfg.reserve_s``.

        Returns:
            A flat record: ``status`` ``skipped`` (without running anything) when the budget is spent.
        """
        c = self.cfg
        graphs = c.cuda_graphs if cuda_graphs is None else cuda_graphs
        comp = c.compile if compile is None else compile
        # the static-cache baseline is the same model: a variant, so reports draw it as its own series
        head = {"model": spec_model, "series": series, "spec": spec_model, "backend": c.backend,
                "variant": variant or engine or "", "point": kind, "seq_len": seq_len, "batch_size": batch,
                "decode_steps": c.decode_steps, "compile": comp}
        left = self.left_s()
        if left is not None and left <= 0:
            return head | {"status": "skipped", "error": f"the sweep's budget of {c.budget_s:.0f} s is spent"}
        spec = {"model": spec_model, "backend": c.backend, "seq_len": seq_len, "batch_size": batch,
                "decode_steps": c.decode_steps, "prefill_chunk": c.prefill_chunk_tokens, "cuda_graphs": graphs,
                "compile": comp, "device": c.device, "dtype": c.dtype, "warmup": c.warmup, "seed": 0,
                "engine": engine}
        timeout = c.point_timeout_s
        if left is not None:
            spec["time_left_s"] = left - (c.reserve_s if reserve_s is None else reserve_s)
            timeout = min(timeout, left + BUDGET_GRACE_S)
        rec = run_worker(spec, timeout)
        if rec.get("status") == "timeout" and timeout < c.point_timeout_s:
            rec["error"] = f"stopped {BUDGET_GRACE_S:.0f} s after the end of the sweep's {c.budget_s:.0f} s budget"
        return head | rec

    def point(self, series: str, spec_model: str, seq_len: int, batch: int, kind: str = "grid",
              engine: str | None = None, **overrides: Any) -> dict[str, Any]:
        """:meth:`measure` one point (``overrides``: its keyword-only arguments) and :meth:`add` its record."""
        return self.add(self.measure(series, spec_model, seq_len, batch, kind, engine, **overrides))

    def add(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Append a record (dict / list values dropped: records stay flat), save, call ``on_record``."""
        rec = {k: v for k, v in rec.items() if not isinstance(v, (dict, list))}
        self.env["records"].append(rec)
        if self.env.get("device") is None and rec.get("device"):
            self.env["device"] = rec["device"]
        self.save()
        if self.on_record is not None:
            self.on_record(rec)
        return rec

    def find_max(self, series: str, spec_model: str, batch: int, ok: list[int], bad: list[int],
                 engine: str | None = None) -> int | None:
        """Largest context that fits (status ok), doubling then bisecting; records each probe and the result."""
        c = self.cfg
        lo = max(ok, default=0)
        hi = min((t for t in bad if t > lo), default=None)
        if lo == 0 and hi is None:
            return None
        stopped = None

        def probe(t: int) -> bool | None:
            """Whether ``t`` tokens fit; None when the budget ran out (a skipped probe says nothing)."""
            nonlocal stopped
            rec = self.point(series, spec_model, t, batch, "probe", engine)
            if rec["status"] == "skipped":
                stopped = rec["error"]
                return None
            return rec["status"] == "ok"

        while hi is None and stopped is None:
            t = lo * 2
            if t > c.find_max_limit_tokens:
                break
            if (fits := probe(t)) is not None:
                lo, hi = (t, hi) if fits else (lo, t)
        while stopped is None and hi is not None and hi - lo > c.find_max_resolution_tokens:
            mid = (lo + hi) // 2 // c.find_max_resolution_tokens * c.find_max_resolution_tokens
            if mid <= lo:
                break
            if (fits := probe(mid)) is not None:
                lo, hi = (mid, hi) if fits else (lo, mid)
        self.add({"model": spec_model, "series": series, "spec": spec_model, "backend": c.backend, "point": "max",
                  "seq_len": lo, "batch_size": batch, "max_context_tokens": lo, "first_failed_tokens": hi,
                  "resolution_tokens": c.find_max_resolution_tokens, "status": "ok" if lo else "oom",
                  **({"error": f"search stopped: {stopped}"} if stopped else {})})
        return lo


def run(cfg: SweepConfig, on_record: Callable[[dict[str, Any]], None] | None = None,
        on_result: OnResult | None = None) -> dict[str, Any]:
    """Run the sweep; returns the results envelope (also written to ``cfg.out``).

    ``on_record(record)`` is called with every record as it is added, ``on_result(envelope, cfg.out)`` after every
    rewrite of the JSON (the CLI: the results store); None writes the JSON alone.

    Raises:
        ValueError: a bad backend / baseline (before any point runs).
    """
    baseline = resolve_baseline(cfg.model, cfg.baseline)
    sweep = SweepRun(cfg, on_record, on_result)
    sweep.save()
    series = [("model", cfg.model, None)]
    if baseline:
        series += [("baseline", baseline, None)] + ([("baseline-static", baseline, "static")]
                                                   if cfg.baseline_static else [])
    for name, spec_model, engine in series:
        for batch in cfg.batch_sizes:
            ok, bad, errors = [], [], []
            for seq_len in sorted(cfg.contexts_tokens):
                left = sweep.left_s()
                if bad and cfg.stop_after_oom and (left is None or left > 0):  # once spent, the budget says why
                    sweep.skip(name, spec_model, seq_len, batch, f"{min(bad)} tokens already did not fit")
                    continue
                rec = sweep.point(name, spec_model, seq_len, batch, engine=engine)
                if rec["status"] != "skipped":
                    {"ok": ok, "oom": bad, "timeout": bad}.get(rec["status"], errors).append(seq_len)
            if cfg.find_max and errors:
                logger.warning("%s B=%d: no --find-max search, points failed with errors at %s", name, batch, errors)
            elif cfg.find_max:
                sweep.find_max(name, spec_model, batch, ok, bad, engine)
    return sweep.env


def points_total(cfg: SweepConfig) -> int:
    """Grid points of the sweep (probes of ``find_max`` not included)."""
    baseline_series = (2 if cfg.baseline_static else 1) if cfg.baseline else 0
    return len(cfg.contexts_tokens) * len(cfg.batch_sizes) * (1 + baseline_series)


def format_record(rec: dict[str, Any]) -> str:
    """One line per record for the console."""
    def f(key: str, fmt: str) -> str:
        v = rec.get(key)
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    head = f"{rec.get('series')} B={rec.get('batch_size')} T={rec.get('seq_len')} ({rec.get('point')})"
    if rec.get("status") != "ok":
        return f"{head}: {rec.get('status')} {rec.get('error') or ''}".rstrip()
    if rec.get("point") == "max":
        return f"{head}: largest context that fits {rec.get('max_context_tokens')} tokens"
    share = rec.get("fraction_of_bound")
    bound = f" ({100 * share:.0f} % of its {1e3 * rec['bound_tpot_s']:.3g} ms bound)" if share else ""
    ttft = (f"ttft ~{f('ttft_estimated_s', '.3f')} s (estimated)" if rec.get("mode") == "estimated"
            else f"ttft {f('ttft_s', '.3f')} s")
    return (f"{head}: {ttft}, tpot {f('tpot_s', '.4f')} s{bound}, "
            f"{f('tokens_per_s', '.1f')} tok/s, peak {f('peak_memory_gib', '.2f')} GiB (model "
            f"{f('kv_model_gib', '.2f')} GiB)")


def run_with_progress(cfg: SweepConfig, console, runner=run, on_result: OnResult | None = None) -> dict[str, Any]:
    """``runner(cfg, on_record, on_result)`` with a rich progress bar over the grid points and one line per
    record."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    resolve_baseline(cfg.model, cfg.baseline)  # fail before the progress bar appears
    with Progress(TextColumn("[bold]sweep[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("points", total=points_total(cfg))

        def on_record(rec: dict[str, Any]) -> None:
            progress.console.print(format_record(rec), markup=False, highlight=False)
            if rec.get("point") == "grid":
                progress.advance(task)

        return runner(cfg, on_record, on_result)
