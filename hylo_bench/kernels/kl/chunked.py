"""Fused hidden-state forward KL distillation loss, chunked over token rows (pure torch, CPU and GPU).

The loss takes final hidden states and LM-head weights instead of logits, so neither the student nor the teacher
[N, V] logit matrix exists at once: each chunk of C rows forms its fp32 logits, its loss and its gradient, then
frees them. The gradient is computed during the forward (the loss is terminal); backward only rescales it.

Legend: N token rows, C rows per chunk, V vocabulary size, H student hidden size, Ht teacher hidden size.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["chunked_kl_div"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _mm(a: Tensor, b: Tensor, acc_dtype: torch.dtype) -> Tensor:
    """``a @ b`` with the result in ``acc_dtype``.

    Low-precision CUDA operands stay low precision and the GEMM writes ``acc_dtype`` directly (tensor cores, no
    upcast copy of the weight); elsewhere (CPU has no ``mm.dtype`` kernel) the operands are upcast.
    """
    if a.dtype == acc_dtype and b.dtype == acc_dtype:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype and a.dtype in _LOW_PRECISION:
        return torch.mm(a, b, out_dtype=acc_dtype)
    return a.to(acc_dtype) @ b.to(acc_dtype)


def _chunked_kl_forward(
    x_s_NH: Tensor,
    w_s_VH: Tensor,
    x_t_NHt: Tensor,
    w_t_VHt: Tensor,
    mask_N: Tensor,
    temperature: float,
    chunk_size: int,
    need_dx: bool,
    need_dw: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Loss, dL/dx_s [N, H] (input dtype) and dL/dW_s [V, H] (fp32/fp64 accumulator) in one pass."""
    acc = torch.float64 if x_s_NH.dtype == torch.float64 else torch.float32
    n_rows = x_s_NH.shape[0]
    mask_cpu_N = mask_N.cpu()
    n_valid = int(mask_cpu_N.sum())
    loss = torch.zeros((), dtype=acc, device=x_s_NH.device)
    dx_NH = torch.zeros_like(x_s_NH) if need_dx else None
    dw_VH = torch.zeros(w_s_VH.shape, dtype=acc, device=w_s_VH.device) if need_dw else None
    if n_valid == 0:
        return loss, dx_NH, dw_VH
    # Gradient of T^2 * KL / n_valid w.r.t. the raw (unscaled) student logits: T * (p_s - p_t) / n_valid.
    grad_scale = temperature / n_valid
    # On CUDA, GEMM operands for dx / dW stay in the input dtype, as the logit GEMMs do.
    lp_operands = x_s_NH.is_cuda and x_s_NH.dtype in _LOW_PRECISION and w_s_VH.dtype == x_s_NH.dtype
    for start in range(0, n_rows, chunk_size):
        end = min(start + chunk_size, n_rows)
        if not bool(mask_cpu_N[start:end].any()):
            continue
        x_s_CH = x_s_NH[start:end]
        m_C1 = mask_N[start:end, None]
        logp_s_CV = torch.log_softmax(_mm(x_s_CH, w_s_VH.t(), acc).div_(temperature), dim=-1)
        logp_t_CV = torch.log_softmax(_mm(x_t_NHt[start:end], w_t_VHt.t(), acc).div_(temperature), dim=-1)
        p_t_CV = logp_t_CV.exp()
        # 0 * log 0 = 0: a teacher -inf logit (p_t = 0) adds nothing (the product alone would be 0 * -inf = NaN)
        row_kl_C = logp_t_CV.sub_(logp_s_CV).mul_(p_t_CV).masked_fill_(p_t_CV == 0, 0.0).sum(dim=-1)
        del logp_t_CV
        loss += torch.where(m_C1[:, 0], row_kl_C, torch.zeros_like(row_kl_C)).sum()
        if not (need_dx or need_dw):
            continue
        g_CV = logp_s_CV.exp_().sub_(p_t_CV)
        del p_t_CV
        g_CV.mul_(grad_scale).masked_fill_(~m_C1, 0.0)
        if lp_operands:
            g_CV = g_CV.to(x_s_NH.dtype)
        if need_dx:
            dx_NH[start:end] = _mm(g_CV, w_s_VH, acc)
        if need_dw:
            if g_CV.dtype == acc:
                dw_VH.addmm_(g_CV.t(), x_s_CH.to(acc))
            else:
                dw_VH += _mm(g_CV.t(), x_s_CH, acc)
        del g_CV, logp_s_CV
    return loss * (temperature**2 / n_valid), dx_NH, dw_VH


class _ChunkedKLDivFunction(torch.autograd.Function):
    """Autograd wrapper: gradients are computed in forward and saved; backward scales them by grad_output."""

    @staticmethod
    def forward(ctx, x_s_NH, w_s_VH, x_t_NHt, w_t_VHt, mask_N, temperature, chunk_size):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, dx_NH, dw_VH = _chunked_kl_forward(
            x_s_NH, w_s_VH, x_t_NHt, w_t_VHt, mask_N, temperature, chunk_size, need_dx, need_dw
        )
        ctx.w_dtype = w_s_VH.dtype
        ctx.save_for_backward(dx_NH, dw_VH)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        dx_NH, dw_VH = ctx.saved_tensors
        grad_x = None if dx_NH is None else dx_NH * grad_output.to(dx_NH.dtype)
        grad_w = None if dw_VH is None else (dw_VH * grad_output.to(dw_VH.dtype)).to(ctx.w_dtype)
        return grad_x, grad_w, None, None, None, None, None


