"""Multi-process training on torch.distributed: FSDP2 sharding, batch slicing, DCP resume, merged export.

Active only under ``torchrun`` (``WORLD_SIZE`` set); otherwise every helper here is unused and the single-process
trainer runs as before. Layout (training-recipe.md §4.4, Zebra-Llama's FSDP full shard):

- student and teacher are each sharded with ``torch.distributed.fsdp.fully_shard``: one unit per decoder layer,
  then the root (embeddings, final norm, ``lm_head``). The student keeps fp32 master weights; on GPU it computes
  in bf16 with fp32 gradient reduction (``MixedPrecisionPolicy``). The frozen teacher is sharded as it is loaded
  (bf16 on GPU) and only runs forward under ``no_grad``.
- the losses call the models' inner ``.model`` and read ``lm_head.weight`` directly (chunked KL, ILD hooks),
  outside the root's forward, so :func:`unshard_root` all-gathers the root unit explicitly before each loss and
  :func:`reshard_root` frees it again (the teacher right after its forward; the student's root is resharded by
  FSDP's post-backward, which also reduce-scatters its gradients).
- every rank takes an equal slice of each optimizer step's windows (:func:`rank_microbatches`); per-rank losses
  are token means, FSDP averages gradients over ranks, so the update is that of one process on the global batch.
- mid-stage state goes to a ``torch.distributed.checkpoint`` directory (sharded model + optimizer + progress),
  written to a temporary directory and renamed (DCP reshards on load; resuming on another number of ranks is
  untested).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DistContext:
    """This process's place in the job: ``world_size`` ranks, ``rank`` (global), ``local_rank`` (on its node),
    ``backend`` (``nccl`` on CUDA, ``gloo`` on CPU) and ``device`` (``cuda:<local_rank>`` or ``cpu``)."""

    world_size: int
    rank: int
    local_rank: int
    backend: str
    device: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return (f"distributed: FSDP2 over {self.world_size} processes, backend {self.backend}, rank {self.rank} on "
                f"{self.device}")


def under_torchrun() -> bool:
    """True when launched by ``torchrun`` (or any launcher that sets ``WORLD_SIZE``)."""
    return "WORLD_SIZE" in os.environ


def init_distributed(device: str | None = None) -> DistContext | None:
    """Join the process group set up by ``torchrun``; None when ``WORLD_SIZE`` is unset (single process).

    Args:
        device: ``"cpu"`` forces gloo on CPU; ``"cuda"``/``"cuda:N"``/None use ``cuda:<LOCAL_RANK>`` with NCCL when
            CUDA is available, else gloo on CPU. A ``cuda:N`` index is ignored: each rank takes its local GPU.

    Raises:
        RuntimeError: ``device`` asks for CUDA but none is available, or the job has more local ranks than GPUs.
    """
    if not under_torchrun():
        return None
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = device is None and torch.cuda.is_available() or (device or "").startswith("cuda")
    if want_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {device}: CUDA is not available on this node; use --device cpu (gloo)")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank}: this node has only {torch.cuda.device_count()} GPU(s); "
                               f"launch at most that many processes per node (torchrun --nproc-per-node)")
        torch.cuda.set_device(local_rank)
        backend, dev = "nccl", f"cuda:{local_rank}"
    else:
        backend, dev = "gloo", "cpu"
    if not dist.is_initialized():
        kw = {"device_id": torch.device(dev)} if backend == "nccl" else {}
        dist.init_process_group(backend=backend, **kw)
    ctx = DistContext(world_size=world, rank=rank, local_rank=local_rank, backend=backend, device=dev)
    logger.info(ctx.describe())
    return ctx


def shutdown() -> None:
    """Leave the process group (no-op outside torchrun)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _mesh(ctx: DistContext):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda" if ctx.device.startswith("cuda") else "cpu", (ctx.world_size,))


