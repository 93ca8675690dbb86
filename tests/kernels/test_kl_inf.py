"""Issue 19 item 17: -inf teacher logits in the KL losses. 0 * log 0 = 0 at a real token (the convention of
``torch.nn.functional.kl_div``, which uses xlogy), and padded rows contribute neither loss nor gradient, whatever
they hold."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hylo_bench.kernels.kl import chunked_kl_div, kl_div_reference

N, V = 6, 11


def _logits(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    z_s = torch.randn(N, V, generator=gen, dtype=torch.float64)
    z_t = torch.randn(N, V, generator=gen, dtype=torch.float64) * 2
    return z_s, z_t


def _expected(z_s, z_t, keep):
    """torch's own KL (xlogy: 0 log 0 = 0) over the kept rows, token mean."""
    logp_s = torch.log_softmax(z_s[keep], -1)
    p_t = torch.softmax(z_t[keep], -1)
    return F.kl_div(logp_s, p_t, reduction="sum") / int(keep.sum())


def test_reference_minus_inf_teacher_logit_at_a_real_token_is_finite_and_exact():
    z_s, z_t = _logits()
    z_t[2, [0, 5]] = -torch.inf  # a real token whose teacher rules two words out
    labels = torch.zeros(N, dtype=torch.long)
    z_s.requires_grad_()
    z_t.requires_grad_()
    loss = kl_div_reference(z_s, z_t, labels=labels)
    keep = torch.ones(N, dtype=torch.bool)
    assert torch.isfinite(loss) and torch.allclose(loss, _expected(z_s.detach(), z_t.detach(), keep), atol=1e-12)
    loss.backward()
    # d loss / d z_s = (p_s - p_t) / n: finite, and exact at the ruled-out words (p_t = 0)
    want = (torch.softmax(z_s.detach(), -1) - torch.softmax(z_t.detach(), -1)) / N
    assert torch.allclose(z_s.grad, want, atol=1e-12)
    assert torch.isfinite(z_t.grad).all()


def test_reference_padded_rows_with_minus_inf_or_nan_give_zero_gradients():
    z_s, z_t = _logits(1)
    labels = torch.tensor([5, -100, 3, -100, 1, 2])
    z_t[1] = -torch.inf  # a padded row: an all -inf teacher row (its softmax is NaN)
    z_t[3, 4] = -torch.inf
    z_s[3, 0] = torch.nan
    z_s.requires_grad_()
    z_t.requires_grad_()
    loss = kl_div_reference(z_s, z_t, labels=labels)
    keep = labels != -100
    assert torch.allclose(loss, _expected(z_s.detach(), z_t.detach(), keep), atol=1e-12)
    loss.backward()
    assert torch.isfinite(z_s.grad).all() and torch.isfinite(z_t.grad).all()
    assert (z_s.grad[~keep] == 0).all() and (z_t.grad[~keep] == 0).all()
    want = (torch.softmax(z_s.detach()[keep], -1) - torch.softmax(z_t.detach()[keep], -1)) / int(keep.sum())
    assert torch.allclose(z_s.grad[keep], want, atol=1e-12)


def test_chunked_minus_inf_teacher_logit_equals_torch_kl():
    gen = torch.Generator().manual_seed(2)
    x_s = torch.randn(N, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w_s = torch.randn(V, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    x_t = torch.rand(N, 4, generator=gen, dtype=torch.float64) + 0.1  # positive: x_t @ (-inf row) = -inf exactly
    w_t = torch.randn(V, 4, generator=gen, dtype=torch.float64)
    w_t[7] = -torch.inf  # word 7 is impossible for the teacher at every token
    labels = torch.tensor([1, 2, -100, 4, 5, 6])
    keep = labels != -100
    z_t = x_t @ w_t.t()
    assert torch.isinf(z_t[:, 7]).all()
    loss = chunked_kl_div(x_s, w_s, x_t, w_t, labels=labels, chunk_size=4)
    want = _expected((x_s @ w_s.t()).detach(), z_t, keep)
    assert torch.isfinite(loss) and torch.allclose(loss, want, atol=1e-12)
    loss.backward()
    p_s = torch.softmax((x_s @ w_s.t()).detach(), -1)
    g = torch.where(keep[:, None], p_s - torch.softmax(z_t, -1), torch.zeros_like(p_s)) / int(keep.sum())
    assert torch.allclose(x_s.grad, g @ w_s.detach(), atol=1e-12)
    assert torch.allclose(w_s.grad, g.t() @ x_s.detach(), atol=1e-12)
