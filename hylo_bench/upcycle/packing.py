"""Packing tokenized documents into rows of the stage's length, keeping the document boundaries.

Documents (each followed by EOS) are laid end to end and cut into rows of ``seq_len`` tokens, in order, with no
padding: the token stream is exactly the one the unmasked windows use (Zebra-Llama's packing,
training-recipe.md §6.2). What packing adds is the boundaries: ``position_ids`` [N, seq_len] restart at 0 at
every document start, and at every row start, so a document cut by a row end continues in the next row as a
new segment (it cannot attend to its own first part; that cut is recorded in ``splits``). The model side turns
``position_ids`` into ``cu_seqlens`` (``hylo_bench.models.varlen.cu_seqlens_from_position_ids``), so documents
do not attend across each other (MLA) and recurrent / conv states restart (GDN, Mamba-2).

Deterministic: the rows depend only on the documents and their order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PackedRows:
    """Rows of packed documents.

    Attributes:
        input_ids: [N, T] int64 token ids.
        position_ids: [N, T] int64, 0 at each document (or document piece) start, then 1, 2, ...
        splits: documents cut across rows: ``{"doc": k, "pieces": [[row, offset, length], ...]}`` (k = index of
            the document in the order it was packed; ``length`` includes its EOS when the piece ends with it).
        dropped: ``{"doc": k, "tokens": n}`` for the last document when its last n tokens did not fit in the
            requested rows (None if nothing was dropped).
        num_docs: documents placed (wholly or partly).
        assistant_mask: [N, T] bool, True at the tokens of an assistant turn of a conversation
            (``hylo_bench.text.chat``); None when no conversation was packed.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    splits: list[dict] = field(default_factory=list)
    dropped: dict | None = None
    num_docs: int = 0
    assistant_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def select(self, index) -> PackedRows:
        """Rows ``index`` (a list, slice or tensor of row indices); split records are kept for the whole set."""
        mask = None if self.assistant_mask is None else self.assistant_mask[index]
        return PackedRows(self.input_ids[index], self.position_ids[index], self.splits, self.dropped, self.num_docs,
                          mask)

    def kl_mask(self, tokens: str) -> torch.Tensor | None:
        """[N, T] bool: the positions whose next-token KL counts, for ``--kl-tokens`` ``tokens``.

        ``all``: None (every position). ``assistant``: position t counts when token t + 1 is an assistant token of
        the same document (the student learns to predict the assistant's tokens; the last position of a row
        predicts nothing in it).

        Raises:
            ValueError: ``assistant`` on rows without conversations, or an unknown mode.
        """
        if tokens == "all":
            return None
        if tokens != "assistant":
            raise ValueError(f"--kl-tokens {tokens!r}: expected 'all' or 'assistant'")
        if self.assistant_mask is None:
            raise ValueError("--kl-tokens assistant: the data has no conversations (rows with 'messages', "
                             "'conversations' or 'prompt'/'response'); use --kl-tokens all for plain text")
        out = torch.zeros_like(self.assistant_mask)
        out[:, :-1] = self.assistant_mask[:, 1:] & (self.position_ids[:, 1:] != 0)
        return out

    def summary(self) -> dict:
        """Counts for a manifest: ``rows``, ``seq_len``, ``segments`` (document pieces in these rows: positions
        equal to 0), ``mean_segment_tokens``, and of the packing they were taken from: ``documents`` packed,
        ``split_documents`` (cut across rows) and ``dropped_tokens`` (at the end)."""
        segments = int((self.position_ids == 0).sum())
        out = {"rows": len(self), "seq_len": int(self.input_ids.shape[1]), "segments": segments,
               "mean_segment_tokens": self.input_ids.numel() / max(segments, 1), "documents": self.num_docs,
               "split_documents": len(self.splits), "dropped_tokens": self.dropped["tokens"] if self.dropped else 0}
        if self.assistant_mask is not None:
            out["assistant_tokens"] = int(self.assistant_mask.sum())
        return out


