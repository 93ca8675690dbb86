"""Stage losses: Enhanced-ILD (paper eq. 3) and end-to-end forward KL from hidden states (eq. 4 / eq. 22).

Legend: B batch, T tokens, D hidden.

Enhanced-ILD (training-recipe.md §2.1): for every layer l, the student layer gets the *teacher's* input to
layer l (teacher forcing) and is pulled towards the teacher's layer output h_l and token-mixer output a_l:
``sum_l mean_tokens(||h_l^s - h_l^t||_2 + ||a_l^s - a_l^t||_2)`` (norm over D, not squared, as in
Zebra-Llama; ``squared=True`` switches to the squared form). Layers are independent under teacher forcing, so
running ILD on the hybrid's layers is the same computation as distilling the pure-MLA and pure-linear
students and assembling them by index (§3.1), without the layers the hybrid discards.

Packed documents: every loss takes optional ``position_ids`` [B, T] restarting at 0 at each document
(``hylo_bench.upcycle.packing``). The teacher (a transformers Llama / Qwen3) then gets those position ids and no
attention mask and no cache (``use_cache=False``), from which transformers builds a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``; with a cache or a 2-D mask it would silently attend across
documents); the student gets the same positions and ``cu_seqlens``. With the ``sdpa`` implementation
transformers materialises that mask ([B, 1, T, T] bool: 4 GiB per row at 64K); ``flash_attention_2`` /
``flex_attention`` teachers use the positions without a dense mask. Every token still
counts once, so a packed loss is the token-weighted mean of the per-document losses.
"""

from __future__ import annotations

import torch
from torch import nn

from hylo_bench.kernels.kl import chunked_kl_div
from hylo_bench.upcycle.train.distributed import reshard_root, unshard_root


