"""Optional GPU forward of the SSD scan through fla 0.6.0 ``chunk_simple_gla`` (imported lazily).

SSD is simple-GLA after a change of variables (kernels.md sec. 9.3): q = C, k = B (expanded to heads),
v = dt * x, g = dt * A (log decay), scale 1; D * x is added afterwards. fla's state is [B, H, K=N, V=P]
(K-first), the transpose of ours. Forward only: its backward is blocked on Hopper + Triton < 3.7.1.
"""

from __future__ import annotations

import torch

from hylo_bench.kernels.ssd._common import check_inputs, prepare_dt, repeat_groups


def fla_ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD scan on CUDA via fla's ``chunk_simple_gla``; same contract as ``ssd_scan_chunked`` (state float32).

    ``cu_seqlens`` (packed documents, B = 1) is passed to fla as int64; states are then per document.

    Raises:
        ValueError: on non-CUDA tensors or inconsistent shapes.
        ImportError: when fla is not installed (``pip install flash-linear-attention==0.6.0``).
    """
    Bsz, T, H, P, N, G = check_inputs(x, dt, A, B, C, D, dt_bias, None if cu_seqlens is not None else initial_state)
    if cu_seqlens is not None:
        from hylo_bench.kernels.varlen import check_cu_seqlens

        check_cu_seqlens(cu_seqlens, T)
        if Bsz != 1:
            raise ValueError(f"cu_seqlens needs batch size 1 (fla varlen); got {Bsz}")
        cu_seqlens = cu_seqlens.to(device=x.device, dtype=torch.long)
    if x.device.type != "cuda":
        raise ValueError(f"the fla SSD back end needs CUDA/ROCm tensors; got {x.device}. Use backend='torch'.")
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        raise ImportError("backend='fla' needs flash-linear-attention 0.6.0 (pip install "
                          "flash-linear-attention==0.6.0 fla-core[cuda]==0.6.0)") from e
    dt_f = prepare_dt(dt, dt_bias, dt_softplus, torch.float32)
    q = repeat_groups(C, H // G).to(x.dtype)
    k = repeat_groups(B, H // G).to(x.dtype)
    v = (x.float() * dt_f[..., None]).to(x.dtype)
    g = dt_f * A.float()
    h0 = None if initial_state is None else initial_state.float().transpose(-1, -2).contiguous()
    o, hT = chunk_simple_gla(q, k, v, g=g, scale=1.0, initial_state=h0, output_final_state=True,
                              cu_seqlens=cu_seqlens)
    y = o.float()
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y.to(x.dtype), hT.float().transpose(-1, -2)
