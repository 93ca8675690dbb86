"""Memory budget of end-to-end distillation per GPU, by component (an analytic estimate).

The setting is ours (``hylo_bench.upcycle.train.trainer`` under ``distributed.shard_model``): FSDP2 full shard of
student and teacher over ``n_gpus``, fp32 master weights, gradients and AdamW states for the student, a bf16 teacher
under ``no_grad``, bf16 compute, activation checkpointing per decoder layer, and the chunked hidden-state KL
(``hylo_bench.kernels.kl.chunked``: logits exist only as [chunk, V] slices). Paper: §3.3, App. A.4, Table 1 (the
memory techniques); ``training-recipe.md`` §4.

Components (bytes per GPU):

- ``student_weights`` 4·N_s/n, ``student_grads`` 4·N_s/n, ``optimizer_states`` 8·N_s/n (AdamW exp_avg and
  exp_avg_sq), ``teacher_weights`` 2·N_t/n.
- ``unsharded_params``: bf16 copies FSDP gathers at a time: the largest student and teacher decoder layers, each
  twice (current + prefetched), and both LM heads (the KL reads them whole).
- ``checkpointed_activations``: the bf16 input of every student layer, L_s·T·D_s·2, plus the final hidden
  states of both models, T·(D_s + D_t)·2.
- ``kl_buffers``: fp32 [C, V] slices alive at once in the chunked KL (student log-probs, teacher log-probs,
  teacher probs: 3·C·V·4), the student-head gradient it keeps for backward (V·D_s·4) and dL/dx (T·D_s·2).
- ``layer_backward``: recomputing and back-propagating one student layer: the SwiGLU MLP's activations and their
  gradients, 2·T·(D_s + 3·I_s)·2, or for a GDN layer on the PyTorch chunked path its fp32 per-chunk states
  (T/64 chunks · h · d_k · d_v · 4, twice for backward), whichever is larger.
- ``teacher_layer_forward``: one teacher layer under ``no_grad``: T·(D_t + 3·I_t)·2 (its MLP), not alive at the
  same time as ``layer_backward``.

The peak is the persistent sum plus the largest transient. Allocator fragmentation, CUDA context and NCCL buffers
are not counted. Measured against this model (``benchmarks/results/upcycle_fsdp.json``, one H200): Qwen3-1.7B-shaped
7MLA21GDN student, Qwen3-8B-shaped teacher, 64K tokens, 1 GPU: 74.3 GiB measured.
"""

from __future__ import annotations

import dataclasses
from typing import Any

GIB = 2**30
GDN_CHUNK_TOKENS = 64  # chunk length of the chunked GDN scan (fla and hylo_bench.kernels.gated_delta)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerDims:
    """A Llama / Qwen3 teacher's dimensions (from its HF config): ``hidden``, ``intermediate``, ``layers``,
    ``heads``, ``kv_heads``, ``head_dim``, ``vocab``, ``tied`` (embedding shared with the head), ``qk_norm`` (Qwen3)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> "TransformerDims":
        """From a ``LlamaConfig`` / ``Qwen3Config`` (or any object with those attribute names)."""
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                   heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
                   head_dim=head_dim, vocab=cfg.vocab_size, tied=bool(cfg.tie_word_embeddings),
                   qk_norm=getattr(cfg, "model_type", "") == "qwen3")

    def layer_params(self) -> int:
        """Parameters of one decoder layer: q/k/v/o, SwiGLU MLP, two RMSNorms (+ Qwen3 q/k norms)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def params(self) -> int:
        """All parameters: layers, final norm, embedding and (unless tied) the LM head."""
        return self.layers * self.layer_params() + self.hidden + self.vocab * self.hidden * (1 if self.tied else 2)


def kd_memory_budget(student_cfg: Any, teacher: TransformerDims, seq_len: int, n_gpus: int = 1,
                     kl_chunk_size: int = 2048) -> dict[str, Any]:
    """Estimated peak memory per GPU of one distillation step, by component (see the module docstring).

    Args:
        student_cfg: the student's ``HyLoConfig``.
        teacher: the teacher's dimensions.
        seq_len: tokens per sequence (one sequence per GPU per micro-step).
        n_gpus: FSDP shard count.
        kl_chunk_size: rows per chunk of the hidden-state KL.

    Returns:
        ``{"components_bytes": {name: bytes}, "persistent_bytes", "transient_bytes", "peak_bytes", "peak_gib",
        "student_params", "teacher_params"}``.

    Raises:
        ValueError: ``seq_len``, ``n_gpus`` or ``kl_chunk_size`` below 1.
    """
    if seq_len < 1 or n_gpus < 1 or kl_chunk_size < 1:
        raise ValueError(f"seq_len, n_gpus and kl_chunk_size must be >= 1; got {seq_len}, {n_gpus}, {kl_chunk_size}")
    from hylo_bench.models.params import parameter_counts

    counts = parameter_counts(student_cfg, meta_model=True)  # the built module, whatever the config omits
    n_s, layer_s = counts["total"], max(layer["params"] for layer in counts["per_layer"])
    n_t = teacher.params()
    T, D, I, V = seq_len, student_cfg.hidden_size, student_cfg.intermediate_size, student_cfg.vocab_size
    C = min(kl_chunk_size, T)
    heads_bytes = 2 * (V * D + teacher.vocab * teacher.hidden)
    gdn = 0
    if len(student_cfg.mla_layers) < student_cfg.n_layer and student_cfg.linear_type == "gdn":
        h, dk, dv = student_cfg.gdn_num_heads, student_cfg.gdn_head_dim, student_cfg.gdn_value_head_dim
        gdn = 2 * -(-T // GDN_CHUNK_TOKENS) * h * dk * dv * 4
    comp = {
        "student_weights": 4 * n_s // n_gpus,
        "student_grads": 4 * n_s // n_gpus,
        "optimizer_states": 8 * n_s // n_gpus,
        "teacher_weights": 2 * n_t // n_gpus,
        "unsharded_params": 2 * 2 * (layer_s + teacher.layer_params()) + heads_bytes,
        "checkpointed_activations": student_cfg.n_layer * T * D * 2 + T * (D + teacher.hidden) * 2,
        "kl_buffers": 3 * C * V * 4 + V * D * 4 + T * D * 2,
        "layer_backward": max(2 * T * (D + 3 * I) * 2, gdn),
        "teacher_layer_forward": T * (teacher.hidden + 3 * teacher.intermediate) * 2,
    }
    transient_names = ("kl_buffers", "layer_backward", "teacher_layer_forward")
    persistent = sum(v for k, v in comp.items() if k not in transient_names)
    # the KL's head gradient and dL/dx stay alive through the student's backward; the teacher runs before both
    kl_kept = V * D * 4 + T * D * 2
    transient = max(comp["kl_buffers"], kl_kept + comp["layer_backward"], comp["teacher_layer_forward"])
    return {"components_bytes": comp, "persistent_bytes": persistent, "transient_bytes": transient,
            "peak_bytes": persistent + transient, "peak_gib": (persistent + transient) / GIB,
            "student_params": n_s, "teacher_params": n_t}
