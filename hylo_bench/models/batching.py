"""Padded batch inference that scorers share: per-token log-likelihoods and lm-eval-style (context, continuation)
log-likelihoods, for HyLo hybrids and plain transformers alike.

Legend: B batch, T padded length, V vocab.

Sequences of different lengths are padded to a [B, T] batch with an ``attention_mask`` (1 = real token). Both
padding sides give the one-by-one result for HyLo models (tests/models/test_batching.py): with LEFT padding
the MLA masks the padding keys and GDN / Mamba-2 layers treat padding as identity steps (conv inputs zeroed,
decay and write strength 0); with RIGHT padding the real tokens come first, so causal attention and the causal
conv / recurrence never read the padding behind them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

PADDING_SIDES = ("left", "right")


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token-id lists to ``(input_ids [B, T] int64, attention_mask [B, T] int64)``.

    Raises:
        ValueError: an empty sequence or batch, or ``side`` not in ``("left", "right")``.
    """
    if side not in PADDING_SIDES:
        raise ValueError(f"padding side must be one of {PADDING_SIDES}, got {side!r}")
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("need a non-empty batch of non-empty token sequences")
    width = max(len(s) for s in seqs)
    ids_BT = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids_BT[row, cols] = torch.as_tensor(list(s), dtype=torch.long)
        mask_BT[row, cols] = 1
    return ids_BT, mask_BT


@torch.inference_mode()
def _score(model: Any, seqs: Sequence[Sequence[int]], batch_size: int, pad_id: int,
           padding_side: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: (log p(x_t | x_<t) [n - 1] float32, x_t == argmax [n - 1] bool), on CPU, in input order."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start:start + batch_size]
        ids_BT, mask_BT = pad_batch(chunk, pad_id, padding_side)
        logits_BTV = model(input_ids=ids_BT.to(device), attention_mask=mask_BT.to(device)).logits[:, :-1].float()
        target_BT = ids_BT[:, 1:].to(device)
        logp_BT = F.log_softmax(logits_BTV, dim=-1).gather(-1, target_BT[..., None])[..., 0].cpu()
        hit_BT = (logits_BTV.argmax(-1) == target_BT).cpu()
        width = ids_BT.shape[1]
        for row, s in enumerate(chunk):
            first = width - len(s) if padding_side == "left" else 0  # column of the sequence's first token
            cols = slice(first, first + len(s) - 1)
            out.append((logp_BT[row, cols].clone(), hit_BT[row, cols].clone()))
    return out


def token_logprobs(model: Any, seqs: Sequence[Sequence[int]], *, batch_size: int = 8, pad_id: int = 0,
                   padding_side: str = "right") -> list[torch.Tensor]:
    """Per-token log-likelihoods ``log p(x_t | x_<t)`` of each sequence, in padded batches.

    Args:
        model: causal LM returning ``.logits`` [B, T, V] for ``(input_ids, attention_mask)``.
        seqs: token-id lists, each of length >= 1.
        batch_size: sequences per forward.
        pad_id: id written at padding positions (never scored; any valid id gives the same result).
        padding_side: ``"right"`` (real tokens first) or ``"left"``.

    Returns:
        One float32 CPU tensor [len(seq) - 1] per sequence, in input order (nats; entry t - 1 scores token t).

    Raises:
        ValueError: ``batch_size < 1``, an empty sequence, or an unknown padding side.
    """
    return [lp for lp, _ in _score(model, seqs, batch_size, pad_id, padding_side)]


def loglikelihoods(model: Any, tokenizer: Any, contexts: Sequence[str], continuations: Sequence[str], *,
                   batch_size: int = 8, padding_side: str = "right") -> list[tuple[float, bool]]:
    """lm-eval ``loglikelihood`` requests: ``(sum of log p(continuation tokens | context) in nats, is_greedy)``.

    The context is encoded with the tokenizer's special tokens (e.g. BOS). The continuation's tokens are those
    of ``encode(context + continuation)`` after the context's tokens when that prefix matches, else the
    continuation encoded alone and appended. ``is_greedy``: every continuation token is the argmax.

    Raises:
        ValueError: unequal list lengths, or a context / continuation that encodes to no tokens.
    """
    if len(contexts) != len(continuations):
        raise ValueError(f"need as many contexts as continuations; got {len(contexts)} and {len(continuations)}")
    seqs, n_cont = [], []
    for ctx, cont in zip(contexts, continuations):
        ctx_ids = list(tokenizer(ctx).input_ids)
        if not ctx_ids:
            raise ValueError(f"context {ctx!r} encodes to no tokens (and the tokenizer adds no BOS); the first "
                             f"continuation token would have nothing to condition on")
        whole = list(tokenizer(ctx + cont).input_ids)
        cont_ids = whole[len(ctx_ids):] if whole[:len(ctx_ids)] == ctx_ids else \
            list(tokenizer(cont, add_special_tokens=False).input_ids)
        if not cont_ids:
            raise ValueError(f"continuation {cont!r} encodes to no tokens")
        seqs.append(ctx_ids + cont_ids)
        n_cont.append(len(cont_ids))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scored = _score(model, seqs, batch_size, pad_id, padding_side)
    return [(float(lp[-n:].sum()), bool(hit[-n:].all())) for (lp, hit), n in zip(scored, n_cont)]
