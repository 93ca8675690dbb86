"""``HyLoConfig``: the transformers binding of the hybrid config (:mod:`hylo_bench.config.hybrid`, plain Python: the
fields, their validation and ``hybrid_config.json`` / ``config.json`` I/O live there, so tools that only read configs
stay fast). Same fields, same files, as a ``PretrainedConfig`` so ``HyLoForCausalLM`` can be a ``PreTrainedModel``.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from hylo_bench.config.hybrid import HybridSpec


class HyLoConfig(HybridSpec, PretrainedConfig):
    """Configuration of a HyLo hybrid (MLA + Gated DeltaNet / Mamba-2 layers) for ``HyLoForCausalLM``.

    Keyword arguments: every field of :class:`hylo_bench.config.hybrid.HybridSpec` (``hybrid_config.json``
    keys, ``vocab_size``, ``base_*``), plus transformers' ``PretrainedConfig`` ones (token ids,
    ``tie_word_embeddings``, default False: HyLo's ``lm_head`` is untied).

    Raises:
        ValueError: on inconsistent values (see :meth:`HybridSpec._validate`).
    """

    model_type = "hylo"

    def __init__(self, tie_word_embeddings: bool = False, **kwargs: Any):
        rest = self._set_fields(**kwargs)
        PretrainedConfig.__init__(self, tie_word_embeddings=tie_word_embeddings, **rest)
        self._validate()

    @classmethod
    def from_spec(cls, spec: HybridSpec) -> "HyLoConfig":
        """The transformers config of a :class:`~hylo_bench.config.hybrid.HybridSpec` (same files, same fields)."""
        return spec if isinstance(spec, cls) else cls.from_dicts(spec.to_base_dict(), spec.to_hybrid_dict())