def shard_model(model: nn.Module, ctx: DistContext, *, mixed_precision: bool, reshard_after_forward: bool = True):
    """Apply FSDP2 in place: ``fully_shard`` each ``model.model.layers[i]``, then the root; returns ``model``.

    Works for ``HyLoForCausalLM`` and HF Llama / Qwen3 causal LMs (both keep their decoder layers in
    ``.model.layers``). Parameters become DTensors sharded on dim 0; build optimizers after this call. One
    no-grad forward on a few tokens makes ``model`` the FSDP root (FSDP picks the first module that runs
    forward), so the losses may then call its submodules directly.

    Args:
        mixed_precision: compute in bf16 and reduce gradients in fp32 over fp32 sharded master weights
            (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``); use on GPU for the student.
        reshard_after_forward: free each layer's gathered weights after its forward (ZeRO-3, "full shard").
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _mesh(ctx)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    was_training = model.training
    model.eval()
    with torch.no_grad():  # lazy init with `model` as root; then free the root unit the forward gathered
        model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=ctx.device), use_cache=False)
    model.reshard()
    model.train(was_training)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unshard_root(*models: nn.Module) -> None:
    """All-gather the root unit (embeddings, final norm, ``lm_head``) of each FSDP2 model; no-op otherwise."""
    for m in models:
        if is_sharded(m):
            m.unshard()


def reshard_root(*models: nn.Module) -> None:
    """Free the gathered root unit of each FSDP2 model (safe when already sharded); no-op otherwise."""
    for m in models:
        if is_sharded(m):
            m.reshard()


def rank_microbatches(batch_size: int, grad_accum: int, world_size: int) -> tuple[int, int]:
    """(micro-batch size, accumulation steps) per rank that keep the global batch ``batch_size * grad_accum``.

    Divides the accumulation steps by the world size when possible (the per-device batch stays ``batch_size``),
    else the micro-batch.

    Raises:
        ValueError: when ``world_size`` divides neither (the global batch cannot be split evenly).
    """
    if grad_accum % world_size == 0:
        return batch_size, grad_accum // world_size
    if batch_size % world_size == 0:
        return batch_size // world_size, grad_accum
    raise ValueError(f"--batch-size {batch_size} x --grad-accum {grad_accum}: {world_size} processes must divide "
                     f"--grad-accum or --batch-size so that each rank takes an equal slice of the global batch of "
                     f"{batch_size * grad_accum} sequences")


def mean_over_ranks(values: dict[str, float], device: str) -> dict[str, float]:
    """Average each value over all ranks (one all-reduce); the input when not distributed."""
    if not dist.is_initialized() or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


def max_over_ranks(value: int, device: str) -> int:
    """Largest ``value`` over all ranks (e.g. peak memory); the input when not distributed."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def grad_norm_value(norm) -> float:
    """``clip_grad_norm_``'s result as a float (a replicated DTensor under FSDP2)."""
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, progress: dict,
                    ctx: DistContext) -> None:
    """Write the sharded model, optimizer and ``progress`` (step, tokens, losses, ...) with DCP, atomically.

    Every rank writes its shards into ``PATH.tmp``; after a barrier rank 0 swaps it in for ``PATH`` (the old copy
    is removed last), so a kill at any point leaves one complete checkpoint. ``PATH`` must be on a filesystem all
    ranks share (multi-node: a shared volume).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    msd, osd = get_state_dict(model, optimizer)
    # progress travels as one JSON string: DCP would flatten nested lists/dicts into keys it cannot match on load
    dcp.save({"model": msd, "optim": osd, "progress": json.dumps(progress)}, checkpoint_id=str(tmp))
    barrier()
    if ctx.is_main:
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    barrier()


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a :func:`save_checkpoint` directory into the (already sharded) model and optimizer; returns the
    progress dict saved with it. DCP reshards on load, so the saving and loading world sizes may differ.

    Raises:
        FileNotFoundError: ``path`` has no DCP metadata (not a checkpoint written by :func:`save_checkpoint`).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}: not a torch.distributed.checkpoint directory (no .metadata); remove it to "
                                f"restart the stage from its beginning")
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd, "progress": ""}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads(state["progress"])


def remove_checkpoint(path: Path, ctx: DistContext | None) -> None:
    """Delete a checkpoint directory (rank 0), then wait for all ranks."""
    if ctx is None or ctx.is_main:
        shutil.rmtree(path, ignore_errors=True)
    barrier()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU, on rank 0 (empty on other ranks); collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict, given on every rank, into a sharded model (strict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=True))