class Packer:
    """Incremental packer: :meth:`add` documents until :attr:`full`, then :meth:`finish`.

    Args:
        seq_len: T, tokens per row.
        num_rows: rows to fill; None = unbounded (``finish`` drops the incomplete last row).
        eos_id: appended after every document (None: documents are used as given).

    Raises:
        ValueError: ``seq_len`` < 1 or ``num_rows`` < 1.
    """

    def __init__(self, seq_len: int, num_rows: int | None = None, eos_id: int | None = None):
        if seq_len < 1 or (num_rows is not None and num_rows < 1):
            raise ValueError(f"packing needs seq_len >= 1 and num_rows >= 1; got {seq_len}, {num_rows}")
        self.seq_len, self.num_rows, self.eos_id = seq_len, num_rows, eos_id
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.mask: list[bool] = []
        self.any_mask = False
        self.splits: list[dict] = []
        self.dropped: dict | None = None
        self.num_docs = 0

    @property
    def full(self) -> bool:
        return self.num_rows is not None and len(self.ids) >= self.num_rows * self.seq_len

    def add(self, tokens: list[int], mask: list[bool] | None = None, eos: bool = True) -> int:
        """Place one document (plus EOS unless ``eos`` is False); returns how many of its tokens were placed (fewer
        only when full). ``mask``: one bool per token (the assistant mask of a conversation; EOS gets False)."""
        add_eos = eos and self.eos_id is not None
        toks = list(tokens) + ([self.eos_id] if add_eos else [])
        if mask is not None:
            if len(mask) != len(tokens):
                raise ValueError(f"mask has {len(mask)} entries for {len(tokens)} tokens")
            self.any_mask = True
        flags = (list(mask) if mask is not None else [False] * len(tokens)) + ([False] if add_eos else [])
        if not toks or self.full:
            return 0
        k, T = self.num_docs, self.seq_len
        self.num_docs += 1
        room = None if self.num_rows is None else self.num_rows * T - len(self.ids)
        take = toks if room is None else toks[:room]
        pieces, i = [], 0
        while i < len(take):
            row, offset = divmod(len(self.ids), T)
            n = min(T - offset, len(take) - i)
            self.ids += take[i:i + n]
            self.mask += flags[i:i + n]
            self.pos += range(n)
            pieces.append([row, offset, n])
            i += n
        if len(pieces) > 1:
            self.splits.append({"doc": k, "pieces": pieces})
        if len(take) < len(toks):
            self.dropped = {"doc": k, "tokens": len(toks) - len(take)}
        return len(take)

    def finish(self) -> PackedRows:
        """The full rows ([N, T]); an incomplete last row is dropped (recorded in ``dropped``)."""
        T = self.seq_len
        n = len(self.ids) // T
        tail = len(self.ids) - n * T
        if tail and self.dropped is None:
            self.dropped = {"doc": self.num_docs - 1, "tokens": tail}
            # the tail's pieces no longer exist: drop them from the split records
            self.splits = [s | {"pieces": [p for p in s["pieces"] if p[0] < n]} for s in self.splits]
            self.splits = [s for s in self.splits if len(s["pieces"]) > 1]
        ids = torch.tensor(self.ids[: n * T], dtype=torch.long).view(n, T)
        pos = torch.tensor(self.pos[: n * T], dtype=torch.long).view(n, T)
        mask = torch.tensor(self.mask[: n * T], dtype=torch.bool).view(n, T) if self.any_mask else None
        return PackedRows(ids, pos, self.splits, self.dropped, self.num_docs, mask)


def pack_documents(docs, seq_len: int, *, eos_id: int | None = None, num_rows: int | None = None) -> PackedRows:
    """Pack tokenized documents (each + EOS) in order into rows of ``seq_len`` with per-document positions.

    Args:
        docs: iterable of token-id lists, or of ``(ids, mask, eos)`` triples (:meth:`Packer.add`), read lazily;
            reading stops once ``num_rows`` rows are full.
        seq_len: T.
        eos_id: token appended after each document, or None.
        num_rows: rows to fill (the last document is cut, its remainder recorded in ``dropped``); None = as many
            full rows as the documents give (the incomplete tail is dropped).

    Returns:
        :class:`PackedRows`; its ``cu_seqlens`` over a batch come from ``position_ids``.

    Raises:
        ValueError: bad sizes, or when ``num_rows`` rows cannot be filled.
    """
    packer = Packer(seq_len, num_rows, eos_id)
    for toks in docs:
        if packer.full:
            break
        if isinstance(toks, tuple):
            packer.add(*toks)
        else:
            packer.add(toks)
    rows = packer.finish()
    if num_rows is not None and len(rows) < num_rows:
        raise ValueError(f"the documents give {len(rows)} rows of {seq_len} tokens; {num_rows} were asked for")
    return rows


def positions_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """Positions [..., T] that restart at 0 wherever ``starts`` [..., T] (bool) is True and at index 0."""
    T = starts.shape[-1]
    idx = torch.arange(T, device=starts.device).expand_as(starts)
    s = starts.clone()
    s[..., 0] = True
    last = torch.where(s, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - last
