"""Ground-truth forward KL distillation loss on full logits (pure torch; for tests and small inputs only).

Legend: N token rows, V vocabulary size.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kl_div_reference"]


def kl_div_reference(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    labels: Tensor | None = None,
) -> Tensor:
    """Token-mean forward KL(p_t || p_s) between teacher and student, from materialised logits.

    With p = softmax(z / T), the loss is ``T**2 / n_valid * sum_rows sum_v p_t * (log p_t - log p_s)`` over the
    rows whose label is not ``ignore_index`` (all rows when ``labels`` is None). The T**2 factor (Hinton et al.)
    keeps gradient magnitudes independent of T; at the recipe's T = 1 it is moot. Liger's
    ``LigerFusedLinearJSD`` omits it. With no valid row the loss is 0 (and so are the gradients). A teacher
    probability of 0 (a ``-inf`` logit) contributes 0 (0 * log 0 = 0, as ``torch.nn.functional.kl_div`` and
    ``scipy.special.rel_entr`` define it); rows whose label is ``ignore_index`` may hold anything (``-inf``,
    NaN): they give zero loss and zero gradients.

    Math runs in float32 (float64 for float64 inputs); the whole [N, V] softmax is materialised, so keep N*V
    small. Autograd flows to both inputs; detach the teacher yourself if needed.

    Args:
        student_logits: [..., V] raw student logits, any float dtype.
        teacher_logits: [..., V] raw teacher logits, same leading shape as ``student_logits``.
        temperature: T > 0, divides both logit sets. Default: 1.0.
        ignore_index: label value whose rows are excluded from the sum and from n_valid. Default: -100.
        labels: [...] integer labels matching the leading shape, or None (every row counts). Only used as a
            mask. Default: None.

    Returns:
        Scalar loss in nats per valid token, float32 (float64 for float64 inputs).

    Raises:
        ValueError: on mismatched shapes or a non-positive temperature.

    Reference:
        arXiv 2604.24715 eq. 4 and eq. 22 (per-token mean); training-recipe.md sec. 3.2 (forward direction).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"teacher_logits: expected the student shape {list(student_logits.shape)}, got {list(teacher_logits.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    vocab = student_logits.shape[-1]
    cdt = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    z_s_NV = student_logits.reshape(-1, vocab).to(cdt) / temperature
    z_t_NV = teacher_logits.reshape(-1, vocab).to(cdt) / temperature
    if labels is None:
        mask_N = torch.ones(z_s_NV.shape[0], dtype=torch.bool, device=z_s_NV.device)
    else:
        if labels.shape != student_logits.shape[:-1]:
            raise ValueError(
                f"labels: expected shape {list(student_logits.shape[:-1])}, got {list(labels.shape)}"
            )
        mask_N = (labels.reshape(-1) != ignore_index).to(z_s_NV.device)
    # Rows that do not count are replaced by zeros *before* the softmax, so whatever they hold (-inf, NaN) reaches
    # neither the loss nor, through the backward of a masked-out branch, the gradients.
    keep_N1 = mask_N[:, None]
    z_s_NV = torch.where(keep_N1, z_s_NV, torch.zeros_like(z_s_NV))
    z_t_NV = torch.where(keep_N1, z_t_NV, torch.zeros_like(z_t_NV))
    logp_s_NV = torch.log_softmax(z_s_NV, dim=-1)
    logp_t_NV = torch.log_softmax(z_t_NV, dim=-1)
    p_t_NV = logp_t_NV.exp()
    # 0 * log 0 = 0: a teacher token with p_t = 0 (a -inf logit) contributes nothing. Both where()s are needed so
    # that the backward of the discarded branch never multiplies 0 by -inf.
    support_NV = p_t_NV > 0
    safe_logp_t_NV = torch.where(support_NV, logp_t_NV, torch.zeros_like(logp_t_NV))
    terms_NV = torch.where(support_NV, p_t_NV * (safe_logp_t_NV - logp_s_NV), torch.zeros_like(p_t_NV))
    row_kl_N = terms_NV.sum(dim=-1)
    n_valid = int(mask_N.sum())
    total = torch.where(mask_N, row_kl_N, torch.zeros_like(row_kl_N)).sum()
    return total * (temperature**2 / max(n_valid, 1))