def _packed(input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[dict, dict]:
    """(teacher kwargs, student kwargs) for optional packed-document ``position_ids`` [B, T]."""
    if position_ids is None:
        return {}, {}
    from hylo_bench.models.varlen import cu_seqlens_from_position_ids

    if position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must match input_ids {tuple(input_ids.shape)}")
    position_ids = position_ids.to(input_ids.device)
    return {"position_ids": position_ids}, {"position_ids": position_ids,
                                            "cu_seqlens": cu_seqlens_from_position_ids(position_ids)}


@torch.no_grad()
def teacher_layer_io(teacher: nn.Module, input_ids: torch.Tensor,
                     position_ids: torch.Tensor | None = None) -> tuple[list, list, list]:
    """Run an HF Llama/Qwen3 model once and capture per layer: input [B, T, D], output, attention output.

    The attention output is the ``self_attn`` result after ``o_proj``, before the residual add.
    ``position_ids`` [B, T] restarting per document: packed documents (see the module docstring). An FSDP2-sharded
    teacher has its root unit (embeddings, final norm) gathered for the call and freed after it.
    """
    layers = teacher.model.layers
    ins: list = [None] * len(layers)
    outs: list = [None] * len(layers)
    mix: list = [None] * len(layers)
    hooks = []

    def first(x):
        return x[0] if isinstance(x, tuple) else x

    def layer_hook(i):
        def hook(module, args, kwargs, output):  # returns None: the output is left unchanged
            ins[i] = first(args) if args else kwargs["hidden_states"]
            outs[i] = first(output)
        return hook

    def attn_hook(i):
        def hook(module, args, output):
            mix[i] = first(output)
        return hook

    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(layer_hook(i), with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(attn_hook(i)))
    unshard_root(teacher)
    try:
        teacher.model(input_ids=input_ids, use_cache=False, **_packed(input_ids, position_ids)[0])
    finally:
        for h in hooks:
            h.remove()
    return ins, outs, mix


def _l2(a: torch.Tensor, b: torch.Tensor, squared: bool) -> torch.Tensor:
    dt = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32  # at least fp32
    d = (a.to(dt) - b.to(dt)).norm(dim=-1)
    return (d.square() if squared else d).mean()


def ild_loss(student, teacher: nn.Module, input_ids: torch.Tensor, squared: bool = False,
             position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Enhanced-ILD loss of a batch [B, T] summed over layers; also returns the two terms separately.

    The last layer's hidden-state term is taken after the final norm of each model (Zebra-Llama). FSDP2-sharded
    models (:mod:`hylo_bench.upcycle.train.distributed`) get their root units gathered for the loss; the
    teacher's is freed at the end, the student's by FSDP's post-backward (or here when no gradient is taken).
    ``position_ids`` [B, T] restarting per document: packed documents (module docstring).
    """
    unshard_root(student)
    ins, outs, mix = teacher_layer_io(teacher, input_ids, position_ids)
    B, T = input_ids.shape
    packed = _packed(input_ids, position_ids)[1]
    positions = packed.get("position_ids", torch.arange(T, device=input_ids.device).expand(B, T))
    hid_terms, mix_terms = [], []
    last = len(student.model.layers) - 1
    for i, layer in enumerate(student.model.layers):
        h_s, a_s, _ = layer(ins[i].to(next(layer.parameters()).dtype), positions, None,
                            cu_seqlens=packed.get("cu_seqlens"))
        h_t = outs[i]
        if i == last:
            h_s, h_t = student.model.norm(h_s), teacher.model.norm(h_t)
        hid_terms.append(_l2(h_s, h_t, squared))
        mix_terms.append(_l2(a_s, mix[i], squared))
    reshard_root(teacher)
    if not torch.is_grad_enabled():
        reshard_root(student)
    hid, mx = torch.stack(hid_terms).sum(), torch.stack(mix_terms).sum()
    return hid + mx, {"ild_hidden": hid.item(), "ild_mixer": mx.item()}


def kd_loss(student, teacher: nn.Module, input_ids: torch.Tensor, temperature: float = 1.0,
            chunk_size: int = 4096, position_ids: torch.Tensor | None = None,
            kl_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token forward KL(p_teacher || p_student) from final hidden states and both lm_heads, chunked so no
    [B*T, V] logits tensor exists (paper App. A.4 "fused KL hidden").

    ``kl_mask`` [B, T] bool: only these positions count (mean over them; ``--kl-tokens assistant``); None: all.

    ``position_ids`` [B, T] restarting per document: packed documents, no attention across them (module
    docstring). FSDP2-sharded models get their root units (embeddings, final norm, ``lm_head``) gathered for the
    loss; the teacher's is freed once the loss is formed (the chunked KL keeps no teacher tensor for backward), the
    student's by FSDP's post-backward (or here when no gradient is taken)."""
    unshard_root(student, teacher)
    t_kw, s_kw = _packed(input_ids, position_ids)
    with torch.no_grad():
        t_hidden = teacher.model(input_ids=input_ids, use_cache=False, **t_kw).last_hidden_state
    s_hidden = student.model(input_ids=input_ids, **s_kw).last_hidden_state
    labels = None if kl_mask is None else torch.where(kl_mask.to(input_ids.device), 0, -100).flatten()
    loss = chunked_kl_div(s_hidden.flatten(0, 1), student.lm_head.weight, t_hidden.flatten(0, 1),
                          teacher.lm_head.weight, temperature=temperature, chunk_size=chunk_size, labels=labels)
    reshard_root(teacher)
    if not torch.is_grad_enabled():
        reshard_root(student)
    return loss, {"kl": loss.item()}


def _next_token_nll(hidden_NH: torch.Tensor, head_VH: torch.Tensor, targets_N: torch.Tensor,
                    chunk_size: int = 2048) -> torch.Tensor:
    """Summed next-token negative log-likelihood (nats) of ``targets_N`` from hidden states [N, H] and a head
    [V, H], ``chunk_size`` rows of fp32 logits at a time."""
    total = torch.zeros((), dtype=torch.float64, device=hidden_NH.device)
    for i in range(0, hidden_NH.shape[0], chunk_size):
        logits = hidden_NH[i:i + chunk_size].float() @ head_VH.float().t()
        total += torch.nn.functional.cross_entropy(logits, targets_N[i:i + chunk_size], reduction="sum").double()
    return total


@torch.no_grad()
def eval_heldout(student, teacher: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> dict:
    """Held-out numbers on windows [N, T]: ``kl`` (mean forward KL of student to teacher, nats/token, every
    position), ``student_ppl`` and ``teacher_ppl`` (exp of the mean next-token NLL over the N (T - 1) predicted
    tokens of each window)."""
    kl, n_kl, nll_s, nll_t, n_tok = 0.0, 0, 0.0, 0.0, 0
    dev = next(student.parameters()).device
    for i in range(0, len(windows), batch_size):
        x = windows[i:i + batch_size].to(dev)
        unshard_root(student, teacher)
        hs = student.model(input_ids=x).last_hidden_state
        ht = teacher.model(input_ids=x, use_cache=False).last_hidden_state
        kl += chunked_kl_div(hs.flatten(0, 1), student.lm_head.weight, ht.flatten(0, 1),
                             teacher.lm_head.weight).item() * x.numel()
        n_kl += x.numel()
        tgt = x[:, 1:].flatten()
        nll_s += _next_token_nll(hs[:, :-1].flatten(0, 1), student.lm_head.weight, tgt).item()
        nll_t += _next_token_nll(ht[:, :-1].flatten(0, 1), teacher.lm_head.weight, tgt).item()
        reshard_root(student, teacher)
        n_tok += tgt.numel()
    n_tok = max(n_tok, 1)
    return {"kl": kl / max(n_kl, 1), "student_ppl": float(torch.tensor(nll_s / n_tok).exp()),
            "teacher_ppl": float(torch.tensor(nll_t / n_tok).exp()), "windows": int(len(windows)),
            "seq_len_tokens": int(windows.shape[1])}


@torch.no_grad()
def eval_kl(student, teacher: nn.Module, windows: torch.Tensor, batch_size: int = 4) -> float:
    """Mean per-token forward KL of ``student`` to ``teacher`` on held-out windows [N, T] (nats/token)."""
    total, n = 0.0, 0
    dev = next(student.parameters()).device
    for i in range(0, len(windows), batch_size):
        x = windows[i:i + batch_size].to(dev)
        loss, _ = kd_loss(student, teacher, x)
        total += loss.item() * x.numel()
        n += x.numel()
    return total / max(n, 1)
