"""Packed documents in the hybrid: document boundaries as ``cu_seqlens``, per-document positions and short
convolutions that do not reach across documents (block-diagonal causal attention: :mod:`hylo_bench.models.attention`).

Convention: a batch [B, T] of packed rows is described by ``cu_seqlens``, int32 [n_docs + 1] offsets into the
flattened B * T tokens (fla / flash-attn varlen); every row start is a document start, so no document spans two
rows. ``position_ids`` [B, T] restart at 0 at each document (transformers' packed-sequence convention,
``DataCollatorWithFlattening``); the two describe the same boundaries (:func:`cu_seqlens_from_position_ids`,
:func:`position_ids_from_cu_seqlens`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylo_bench.kernels.varlen import check_cu_seqlens


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document offsets [n_docs + 1] int32 over the flattened [B, T] tokens: a document starts where
    ``position_ids == 0`` and at every row start.

    Raises:
        ValueError: when ``position_ids`` is not [B, T].
    """
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [B, T]; got {tuple(position_ids.shape)}")
    B, T = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    idx = torch.nonzero(starts.flatten(), as_tuple=True)[0]
    end = torch.tensor([B * T], device=idx.device, dtype=idx.dtype)
    return torch.cat([idx, end]).to(torch.int32)


def document_index(cu_seqlens: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document id [B, T] int64, position within the document [B, T] int64) of every packed token.

    No host sync (``searchsorted`` on the device).
    """
    cu = cu_seqlens.to(torch.long)
    flat = torch.arange(B * T, device=cu.device)
    doc = torch.searchsorted(cu, flat, right=True) - 1
    return doc.view(B, T), (flat - cu[doc]).view(B, T)


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """Positions [B, T] int64 restarting at 0 at each document of ``cu_seqlens``."""
    return document_index(cu_seqlens, B, T)[1]


def check_packed(cu_seqlens: torch.Tensor, B: int, T: int) -> list[int]:
    """Validate ``cu_seqlens`` for a [B, T] batch and return it as a list.

    Raises:
        ValueError: bad offsets (:func:`hylo_bench.kernels.varlen.check_cu_seqlens`) or a row start that is not
            a document start (a document spanning two rows).
    """
    cu = check_cu_seqlens(cu_seqlens, B * T)
    missing = sorted({r * T for r in range(B)} - set(cu))
    if missing:
        raise ValueError(f"cu_seqlens: every row of the [B={B}, T={T}] batch must start a document; offsets "
                         f"{missing[:4]} are row starts without a boundary")
    return cu


def varlen_causal_conv1d(x_BCT: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         pos_BT: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv that restarts at every document: each document sees zero history, i.e. the same
    result as ``F.conv1d`` over each document alone with W - 1 zeros of left padding.

    Computed as the ordinary causal conv of each row, then recomputed at the few tokens whose window reaches
    back across a document start (position within the document < W - 1, not the row start): their W-input
    windows are gathered, the taps before the document start zeroed, and the dot products with the kernel summed
    in float32 (float64 inputs stay float64) and written over the row conv's outputs there. Recomputing rather
    than subtracting the cross-document taps keeps bf16 exact to one rounding: subtracting leaves an error of
    order eps_bf16 * |row conv|, large next to a short document's output after a large previous document. Extra
    memory is O(n_docs * W * C), not O(T * C).

    Args:
        x_BCT: [B, C, T] inputs. weight: [C, 1, W] depthwise kernel. bias: [C] or None.
        pos_BT: [B, T] position of each token within its document (:func:`document_index`).

    Returns:
        [B, C, T] (no activation), dtype of ``x_BCT``.
    """
    W = weight.shape[-1]
    C, T = x_BCT.shape[1], x_BCT.shape[2]
    w = weight.to(x_BCT.dtype)
    b = None if bias is None else bias.to(x_BCT.dtype)
    y = F.conv1d(F.pad(x_BCT, (W - 1, 0)), w, b, groups=C)
    if W == 1:
        return y
    b_idx, t_idx = torch.nonzero((pos_BT < W - 1) & (pos_BT < torch.arange(T, device=pos_BT.device)),
                                 as_tuple=True)  # near a document start, and not the row start (zero-padded)
    if b_idx.numel() == 0:
        return y
    acc = torch.promote_types(x_BCT.dtype, torch.float32)
    lag = torch.arange(W - 1, -1, -1, device=t_idx.device)  # F.conv1d pairs w[:, 0, k] with input t - (W - 1 - k)
    src = t_idx[:, None] - lag  # [n, W]
    keep = lag <= pos_BT[b_idx, t_idx][:, None]  # [n, W]: taps inside the document (so also src >= 0)
    win = x_BCT.transpose(1, 2)[b_idx[:, None], src.clamp(min=0)]  # [n, W, C]
    win = win.to(acc).masked_fill(~keep[..., None], 0)  # masked, not multiplied: inf / nan outside stay out
    out = (win * w[:, 0].t().to(acc)).sum(1)  # [n, C]
    if b is not None:
        out = out + b.to(acc)
    return y.transpose(1, 2).index_put((b_idx, t_idx), out.to(y.dtype)).transpose(1, 2)
