"""Attention primitives of the MLA layers: causal SDPA whose value head dim is below the query/key dim, and causal
attention within packed documents (block-diagonal). q, k: [B, H, T, d_qk]; v: [B, H, T, d_v].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylo_bench.models.varlen import document_index


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA for MLA prefill, where the value head dim d_V is below the query/key dim d_N + d_R.

    Flash attention needs one head dim for q, k and v; without it PyTorch falls back to kernels whose memory or
    time grows badly with T (at 128K tokens the math path would need the [T, T] scores). On GPU the values are
    zero-padded to the q/k width and the padded output columns (exactly zero) are dropped, the trick vLLM's MLA
    prefill uses. q, k: [B, H, T, d_qk]; v: [B, H, T, d_V]. Returns [B, H, T, d_V].
    """
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if q.is_cuda and d_v < d_qk:
        out = F.scaled_dot_product_attention(q, k, F.pad(v, (0, d_qk - d_v)), is_causal=True, scale=scale)
        return out[..., :d_v]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def left_padding(mask_BT: torch.Tensor) -> list[int] | None:
    """Pad counts per row when ``mask_BT`` [B, T] bool is left padding (each row: False * p, then True), else
    None. One host sync."""
    B, T = mask_BT.shape
    pads_B = T - mask_BT.sum(dim=1)
    expected = torch.arange(T, device=mask_BT.device)[None] >= pads_B[:, None]
    if not bool(torch.equal(expected, mask_BT)):
        return None
    return pads_B.tolist()


def left_padded_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                                 pads: list[int]) -> torch.Tensor:
    """Causal attention over a left-padded batch without a [B, T, T] mask: row b's real tokens (after its
    ``pads[b]`` padding tokens) attend causally among themselves through :func:`causal_attention` (flash /
    memory-efficient kernels, O(T) memory); a padding query attends only to itself, so its output is its own value
    (what the masked SDPA gives it). q, k: [B, H, T, d_qk]; v: [B, H, T, d_v]. Returns [B, H, T, d_v]."""
    out = v.clone()
    for b, p in enumerate(pads):
        if p < q.shape[2]:
            out[b : b + 1, :, p:] = causal_attention(q[b : b + 1, :, p:], k[b : b + 1, :, p:], v[b : b + 1, :, p:],
                                                    scale)
    return out


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            cu_seqlens: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """Causal attention within each packed document (block-diagonal causal mask).

    Args:
        q, k: [B, H, T, d_qk]; v: [B, H, T, d_v]. cu_seqlens: [n_docs + 1] over the flattened B * T tokens.
        scale: softmax scale.
        method: "mask" (one SDPA call with an explicit [B, 1, T, T] boolean mask: exact, O(T^2) memory, for
            CPU and short rows), "loop" (one causal SDPA call per document: flash / memory-efficient kernels,
            O(T) extra memory, for GPUs and long rows), or "auto" ("loop" on CUDA/ROCm, else "mask").

    Returns:
        [B, H, T, d_v].

    Raises:
        ValueError: unknown ``method``.
    """
    B, H, T, _ = q.shape
    if method == "auto":
        method = "loop" if q.is_cuda else "mask"
    if method == "mask":
        doc, _ = document_index(cu_seqlens.to(q.device), B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        allowed = causal[None] & (doc[:, :, None] == doc[:, None, :])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale)
    if method != "loop":
        raise ValueError(f"method={method!r}; expected 'auto', 'mask' or 'loop'")
    cu = cu_seqlens.tolist()

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, d] -> [1, H, B * T, d]
        return x.transpose(0, 1).reshape(1, H, B * T, x.shape[-1])

    qf, kf, vf = flat(q), flat(k), flat(v)
    outs = [causal_attention(qf[:, :, s:e], kf[:, :, s:e], vf[:, :, s:e], scale) for s, e in zip(cu[:-1], cu[1:])]
    return torch.cat(outs, dim=2).reshape(H, B, T, v.shape[-1]).transpose(0, 1)
