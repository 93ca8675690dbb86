"""Variable-length (packed) sequences for the chunked linear-recurrence ops: ``cu_seqlens`` checks and the
per-document chunk layout.

Convention (fla / flash-attn varlen): several documents are packed along the time axis of a batch of size 1;
``cu_seqlens`` is an integer tensor [n_docs + 1] of offsets into that axis, ``cu_seqlens[0] = 0``,
``cu_seqlens[-1] = T``, strictly increasing (no empty documents). Document i is tokens
``cu_seqlens[i] : cu_seqlens[i + 1]``; recurrent state and short-conv history restart at each document.

The torch chunked ops handle packing exactly by re-laying the tokens out so that every document starts on a
chunk boundary (its last chunk padded with inert tokens: g = beta = 0 / dt = 0 and zero k, v, x, which leave the
state unchanged) and resetting the state at each document's first chunk. This is fla's own scheme
(``prepare_chunk_indices``): chunks never straddle two documents. Extra work: at most C - 1 padded tokens per
document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, what: str = "cu_seqlens") -> list[int]:
    """Validate ``cu_seqlens`` against a packed length ``total`` and return it as a Python list.

    Raises:
        ValueError: not 1-D integer, not starting at 0 / ending at ``total``, or not strictly increasing (an
            empty document), with the offending values in the message.
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"{what} must be a 1-D integer tensor of document offsets [n_docs + 1]; got "
                         f"{getattr(cu_seqlens, 'shape', type(cu_seqlens))}")
    cu = cu_seqlens.tolist()
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"{what} must start at 0 and end at the packed length {total}; got {cu[:4]}...{cu[-2:]}")
    bad = [i for i in range(len(cu) - 1) if cu[i + 1] <= cu[i]]
    if bad:
        raise ValueError(f"{what} must be strictly increasing (no empty documents); offsets {cu[bad[0]]} -> "
                         f"{cu[bad[0] + 1]} at index {bad[0]}")
    return cu


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """Where each packed token goes when every document is padded to whole chunks.

    Attributes:
        index: [N * C] int64, the packed token index held by each slot; ``total`` (one past the end) for padding.
        valid: [N * C] bool, True at slots holding a real token (in packed order, so ``x_pad[valid]`` undoes it).
        starts: per chunk, True where a document begins (the state is reset there). Python list, length N.
        doc_last_chunk: per document, the index of its last chunk (final states are read there).
        num_chunks: N.
    """

    index: torch.Tensor
    valid: torch.Tensor
    starts: list[bool]
    doc_last_chunk: list[int]
    num_chunks: int


def varlen_chunk_size(cu_seqlens: torch.Tensor, chunk_size: int) -> int:
    """The chunk length to use for packed documents: ``chunk_size``, or the next power of two >= the longest
    document when that is smaller (short documents would otherwise be padded to a whole long chunk; the chunk
    length changes only rounding, not the result)."""
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return max(1, min(chunk_size, 1 << max(0, longest - 1).bit_length()))


def chunk_layout(cu_seqlens: torch.Tensor, total: int, chunk_size: int, device: torch.device | None = None
                 ) -> ChunkLayout:
    """Per-document chunk layout of ``total`` packed tokens (see the module docstring).

    Raises:
        ValueError: on invalid ``cu_seqlens`` (:func:`check_cu_seqlens`) or ``chunk_size < 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    cu = check_cu_seqlens(cu_seqlens, total)
    device = cu_seqlens.device if device is None else device
    index, starts, last = [], [], []
    n = 0
    for s, e in zip(cu[:-1], cu[1:]):
        nc = -(-(e - s) // chunk_size)
        index.append(torch.arange(s, s + nc * chunk_size))
        starts += [True] + [False] * (nc - 1)
        n += nc
        last.append(n - 1)
    idx = torch.cat(index)
    # slots past a document's end point one past the packed tokens (a zero row appended by the gather)
    doc_end = torch.repeat_interleave(torch.tensor(cu[1:]), torch.tensor([len(i) for i in index]))
    valid = idx < doc_end
    idx = torch.where(valid, idx, torch.full_like(idx, total))
    return ChunkLayout(index=idx.to(device), valid=valid.to(device), starts=starts, doc_last_chunk=last,
                       num_chunks=n)


def gather_padded(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """x [T, ...] (packed tokens, batch axis removed) -> [N * C, ...] in the layout, zeros at padding slots."""
    x0 = torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)
    return x0.index_select(0, layout.index)
