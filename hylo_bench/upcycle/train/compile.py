"""``torch.compile`` per decoder layer for training, torchtitan's pattern (one compiled region per block).

In eager mode a distillation step spends a large share of its GPU time on small element-wise kernels (RMSNorms,
RoPE, SwiGLU, the GDN gates and short convolutions, dtype casts) between the matmuls. Compiling each decoder
layer lets Inductor fuse them, forward and backward. Layers of one kind share one compiled graph (Dynamo inlines
``nn.Module`` parameters as inputs), so a 28-layer student compiles two graphs (MLA and GDN layers) and a teacher
one. fla's GDN kernels stay opaque (``fla_chunk_gated_delta_rule`` is excluded from tracing), so the graph breaks
around them. Shapes are static: compile after any warm-up forward of another length (``shard_model`` runs one).
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def compile_decoder_layers(*models: nn.Module, backend: str = "inductor", mode: str | None = None) -> int:
    """Compile every ``model.model.layers[i]`` of each model in place (``nn.Module.compile``, ``dynamic=False``).

    Works before or after FSDP2 ``fully_shard`` (its hooks run eagerly, ``torch._dynamo.config.skip_fsdp_hooks``)
    and under activation checkpointing. The Dynamo recompile limit is raised to cover one entry per layer kind and
    sequence length; a region Dynamo cannot compile runs eagerly with a logged warning instead of failing the run
    (``suppress_errors``).

    Args:
        models: ``HyLoForCausalLM`` or transformers Llama / Qwen3 causal LMs (decoder layers in ``.model.layers``).
        backend: ``torch.compile`` backend ("inductor"; "aot_eager" traces without code generation, for tests).
        mode: ``torch.compile`` mode (None: Inductor's default).

    Returns:
        The number of layers compiled.

    Raises:
        ValueError: a model without ``.model.layers``.
    """
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.suppress_errors = True
    n = 0
    for model in models:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"{type(model).__name__} has no .model.layers to compile")
        for layer in layers:
            layer.compile(backend=backend, mode=mode, dynamic=False)
            n += 1
    logger.info("torch.compile (%s, mode %s) on %d decoder layers", backend, mode or "default", n)
    return n
