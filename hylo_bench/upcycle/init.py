"""Stage-0 initialisation of MLA, GDN and Mamba-2 mixers from a base attention layer's q/k/v/o weights.

Pure tensor functions: weights in, state-dict fragments (keys relative to the mixer) out. No modules, no I/O.
All weights are in PyTorch [out, in] orientation. Spec: checkpoint-format.md sec. 7.1 (MLA), 7.3 (Mamba-2) and
7.4 (GDN).

Legend (checkpoint-format.md notation, so H is the hidden size here): n_h query heads, n_kv base KV heads,
n_kvm MLA KV heads, d_h base head dim, r_q / r_kv latent ranks, d_N / d_R / d_V MLA nope / rope / value head
dims, d_qk = d_N + d_R.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gdn_init_from_attention", "mamba2_init_from_attention", "repeat_kv_rows", "svd_init_mla"]

_GDN_COPIED_KEYS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")


def repeat_kv_rows(w: Tensor, num_kv_heads: int, head_dim: int, n_rep: int) -> Tensor:
    """Repeat-interleave the per-head row blocks of a K or V projection (GQA expansion).

    Args:
        w: [n_kv * d_h, H] projection weight, any dtype.
        num_kv_heads: n_kv, the number of d_h-row blocks in ``w``.
        head_dim: d_h.
        n_rep: how many times each head block is repeated (``g``).

    Returns:
        [n_kv * n_rep * d_h, H], same dtype; block j of ``w`` becomes blocks j*n_rep ... j*n_rep + n_rep - 1
        (the layout of transformers' ``repeat_kv``: query head h uses KV head h // n_rep).
    """
    blocks = w.reshape(num_kv_heads, head_dim, w.shape[-1])
    return blocks.repeat_interleave(n_rep, dim=0).reshape(num_kv_heads * n_rep * head_dim, w.shape[-1])


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_weight(name: str, w: Tensor, expected: tuple[int, int]) -> None:
    if tuple(w.shape) != expected:
        raise ValueError(f"{name}: expected shape {list(expected)} from the head settings, got {list(w.shape)}")


def _svd_factors(w: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Top-``rank`` truncated SVD of ``w`` = U S Vh, returned as (U_r, S_r Vh_r) (Sigma in the down-projection)."""
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    return u[:, :rank], s[:rank, None] * vh[:rank]


def svd_init_mla(
    q_w: Tensor,
    k_w: Tensor,
    v_w: Tensor,
    o_w: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_lora_rank: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    num_mla_kv_heads: int,
    q_norm_w: Tensor | None = None,
    k_norm_w: Tensor | None = None,
) -> dict[str, Tensor]:
    """Initialise an MLA layer from a (GQA) attention layer by truncated SVD (X-EcoMLA method).

    Query: W_Q = U S Vh; ``q_a_proj = S_r Vh_r`` and ``q_b_proj = Select(U_r)``, where Select keeps, per head,
    the first d_N and the last d_R rows of the head's d_h-row block (the identity when d_N + d_R = d_h, so
    q_b @ q_a is then the best rank-r_q approximation of W_Q).

    Keys/values: the rope key is the mean over the n_kv heads of the last d_R rows of each head's W_K block (one
    shared rope head, not from the SVD). W_K and W_V are repeat-interleaved g = n_kvm / n_kv times, stacked as
    W_KV = [W_K_rep ; W_V_rep] and jointly decomposed; ``kv_a_proj_with_mqa = [S_r Vh_r ; rope key]`` and
    ``kv_b_proj`` holds per MLA KV head j the rows [first d_N rows of K head j | all d_h rows of V head j] of U_r.

    Conventions: Sigma is folded into the down-projections (q_a, kv_a) for both Q and KV, as Zebra-Llama does;
    paper eq. 11 folds it into kv_b instead (same product, different latent scale). The SVD and the rope-key
    mean run in float32 (float64 for float64 inputs); Zebra-Llama averages the rope key in the load dtype, which
    differs by at most one rounding of that dtype. Outputs are cast back to the input dtype and device.

    Args:
        q_w: [n_h * d_h, H] base ``q_proj.weight``.
        k_w: [n_kv * d_h, H] base ``k_proj.weight``.
        v_w: [n_kv * d_h, H] base ``v_proj.weight``.
        o_w: [H, n_h * d_h] base ``o_proj.weight``.
        num_heads: n_h.
        num_kv_heads: n_kv of the base model.
        head_dim: d_h.
        q_lora_rank: r_q, at most min(n_h * d_h, H).
        kv_lora_rank: r_kv, at most min(2 * n_kvm * d_h, H). With g > 1 the rows repeat, so singular values
            beyond 2 * n_kv * d_h are zero.
        qk_nope_head_dim: d_N.
        qk_rope_head_dim: d_R; d_N + d_R must not exceed d_h.
        v_head_dim: d_V; must equal d_h.
        num_mla_kv_heads: n_kvm, a multiple of n_kv.
        q_norm_w: [d_h] Qwen3 ``q_norm.weight`` or None; copied to ``q_norm.weight`` (needs d_qk = d_h).
        k_norm_w: [d_h] Qwen3 ``k_norm.weight`` or None; copied to ``k_norm.weight`` (needs d_qk = d_h).

    Returns:
        Keys relative to the MLA mixer (checkpoint-format.md sec. 4.2): ``q_a_proj.weight`` [r_q, H],
        ``q_b_proj.weight`` [n_h * d_qk, r_q], ``kv_a_proj_with_mqa.weight`` [r_kv + d_R, H] (rows
        [latent | rope key]), ``kv_b_proj.weight`` [n_kvm * (d_N + d_V), r_kv] (per head [K_nope | V]),
        ``out_proj.weight`` [H, n_h * d_V], plus ``q_norm.weight`` / ``k_norm.weight`` [d_h] when given.

    Raises:
        ValueError: on d_V != d_h, d_N + d_R > d_h, n_kvm not a multiple of n_kv, a rank above its bound,
            a weight shape that disagrees with the head settings, or mixed input dtypes.

    Reference:
        arXiv 2604.24715 App. A.2.2 eqs. 8-14; X-EcoMLA arXiv 2503.11132;
        AMD-Hybrid-Models Zebra-Llama ``re_init_q`` / ``re_init_kv``.
    """
    n_h, n_kv, d_h = num_heads, num_kv_heads, head_dim
    d_n, d_r, d_v, n_kvm = qk_nope_head_dim, qk_rope_head_dim, v_head_dim, num_mla_kv_heads
    hidden = q_w.shape[-1]
    if d_v != d_h:
        raise ValueError(
            f"v_head_dim: expected {d_h} (= head_dim; the SVD init takes whole value heads), got {d_v}"
        )
    if d_n < 0 or d_r < 0 or d_n + d_r > d_h:
        raise ValueError(
            f"qk_nope_head_dim + qk_rope_head_dim: expected non-negative dims summing to at most head_dim={d_h}, "
            f"got {d_n} + {d_r}"
        )
    if n_kvm < n_kv or n_kvm % n_kv:
        raise ValueError(f"num_mla_kv_heads: expected a multiple of num_kv_heads={n_kv}, got {n_kvm}")
    _check_weight("q_w", q_w, (n_h * d_h, hidden))
    _check_weight("k_w", k_w, (n_kv * d_h, hidden))
    _check_weight("v_w", v_w, (n_kv * d_h, hidden))
    _check_weight("o_w", o_w, (hidden, n_h * d_h))
    q_bound = min(n_h * d_h, hidden)
    if not 1 <= q_lora_rank <= q_bound:
        raise ValueError(f"q_lora_rank: expected 1..min(n_h*d_h, H)={q_bound}, got {q_lora_rank}")
    kv_bound = min(2 * n_kvm * d_h, hidden)
    if not 1 <= kv_lora_rank <= kv_bound:
        raise ValueError(f"kv_lora_rank: expected 1..min(2*n_kvm*d_h, H)={kv_bound}, got {kv_lora_rank}")
    dtypes = {w.dtype for w in (q_w, k_w, v_w, o_w)}
    if len(dtypes) != 1:
        raise ValueError(f"q_w/k_w/v_w/o_w: expected one dtype, got {sorted(str(d) for d in dtypes)}; cast first")
    out_dtype = q_w.dtype
    cdt = _compute_dtype(out_dtype)

    # Query: Select keeps the first d_N and the last d_R rows of each head block of U_r.
    u_q, q_a = _svd_factors(q_w.to(cdt), q_lora_rank)
    u_q_heads = u_q.reshape(n_h, d_h, q_lora_rank)
    q_b = torch.cat([u_q_heads[:, :d_n], u_q_heads[:, d_h - d_r:]], dim=1).reshape(n_h * (d_n + d_r), q_lora_rank)

    # Keys/values: one shared rope head from the head-averaged key rows, the rest by a joint SVD.
    k_rope = k_w.to(cdt).reshape(n_kv, d_h, hidden).mean(dim=0)[d_h - d_r:]
    g = n_kvm // n_kv
    w_kv = torch.cat([repeat_kv_rows(k_w.to(cdt), n_kv, d_h, g), repeat_kv_rows(v_w.to(cdt), n_kv, d_h, g)])
    u_kv, kv_latent = _svd_factors(w_kv, kv_lora_rank)
    u_k = u_kv[: n_kvm * d_h].reshape(n_kvm, d_h, kv_lora_rank)
    u_v = u_kv[n_kvm * d_h:].reshape(n_kvm, d_h, kv_lora_rank)
    kv_b = torch.cat([u_k[:, :d_n], u_v], dim=1).reshape(n_kvm * (d_n + d_v), kv_lora_rank)
    kv_a = torch.cat([kv_latent, k_rope])

    out = {
        "q_a_proj.weight": q_a,
        "q_b_proj.weight": q_b,
        "kv_a_proj_with_mqa.weight": kv_a,
        "kv_b_proj.weight": kv_b,
    }
    out = {key: t.to(out_dtype).contiguous() for key, t in out.items()}
    out["out_proj.weight"] = o_w.detach().clone()
    for key, norm_w in (("q_norm.weight", q_norm_w), ("k_norm.weight", k_norm_w)):
        if norm_w is None:
            continue
        if tuple(norm_w.shape) != (d_h,) or d_n + d_r != d_h:
            raise ValueError(
                f"{key}: a base per-head norm of shape [{d_h}] needs d_qk = d_N + d_R = head_dim; "
                f"got shape {list(norm_w.shape)} with d_qk = {d_n + d_r}"
            )
        out[key] = norm_w.detach().clone()
    return out


def gdn_init_from_attention(
    q_w: Tensor,
    k_w: Tensor,
    v_w: Tensor,
    o_w: Tensor,
    gdn_params: dict[str, Tensor],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, Tensor]:
    """Copy the overlapping sub-blocks of a (GQA) attention layer into freshly initialised GDN weights.

    K and V are first GQA-expanded (each KV head repeated n_h / n_kv times, ``repeat_kv_rows``) to
    [n_h * d_h, H]. Then, with d_k the GDN key dim and d_v the GDN value dim:
    ``q_proj[:a] <- W_Q[:a]`` and ``k_proj[:a] <- W~_K[:a]`` with a = min(d_k, n_h * d_h);
    ``v_proj[:b] <- W~_V[:b]`` and ``o_proj[:, :b] <- W_O[:, :b]`` with b = min(d_v, n_h * d_h).
    It is a dimensional copy, not a head-to-head map: a 256-dim GDN key head receives several consecutive
    base heads. Every other tensor (g/a/b projections, A_log, dt_bias, convolutions, o_norm) and the rows /
    columns outside the overlap keep their values bit for bit.

    Args:
        q_w: [n_h * d_h, H] base ``q_proj.weight``.
        k_w: [n_kv * d_h, H] base ``k_proj.weight``.
        v_w: [n_kv * d_h, H] base ``v_proj.weight``.
        o_w: [H, n_h * d_h] base ``o_proj.weight``.
        gdn_params: freshly initialised GDN mixer state dict (fla ``GatedDeltaNet`` names, relative to the
            mixer); must hold ``q_proj.weight`` [d_k, H], ``k_proj.weight`` [d_k, H], ``v_proj.weight``
            [d_v, H] and ``o_proj.weight`` [H, d_v]. Not modified.
        num_heads: n_h.
        num_kv_heads: n_kv; must divide n_h.
        head_dim: d_h.

    Returns:
        A new dict with the same keys as ``gdn_params``; every tensor is a clone (dtype and device of the GDN
        tensor), the four projections with the base slices copied in (cast to the GDN dtype).

    Raises:
        ValueError: on a missing projection key, n_h not a multiple of n_kv, or shapes that disagree
            (base weights vs head settings, GDN hidden size vs base hidden size).

    Reference:
        arXiv 2604.24715 sec. 3.1 eqs. 1-2; checkpoint-format.md sec. 7.4.
    """
    n_h, n_kv, d_h = num_heads, num_kv_heads, head_dim
    missing = [key for key in _GDN_COPIED_KEYS if key not in gdn_params]
    if missing:
        raise ValueError(f"gdn_params: missing {missing}; pass the mixer state dict with fla GatedDeltaNet names")
    if n_kv < 1 or n_h % n_kv:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads={n_h}, got {n_kv}")
    hidden = q_w.shape[-1]
    _check_weight("q_w", q_w, (n_h * d_h, hidden))
    _check_weight("k_w", k_w, (n_kv * d_h, hidden))
    _check_weight("v_w", v_w, (n_kv * d_h, hidden))
    _check_weight("o_w", o_w, (hidden, n_h * d_h))
    for key in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
        if gdn_params[key].ndim != 2 or gdn_params[key].shape[1] != hidden:
            raise ValueError(f"gdn_params[{key!r}]: expected [rows, H={hidden}], got {list(gdn_params[key].shape)}")
    if gdn_params["o_proj.weight"].ndim != 2 or gdn_params["o_proj.weight"].shape[0] != hidden:
        raise ValueError(
            f"gdn_params['o_proj.weight']: expected [H={hidden}, cols], got {list(gdn_params['o_proj.weight'].shape)}"
        )

    g = n_h // n_kv
    sources = {
        "q_proj.weight": q_w,
        "k_proj.weight": repeat_kv_rows(k_w, n_kv, d_h, g),
        "v_proj.weight": repeat_kv_rows(v_w, n_kv, d_h, g),
    }
    out = {key: t.detach().clone() for key, t in gdn_params.items()}
    with torch.no_grad():
        for key, src in sources.items():
            rows = min(out[key].shape[0], src.shape[0])
            out[key][:rows] = src[:rows].to(out[key])
        cols = min(out["o_proj.weight"].shape[1], o_w.shape[1])
        out["o_proj.weight"][:, :cols] = o_w[:, :cols].to(out["o_proj.weight"])
    return out


def mamba2_init_from_attention(
    q_w: Tensor,
    k_w: Tensor,
    v_w: Tensor,
    o_w: Tensor,
    mamba_params: dict[str, Tensor],
    *,
    d_inner: int,
    d_xb: int,
) -> dict[str, Tensor]:
    """Copy an attention layer into freshly initialised Mamba-2 weights (MambaInLlama mapping).

    ``in_proj`` rows (layout [z: d_inner | x: d_xb | B: d_xb | C: d_inner | dt: n_h]):
    x <- ``v_proj``, B <- ``k_proj``, C <- ``q_proj``; ``out_proj`` <- ``o_proj``. No GQA expansion: x and B keep
    the KV width (d_xb = n_kv * d_h) and are repeated to heads inside the mixer. The z and dt rows, conv1d
    (weight, bias), dt_bias, A_log, D and the gated-norm weight keep their values bit for bit (their fresh
    mamba_ssm-default init). No RoPE is carried over and Qwen3 q/k norms are not used.

    Args:
        q_w: [d_inner, H] base ``q_proj.weight`` (n_h * d_h rows).
        k_w: [d_xb, H] base ``k_proj.weight``.
        v_w: [d_xb, H] base ``v_proj.weight``.
        o_w: [H, d_inner] base ``o_proj.weight``.
        mamba_params: freshly initialised Mamba-2 mixer state dict (keys relative to the mixer, sec. 4.5); must
            hold ``in_proj.weight`` [2 d_inner + 2 d_xb + n_h, H] and ``out_proj.weight`` [H, d_inner]. Not
            modified.
        d_inner: Mamba-2 inner width (= n_h * d_h).
        d_xb: x/B width (= n_kv * d_h).

    Returns:
        A new dict with the same keys; every tensor a clone with the mixer's dtype and device, the mapped
        rows/matrix cast to that dtype.

    Raises:
        ValueError: on a missing key or shapes that disagree (base weights vs d_inner / d_xb / hidden size,
            in_proj row count).

    Reference:
        checkpoint-format.md sec. 7.3; MambaInLlama (arXiv 2408.15237); Zebra-Llama ``init_with_kqvo``.
    """
    missing = [key for key in ("in_proj.weight", "out_proj.weight") if key not in mamba_params]
    if missing:
        raise ValueError(f"mamba_params: missing {missing}; pass the Mamba-2 mixer state dict (Zebra-Llama names)")
    hidden = q_w.shape[-1]
    _check_weight("q_w", q_w, (d_inner, hidden))
    _check_weight("k_w", k_w, (d_xb, hidden))
    _check_weight("v_w", v_w, (d_xb, hidden))
    _check_weight("o_w", o_w, (hidden, d_inner))
    in_proj = mamba_params["in_proj.weight"]
    if in_proj.ndim != 2 or in_proj.shape[1] != hidden or in_proj.shape[0] <= 2 * d_inner + 2 * d_xb:
        raise ValueError(f"mamba_params['in_proj.weight']: expected [2*d_inner + 2*d_xb + n_h, H] = "
                         f"[{2 * d_inner + 2 * d_xb} + n_h, {hidden}], got {list(in_proj.shape)}")
    _check_weight("mamba_params['out_proj.weight']", mamba_params["out_proj.weight"], (hidden, d_inner))
    out = {key: t.detach().clone() for key, t in mamba_params.items()}
    w = out["in_proj.weight"]
    x0, b0, c0 = d_inner, d_inner + d_xb, d_inner + 2 * d_xb
    with torch.no_grad():
        w[x0:b0] = v_w.to(w)
        w[b0:c0] = k_w.to(w)
        w[c0:c0 + d_inner] = q_w.to(w)
        out["out_proj.weight"].copy_(o_w.to(out["out_proj.weight"]))
    return out
