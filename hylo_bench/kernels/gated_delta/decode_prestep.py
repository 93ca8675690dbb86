"""The element-wise part of a GDN decode token before the recurrence, as one op: the three 4-tap short
convolutions over the cached inputs (their caches shifted by one token, in place), SiLU, and the decay / write
gates. Torch reference here; a one-kernel Triton version in :mod:`.decode_prestep_triton` (CUDA).

Written as torch ops, ``torch.compile`` splits this into about 11 kernels per layer (a conv cache cannot be shifted
in place in one kernel without Inductor cloning it first); the Triton kernel is one launch, because each thread owns
its channels' cache rows (reads all taps, then writes).

Legend: B batch, H heads, Ck = H * K (q and k channels), Cv = H * Vd, C = 2 Ck + Cv, W conv width.
Maths: ``GatedDeltaNet.forward`` for T == 1 (hylo_bench.models.gdn; fla 0.6.0 ``ShortConvolution`` step, gates as
arXiv 2412.06464 §3 / fla ``GatedDeltaNet``: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_decode_prestep_reference(proj: torch.Tensor, conv_caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                                 conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token's convolutions and gates; the conv caches are shifted in place.

    Args:
        proj: [B, 1, >= C + 2H] the merged projection output ``[q_in ; k_in ; v_in ; a ; b ; ...]`` (model dtype).
        conv_caches: (q, k, v) conv inputs of the last W - 1 tokens, [B, Ck | Ck | Cv, W - 1], overwritten with
            the last W - 1 tokens including this one.
        conv_weight: [C, W] the q, k, v depthwise conv weights stacked (``conv.weight[:, 0]``).
        A_log, dt_bias: [H] float32.

    Returns:
        act [B, C] = SiLU(conv) of q, k, v in the model dtype (the conv summed in float32, float64 for float64
        inputs, and rounded before the SiLU as ``F.conv1d`` would); g [B, H] log decay and beta [B, H] write
        strength, float32 (float64 for float64).
    """
    B = proj.shape[0]
    H = A_log.shape[0]
    dt = torch.float64 if proj.dtype == torch.float64 else torch.float32
    widths = [c.shape[1] for c in conv_caches]
    C = sum(widths)
    inputs = proj[:, 0, :C].split(widths, dim=-1)
    weights = conv_weight.split(widths, dim=0)
    acts = []
    for inp, w, cache in zip(inputs, weights, conv_caches):
        xx_BCW = torch.cat([cache.to(proj.dtype), inp[..., None]], dim=-1)  # [B, C_i, W]
        y_BC = (xx_BCW.to(dt) * w.to(dt)).sum(-1).to(proj.dtype)
        cache.copy_(xx_BCW[..., 1:])
        acts.append(F.silu(y_BC))
    a_in, b_in = proj[:, 0, C:C + H], proj[:, 0, C + H:C + 2 * H]
    g = -A_log.to(dt).exp() * F.softplus(a_in.to(dt) + dt_bias.to(dt))
    beta = b_in.to(dt).sigmoid()
    return torch.cat(acts, dim=-1).view(B, C), g, beta


def gdn_decode_token_reference(proj: torch.Tensor, conv_caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                               conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                               state: torch.Tensor) -> torch.Tensor:
    """A whole GDN decode token: :func:`gdn_decode_prestep_reference`, then the gated delta rule's recurrent step
    with q / k L2-normalised (:func:`hylo_bench.kernels.gated_delta.gated_delta_rule_step`, scale K^-0.5). Conv
    caches and ``state`` are updated in place.

    Args:
        proj, conv_caches, conv_weight, A_log, dt_bias: as :func:`gdn_decode_prestep_reference`.
        state: [B, H, K, Vd] K-first recurrent state (float32; float64 for float64 models), overwritten.

    Returns:
        o [B, H * Vd] in proj's dtype: the recurrence's output before the gated output norm.
    """
    from hylo_bench.kernels.gated_delta.chunk import gated_delta_rule_step

    B, H = proj.shape[0], A_log.shape[0]
    Ck, Cv = conv_caches[0].shape[1], conv_caches[2].shape[1]
    act, g, beta = gdn_decode_prestep_reference(proj, conv_caches, conv_weight, A_log, dt_bias)
    q, k = act[:, :Ck].view(B, 1, H, Ck // H), act[:, Ck:2 * Ck].view(B, 1, H, Ck // H)
    v = act[:, 2 * Ck:].view(B, 1, H, Cv // H)
    o, new = gated_delta_rule_step(q, k, v, g.view(B, 1, H), beta.view(B, 1, H), state, use_qk_l2norm_in_kernel=True)
    state.copy_(new)
    return o.reshape(B, Cv).to(proj.dtype)
