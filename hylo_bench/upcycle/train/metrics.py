"""Per-step training telemetry: ``OUT/train_log.jsonl`` (one JSON line per optimizer step), TensorBoard events in
``OUT/tb/<i>-<stage>/`` when ``tensorboard`` is installed, and the FLOPs / MFU / memory estimates they carry.

A resumed stage first drops the lines of that stage past the resumed step (and of any later stage), so the
file holds each (stage, step) once.
"""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path

import torch
from torch import nn

from hylo_bench.io_utils import atomic_write_text

logger = logging.getLogger(__name__)

LOG_FILE = "train_log.jsonl"
TB_DIR = "tb"

PEAK_DENSE_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "MI300X": 1307.4e12}
"""Vendor dense bf16 peak (no sparsity) by device-name substring, FLOP/s (NVIDIA H100/H200 SXM and A100
datasheets; AMD MI300X datasheet). Used for MFU when ``--peak-tflops`` is not given."""


def peak_flops_for(device: str | torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` from :data:`PEAK_DENSE_BF16_FLOPS`; None on CPU or unknown GPUs."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key, flops in PEAK_DENSE_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def _count(module: nn.Module, skip: tuple[nn.Parameter, ...]) -> int:
    ids = {id(p) for p in skip}
    return sum(p.numel() for p in module.parameters() if id(p) not in ids)


def train_flops_per_token(student: nn.Module, teacher: nn.Module, kind: str) -> float:
    """Approximate training FLOPs per token of one stage: 6 N_s (student forward + backward) + 2 N_t (teacher
    forward), N = matmul parameters (embedding tables excluded; ``lm_head`` excluded for ILD, which never runs
    either head). Attention-score FLOPs (O(T) per token) are left out, so MFU at long context is understated.

    Reference: Kaplan et al. 2020 (arXiv 2001.08361) sec. 2.1, C ~ 6N; PaLM (arXiv 2204.02311) App. B for MFU.
    """
    s_skip = (student.model.embed_tokens.weight,) + ((student.lm_head.weight,) if kind == "ild" else ())
    t_skip = (teacher.model.embed_tokens.weight,) + ((teacher.lm_head.weight,) if kind == "ild" else ())
    return 6.0 * _count(student, s_skip) + 2.0 * _count(teacher, t_skip)


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): CUDA ``max_memory_allocated`` since the stage's reset, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process_max_rss"  # Linux: KiB


class TrainLog:
    """Append-only JSONL step log plus optional TensorBoard writer for one run directory.

    Args:
        out_dir: the run directory (``OUT``); the log is ``OUT/train_log.jsonl``.
        tensorboard: write ``OUT/tb/<i>-<stage>/`` events when ``tensorboard`` is importable (a log line says
            when it is not).
    """

    def __init__(self, out_dir: str | Path, *, tensorboard: bool = True):
        self.path = Path(out_dir) / LOG_FILE
        self.tb_root = Path(out_dir) / TB_DIR
        self.tensorboard = tensorboard
        self._fh = None
        self._tb = None

    def start_stage(self, stage_index: int, stage_name: str, resume_step: int) -> None:
        """Open the log for a stage that (re)starts after ``resume_step`` optimizer steps.

        Drops lines with ``stage_index > index`` or (``== index`` and ``step > resume_step``), and unreadable
        lines (a write cut by a crash), rewriting the file atomically; then opens it for appending.
        """
        self.close()
        if self.path.is_file():
            kept, dropped = [], 0
            text = self.path.read_text(encoding="utf-8")
            for line in text.splitlines():
                try:
                    rec = json.loads(line)
                    keep = rec["stage_index"] < stage_index or (rec["stage_index"] == stage_index
                                                                and rec["step"] <= resume_step)
                except (json.JSONDecodeError, KeyError, TypeError):
                    keep = False
                if keep:
                    kept.append(line)
                else:
                    dropped += 1
            if dropped:
                logger.info("%s: dropped %d lines past step %d of stage %s (resumed run)", self.path, dropped,
                            resume_step, stage_name)
            if dropped or (text and not text.endswith("\n")):  # a write cut by a kill: end the file on a line
                atomic_write_text(self.path, "".join(f"{x}\n" for x in kept))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.info("tensorboard is not installed: no TensorBoard events in %s (pip install "
                            "'hylo-bench[tensorboard]'); %s has the same numbers", self.tb_root, self.path)
                self.tensorboard = False
            else:
                self._tb = SummaryWriter(str(self.tb_root / f"{stage_index}-{stage_name}"), purge_step=resume_step + 1)

    def log(self, record: dict) -> None:
        """Append one step record (a JSON object with at least ``stage``, ``stage_index`` and ``step``) and flush;
        numeric fields also go to TensorBoard as ``train/<key>`` at ``step``."""
        assert self._fh is not None, "call start_stage first"
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step",
                                                                                                   "stage_index"):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