def chunked_kl_div(
    student_hidden: Tensor,
    student_head_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_head_weight: Tensor,
    *,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    ignore_index: int = -100,
    chunk_size: int = 4096,
) -> Tensor:
    """Token-mean forward KL(p_t || p_s) from hidden states and LM heads, without materialising [N, V] logits.

    Computes exactly what ``kl_div_reference(x_s @ W_s.T, x_t @ W_t.T, ...)`` computes:
    ``T**2 / n_valid * sum_rows sum_v p_t * (log p_t - log p_s)`` with p = softmax(z / T), over the rows whose
    label is not ``ignore_index`` (all rows without labels); 0 with zero gradients when no row is valid.
    Liger's ``LigerFusedLinearJSD(jsd_beta=0.0)`` computes the same quantity without the T**2 factor.

    Per chunk of ``chunk_size`` rows the student and teacher logits are formed as fp32 GEMM outputs (fp64 for
    fp64 inputs; bf16/fp16 operands are upcast on CPU), and the gradients w.r.t. ``student_hidden`` (stored in
    its dtype) and ``student_head_weight`` (accumulated in fp32, cast to the weight dtype in backward) are
    computed right away. The grad of the head is skipped when ``student_head_weight`` does not require grad
    (frozen head), and the grad of the hidden states when they do not. Teacher tensors are detached: they
    never receive gradients. Peak extra memory is about 5 * C * V * 4 bytes plus dx [N, H] and an fp32 dW
    [V, H] (kernels.md sec. 11.6); the paper's C is 4096, C = 1024-2048 is cheaper at V = 152K.

    Args:
        student_hidden: [..., H] final student hidden states (after the final norm), any float dtype.
        student_head_weight: [V, H] student ``lm_head.weight`` (no bias).
        teacher_hidden: [..., Ht] final teacher hidden states, same leading shape; Ht may differ from H.
        teacher_head_weight: [V, Ht] teacher ``lm_head.weight`` (no bias).
        temperature: T > 0, divides both logit sets; the loss is multiplied by T**2. Default: 1.0.
        labels: [...] integer labels matching the leading shape, or None (every row counts). Only used as a
            mask. Default: None.
        ignore_index: label value whose rows are excluded from the sum and from n_valid. Default: -100.
        chunk_size: C, token rows per chunk (>= 1). Default: 4096.

    Returns:
        Scalar loss in nats per valid token, float32 (float64 for float64 inputs), differentiable w.r.t.
        ``student_hidden`` and ``student_head_weight``.

    Raises:
        ValueError: on a vocabulary-size mismatch between the heads, hidden sizes that do not match their head,
            mismatched leading shapes or labels, a non-positive temperature or chunk_size < 1.

    Reference:
        arXiv 2604.24715 eq. 4, eq. 22 (chunked per-token mean) and App. A.4 (fused hidden-state KL);
        kernels.md sec. 11.5.
    """
    if student_head_weight.ndim != 2 or teacher_head_weight.ndim != 2:
        raise ValueError(
            f"head weights: expected 2-D [V, H] tensors, got {list(student_head_weight.shape)} (student) and "
            f"{list(teacher_head_weight.shape)} (teacher)"
        )
    vocab_s, vocab_t = student_head_weight.shape[0], teacher_head_weight.shape[0]
    if vocab_s != vocab_t:
        raise ValueError(
            f"vocab size mismatch: student_head_weight has V={vocab_s}, teacher_head_weight has V={vocab_t}; "
            "distillation needs one shared vocabulary (pad or slice the heads to match)"
        )
    hidden_s, hidden_t = student_hidden.shape[-1], teacher_hidden.shape[-1]
    if student_head_weight.shape[1] != hidden_s:
        raise ValueError(
            f"student_head_weight: expected [V, H={hidden_s}] to match student_hidden, "
            f"got {list(student_head_weight.shape)}"
        )
    if teacher_head_weight.shape[1] != hidden_t:
        raise ValueError(
            f"teacher_head_weight: expected [V, Ht={hidden_t}] to match teacher_hidden, "
            f"got {list(teacher_head_weight.shape)}"
        )
    lead = student_hidden.shape[:-1]
    if teacher_hidden.shape[:-1] != lead:
        raise ValueError(
            f"teacher_hidden: expected leading shape {list(lead)} (as student_hidden), "
            f"got {list(teacher_hidden.shape[:-1])}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1 rows, got {chunk_size}")
    if labels is None:
        mask_N = torch.ones(lead.numel(), dtype=torch.bool, device=student_hidden.device)
    else:
        if labels.shape != lead:
            raise ValueError(f"labels: expected shape {list(lead)}, got {list(labels.shape)}")
        mask_N = (labels != ignore_index).reshape(-1).to(student_hidden.device)
    return _ChunkedKLDivFunction.apply(
        student_hidden.reshape(-1, hidden_s),
        student_head_weight,
        teacher_hidden.detach().reshape(-1, hidden_t),
        teacher_head_weight.detach(),
        mask_N,
        float(temperature),
        int(chunk_size),
    )
