"""``HyLoConfig``: the hybrid's configuration as a transformers ``PretrainedConfig`` (``hybrid_config.json`` +
the base ``config.json``). The fields and their logic live in :mod:`hylo_bench.models.spec` (plain Python, no
torch), so tools that only read configs stay fast; this module binds them to transformers.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from hylo_bench.models.spec import (  # noqa: F401  (re-exported: the names users and the model code import)
    BASE_CONFIG_NAME,
    HYBRID_CONFIG_NAME,
    HYBRID_KEYS,
    KEY_TYPES,
    LEGACY_KEYS,
    MLA_REQUIRED_KEYS,
    NULLABLE_KEYS,
    RELEASED_MLA_LAYERS,
    HybridFields,
    HybridSpec,
    default_mla_layers,
    normalize_rope_scaling,
    parse_layout,
)


class HyLoConfig(HybridFields, PretrainedConfig):
    """Configuration of a HyLo hybrid (MLA + Gated DeltaNet / Mamba-2 layers) for ``HyLoForCausalLM``.

    Keyword arguments: every field of :class:`hylo_bench.models.spec.HybridFields` (``hybrid_config.json``
    keys, ``vocab_size``, ``base_*``), plus transformers' ``PretrainedConfig`` ones (token ids,
    ``tie_word_embeddings``, default False: HyLo's ``lm_head`` is untied).

    Raises:
        ValueError: on inconsistent values (see :meth:`HybridFields._validate`).
    """

    model_type = "hylo"

    def __init__(self, tie_word_embeddings: bool = False, **kwargs: Any):
        rest = self._set_fields(**kwargs)
        PretrainedConfig.__init__(self, tie_word_embeddings=tie_word_embeddings, **rest)
        self._validate()
