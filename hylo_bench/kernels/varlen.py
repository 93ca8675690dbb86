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
document. The documents are dealt into lanes run as a batch, so the sequential loop over chunks is about as long
as the longest document, not the whole packed batch.
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
    """Where each packed token goes when every document is padded to whole chunks and the documents are dealt
    into ``L`` lanes (batch rows) that the chunk loop runs side by side.

    Attributes:
        index: [L, N * C] int64, the packed token index held by each slot; ``total`` (one past the end) at padding.
        slot: [T] int64, where each packed token sits in the flattened [L * N * C] layout (undoes the gather).
        starts: [L, N] bool, True at a lane's chunk that begins a document (the state is reset there).
        doc_at: [L, N] int64, the document of each chunk (0 at a lane's tail padding).
        ends: chunk n -> (lanes, documents) whose document ends at chunk n (final states are read there).
        num_lanes, num_chunks: L, N.
    """

    index: torch.Tensor
    slot: torch.Tensor
    starts: torch.Tensor
    doc_at: torch.Tensor
    ends: dict[int, tuple[list[int], list[int]]]
    num_lanes: int
    num_chunks: int


def varlen_chunk_size(cu_seqlens: torch.Tensor, chunk_size: int) -> int:
    """The chunk length to use for packed documents: ``chunk_size``, or the next power of two >= the longest
    document when that is smaller (short documents would otherwise be padded to a whole long chunk; the chunk
    length changes only rounding, not the result)."""
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return max(1, min(chunk_size, 1 << max(0, longest - 1).bit_length()))


def chunk_layout(cu_seqlens: torch.Tensor, total: int, chunk_size: int, device: torch.device | None = None,
                 lanes: int | None = None) -> ChunkLayout:
    """Per-document chunk layout of ``total`` packed tokens (see the module docstring).

    Documents are dealt into lanes longest first, each to the lane with the fewest chunks so far (LPT), so the
    sequential chunk loop runs about as many steps as the longest document has chunks instead of the total.

    Args:
        lanes: number of lanes; default ``ceil(total chunks / chunks of the longest document)`` (at most one
            per document). 1 gives one lane with the documents in packed order.

    Raises:
        ValueError: on invalid ``cu_seqlens`` (:func:`check_cu_seqlens`), ``chunk_size < 1`` or ``lanes < 1``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    cu = check_cu_seqlens(cu_seqlens, total)
    device = cu_seqlens.device if device is None else device
    C = chunk_size
    nch = [-(-(e - s) // C) for s, e in zip(cu[:-1], cu[1:])]
    if lanes is None:
        lanes = min(len(nch), -(-sum(nch) // max(nch)))
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1; got {lanes}")
    load = [0] * lanes
    placed: list[tuple[int, int, int]] = []  # (doc, lane, first chunk)
    for d in sorted(range(len(nch)), key=lambda i: (-nch[i], i)) if lanes > 1 else range(len(nch)):
        lane = min(range(lanes), key=lambda j: (load[j], j))
        placed.append((d, lane, load[lane]))
        load[lane] += nch[d]
    N = max(load)
    index = torch.full((lanes, N * C), total, dtype=torch.long)
    slot = torch.empty(total, dtype=torch.long)
    starts = torch.zeros(lanes, N, dtype=torch.bool)
    doc_at = torch.zeros(lanes, N, dtype=torch.long)
    ends: dict[int, tuple[list[int], list[int]]] = {}
    for d, lane, c0 in placed:
        s, e = cu[d], cu[d + 1]
        index[lane, c0 * C:c0 * C + e - s] = torch.arange(s, e)
        slot[s:e] = torch.arange(e - s) + lane * N * C + c0 * C
        starts[lane, c0] = True
        doc_at[lane, c0:c0 + nch[d]] = d
        lanes_n, docs_n = ends.setdefault(c0 + nch[d] - 1, ([], []))
        lanes_n.append(lane)
        docs_n.append(d)
    return ChunkLayout(index=index.to(device), slot=slot.to(device), starts=starts.to(device),
                       doc_at=doc_at.to(device), ends=ends, num_lanes=lanes, num_chunks=N)


def packed_layout(cu_seqlens: torch.Tensor, batch: int, total: int, chunk_size: int,
                  initial_state: torch.Tensor | None, state_shape: tuple[int, ...], state_dims: str,
                  device: torch.device | None = None) -> tuple[int, ChunkLayout]:
    """(chunk length, :class:`ChunkLayout`) for a chunked scan over packed documents, after the checks the
    chunked GDN and SSD scans share: the documents are flattened into batch 1, and an initial state (if any) is
    one per document, ``[n_docs, *state_shape]``.

    Args:
        cu_seqlens: [n_docs + 1] int offsets. batch: the inputs' batch size. total: packed tokens.
        chunk_size: the scan's chunk length (shrunk by :func:`varlen_chunk_size`). initial_state: or None.
        state_shape: the per-document state shape (without n_docs); state_dims: its names for the error, e.g.
            "HV, K, V".

    Raises:
        ValueError: batch != 1, an initial state of the wrong shape, or invalid ``cu_seqlens``.
    """
    if batch != 1:
        raise ValueError(f"cu_seqlens needs the packed documents flattened into batch size 1; got B={batch}")
    chunk_size = varlen_chunk_size(cu_seqlens, chunk_size)
    layout = chunk_layout(cu_seqlens, total, chunk_size, device=device)
    want = (cu_seqlens.shape[0] - 1, *state_shape)
    if initial_state is not None and tuple(initial_state.shape) != want:
        raise ValueError(f"with cu_seqlens, initial_state must be [n_docs, {state_dims}] = {want}; "
                         f"got {tuple(initial_state.shape)}")
    return chunk_size, layout


def gather_padded(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """x [T, ...] (packed tokens, batch axis removed) -> [L, N * C, ...] in the layout, zeros at padding slots."""
    x0 = torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)
    return x0.index_select(0, layout.index.flatten()).view(*layout.index.shape, *x.shape[1:])


def scatter_back(y: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """y [L, N * C, ...] in the layout -> [T, ...] in packed order (padding slots dropped)."""
    return y.reshape(-1, *y.shape[2:]).index_select(0, layout.slot)


def reset_states(state: torch.Tensor, layout: ChunkLayout, n: int, initial_state: torch.Tensor | None
                 ) -> torch.Tensor:
    """The per-lane state [L, ...] entering chunk n: reset (to zeros or the document's ``initial_state``
    [n_docs, ...]) in lanes where a document starts."""
    start = layout.starts[:, n].view(-1, *([1] * (state.dim() - 1)))
    init = torch.zeros_like(state) if initial_state is None else \
        initial_state.to(state.dtype).index_select(0, layout.doc_at[:, n])
    return torch.where(start, init, state)


def final_states(pieces: list[tuple[list[int], torch.Tensor]], n_docs: int) -> torch.Tensor:
    """Stack (documents, their final states [k, ...]) pieces into [n_docs, ...] in document order."""
    docs = [d for ds, _ in pieces for d in ds]
    states = torch.cat([st for _, st in pieces], dim=0)
    order = torch.empty(n_docs, dtype=torch.long)
    order[torch.tensor(docs)] = torch.arange(len(docs))
    return states.index_select(0, order.to(states.device))
