"""Chunked-prefill attention: T chunk queries over a cached prefix plus themselves, with back ends (kernels.md
§10.1).

The chunk's queries sit at positions ``start .. start + T - 1``, the S = start + T keys at ``0 .. S - 1``: query t
sees keys ``0 .. start + t`` (a lower-right aligned causal mask). Back ends (kernel registry choice
``prefix_attention``, ``$HYLO_BENCH_PREFIX_ATTENTION_BACKEND``):

- ``"sdpa"`` (:func:`sdpa_prefix_attention`, any device): one ``F.scaled_dot_product_attention`` call with torch's
  lower-right ``CausalBias``. torch runs that mask on its flash or memory-efficient kernels only.
- ``"cudnn_split"`` (:func:`split_prefix_attention` over :func:`cudnn_attend`, CUDA): the chunk over the prefix
  with no mask, plus the chunk over itself with a causal mask, as two cuDNN attention calls. Their outputs are
  merged by their log-sum-exps (:func:`merge_partial_attention`, the merge of split-KV / ring attention). On
  Hopper this runs at about 1.7-1.9x the flash kernel's rate with the lower-right mask
  (``benchmarks/results/attention_backends.json``).

"auto" picks ``cudnn_split`` on a CUDA build with cuDNN 9 for bf16 / fp16 inputs whose head dims cuDNN takes and
chunks of at least ``MIN_CUDNN_QUERIES`` queries, ``sdpa`` otherwise. cuDNN builds (and caches) one execution graph
per distinct shape and stride set: a chunk's prefix part is a new shape for every new ``start``, which a long chunk
amortises and a decode token (T = 1, the baseline transformer's decode step, one new key length per token) does
not. If cuDNN refuses a shape at run time, "auto" falls back to ``sdpa`` for those inputs' dtype and head dims for
the rest of the process and logs why; an explicit ``backend="cudnn_split"`` (or the environment override) raises
instead, and an out-of-memory error is never taken for a refusal.

Why a private op: torch's public SDPA returns no log-sum-exp, and it never sends a lower-right causal mask to
cuDNN (its cuDNN causal mask is top-left; pytorch/pytorch#193630 adds bottom-right alignment to the private cuDNN
ops). :func:`cudnn_attend` is the one place that calls ``torch.ops.aten._scaled_dot_product_cudnn_attention``, as
torch's own context-parallel attention does; ``tests/kernels/test_prefix_attention.py`` checks the split and the
merge on CPU against the masked reference, and on CUDA the cuDNN path against ``sdpa``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from hylo_bench.kernels.registry import KernelChoice, register

__all__ = ["cudnn_attend", "math_attend", "merge_partial_attention", "prefix_attention", "sdpa_prefix_attention",
           "select_prefix_attention_backend", "split_prefix_attention"]

logger = logging.getLogger(__name__)
BACKENDS = ("auto", "sdpa", "cudnn_split")
MIN_CUDNN_QUERIES = 128  # shorter chunks (decode tokens) stay on sdpa: no cuDNN graph per key length
# cuDNN's queries are padded to a multiple of this (split_prefix_attention): RULER prompts of nearby lengths
# then share one execution graph for their last chunk; at most 511 padded queries per prompt
CUDNN_QUERY_BUCKET = 512
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


def flash_gqa_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA's flash kernel takes these (GQA) inputs; without it a lower-right mask or repeated K/V heads
    are the fallbacks. q: [B, H, T, d]; k, v: [B, G, S, d]."""
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    try:
        return bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True)))
    except (TypeError, RuntimeError):  # older SDPAParams signature
        return False


def sdpa_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int,
                          pad_values: bool = True) -> torch.Tensor:
    """The chunk's attention in one SDPA call with a lower-right causal mask, GQA without repeating K/V heads
    where the kernel allows it.

    On GPU, values narrower than the query/key width are zero-padded to it (``pad_values``) for SDPA builds whose
    flash kernel needs equal widths; the padded output columns are exactly zero and dropped.

    Args:
        q: [B, H, T, d_qk]. k: [B, G, S, d_qk]. v: [B, G, S, d_V], d_V <= d_qk. G divides H.
        scale: softmax scale. start: S - T, tokens already cached (>= 0).

    Returns:
        [B, H, T, d_V].
    """
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if q.is_cuda and pad_values and d_v < d_qk:
        v = F.pad(v, (0, d_qk - d_v))
    gqa = k.shape[1] != q.shape[1]
    T, S = q.shape[-2], k.shape[-2]
    if gqa and T > 1 and q.is_cuda and not flash_gqa_supported(q, k, v):
        rep = q.shape[1] // k.shape[1]  # no flash for these inputs: repeat K/V heads (memory-efficient kernel)
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    mask = None if (start == 0 or T == 1) else causal_lower_right(T, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=start == 0 and T > 1, scale=scale,
                                         enable_gqa=gqa)
    return out[..., :d_v]


def math_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp from explicit scores (the reference for :func:`cudnn_attend`; O(T S) memory).

    Args:
        q: [B, H, T, d_qk]. k: [B, G, S, d_qk]. v: [B, G, S, d_V]. G divides H. causal: top-left causal mask
            (query t sees keys 0 .. t; used with T == S). scale: softmax scale.

    Returns:
        (out [B, H, T, d_V] in q's dtype, lse [B, H, T, 1] float32, float64 for float64 inputs).
    """
    rep = q.shape[1] // k.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v = k.repeat_interleave(rep, dim=1).to(acc), v.repeat_interleave(rep, dim=1).to(acc)
    s = (q.to(acc) @ k.transpose(-1, -2)) * scale
    if causal:
        T, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(T, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return (torch.exp(s - lse) @ v).to(q.dtype), lse


def cudnn_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN attention and its log-sum-exp (``torch.ops.aten._scaled_dot_product_cudnn_attention``; see the
    module docstring for why a private op). Shapes and result as :func:`math_attend`; CUDA bf16 / fp16 only.

    Raises:
        RuntimeError: cuDNN does not take these inputs (torch's message), or it returned no log-sum-exp of the
            expected size.
    """
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                  scale=scale)[:2]
    if lse.numel() != out[..., :1].numel():
        raise RuntimeError(f"cuDNN attention returned a log-sum-exp of shape {tuple(lse.shape)} for output "
                           f"{tuple(out.shape)}")
    return out, lse.reshape(*out.shape[:-1], 1)


def merge_partial_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                            lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from each set's normalised output and log-sum-exp:
    ``(exp(lse_a) out_a + exp(lse_b) out_b) / (exp(lse_a) + exp(lse_b))`` (the split-KV merge of flash-decoding;
    Dao et al. 2023), computed as ``lerp(out_b, out_a, sigmoid(lse_a - lse_b))`` so no exponential overflows. A
    row whose set is empty (lse = -inf) takes the other exactly.

    Args:
        out_a, out_b: [..., T, d]. lse_a, lse_b: [..., T, 1].

    Returns:
        [..., T, d] in out_a's dtype (the arithmetic in float32, float64 for float64 inputs).
    """
    acc = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    w_a = torch.sigmoid(lse_a.to(acc) - lse_b.to(acc))  # = e^lse_a / (e^lse_a + e^lse_b); 0 or 1 at -inf
    return torch.lerp(out_b.to(acc), out_a.to(acc), w_a).to(out_a.dtype)


def _pad_tokens(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` [B, heads, T, d] with zero rows appended along T up to ``n`` (a new contiguous tensor; ``x`` itself
    when T == n)."""
    if x.shape[-2] == n:
        return x
    out = x.new_zeros(*x.shape[:-2], n, x.shape[-1])
    out[..., : x.shape[-2], :] = x
    return out


def split_prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int,
                           attend: Attend = cudnn_attend, query_bucket: int = 1) -> torch.Tensor:
    """The chunk's attention as an unmasked part (the chunk over the ``start`` prefix keys) and a causal part
    (the chunk over its own T keys), merged by :func:`merge_partial_attention`; one ``attend`` call where a part
    is empty (``start == 0``, or T == 1: no mask at all).

    With ``query_bucket`` > 1 a chunk of T queries whose T is not a multiple of it is padded at its end with zero
    queries (and, in the causal part, zero keys and values) up to the next multiple, and the padding's outputs
    are dropped. The causal mask keeps every real query t from the padded keys (they sit after it), and the
    unmasked part's keys are unchanged, so the result is the unpadded one; but a stream of prompts of slightly
    different lengths (RULER's samples) gives cuDNN a handful of shapes instead of a new shape, and a new
    execution graph, per prompt.

    Args:
        q: [B, H, T, d_qk]. k: [B, G, S, d_qk]. v: [B, G, S, d_V]. G divides H. scale: softmax scale.
        start: S - T (>= 0). attend: (q, k, v, causal, scale) -> (out, lse), as :func:`cudnn_attend`.
        query_bucket: pad T up to a multiple of this (1: never pad; T == 1 is never padded).

    Returns:
        [B, H, T, d_V].

    Raises:
        ValueError: ``start`` is not S - T, or ``query_bucket`` < 1.
    """
    T, S = q.shape[-2], k.shape[-2]
    if start != S - T:
        raise ValueError(f"start={start} but the keys hold {S} tokens for a {T}-token chunk (expected {S - T})")
    if query_bucket < 1:
        raise ValueError(f"query_bucket must be >= 1, got {query_bucket}")
    if T == 1:
        return attend(q, k, v, False, scale)[0]
    padded = -(-T // query_bucket) * query_bucket
    qp = _pad_tokens(q, padded)
    # the diagonal's own keys as copies: the same shape and strides at every chunk, so cuDNN reuses one graph
    k_own, v_own = (k, v) if start == 0 else (k[:, :, start:].contiguous(), v[:, :, start:].contiguous())
    k_own, v_own = _pad_tokens(k_own, padded), _pad_tokens(v_own, padded)
    out_b, lse_b = attend(qp, k_own, v_own, True, scale)
    if start == 0:
        return out_b[..., :T, :]
    out_a, lse_a = attend(qp, k[:, :, :start], v[:, :, :start], False, scale)
    return merge_partial_attention(out_a, lse_a, out_b, lse_b)[..., :T, :]


@functools.cache
def _cudnn_ready(device: torch.device) -> str:
    """Why cuDNN attention cannot run on ``device`` ("" when it can)."""
    if device.type != "cuda":
        return f"device {device.type}"
    if torch.version.hip is not None:
        return "ROCm build"
    if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < 90000:
        return "cuDNN 9 not available"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "GPU older than sm80"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return "this torch has no cuDNN attention op"
    return ""


def select_prefix_attention_backend(device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int,
                                    queries: int = MIN_CUDNN_QUERIES) -> tuple[str, str]:
    """("sdpa" | "cudnn_split", reason) for backend="auto"; ``queries``: the chunk's T."""
    why = _cudnn_ready(device)
    if why:
        return "sdpa", why
    if queries < MIN_CUDNN_QUERIES:
        return "sdpa", f"chunk of {queries} < {MIN_CUDNN_QUERIES} queries (no cuDNN graph per key length)"
    if (dtype, d_qk, d_v) in _REFUSED:
        return "sdpa", f"cuDNN refused {dtype} d_qk={d_qk} d_v={d_v} earlier in this process"
    if dtype not in (torch.bfloat16, torch.float16):
        return "sdpa", f"{dtype} inputs"
    if d_qk > 256 or d_v > 256 or d_qk % 8 or d_v % 8:
        return "sdpa", f"head dims {d_qk}/{d_v} (cuDNN takes multiples of 8 up to 256)"
    return "cudnn_split", "cuDNN attention, prefix and diagonal merged by log-sum-exp"


CHOICE = register(KernelChoice("prefix_attention", "prefill attention backend", ("cudnn_split", "sdpa"),
                               select_prefix_attention_backend))


_REFUSED: set[tuple[torch.dtype, int, int]] = set()  # (dtype, d_qk, d_v) cuDNN raised on: "auto" skips it


def _refused(q: torch.Tensor, v: torch.Tensor, exc: RuntimeError) -> None:
    _REFUSED.add((q.dtype, q.shape[-1], v.shape[-1]))
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    logger.warning("prefill attention backend: sdpa from now on for %s d_qk=%d d_v=%d (cuDNN refused: %s)",
                   q.dtype, q.shape[-1], v.shape[-1], reason[:300])


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, start: int,
                     pad_values: bool = True, backend: str = "auto") -> torch.Tensor:
    """Causal attention of a chunk over a cached prefix plus itself (chunked prefill; module docstring).

    Args:
        q: [B, H, T, d_qk]. k: [B, G, S, d_qk]. v: [B, G, S, d_V], d_V <= d_qk. G divides H.
        scale: softmax scale (None: 1 / sqrt(d_qk), SDPA's default). start: S - T, tokens already cached (>= 0).
        pad_values: for ``sdpa`` on GPU, zero-pad V to the q/k width (:func:`sdpa_prefix_attention`).
        backend: "auto", "sdpa" or "cudnn_split".

    Returns:
        [B, H, T, d_V].

    Raises:
        ValueError: unknown backend; "cudnn_split" (explicit or the override) where cuDNN attention cannot run (the
            reason named).
        RuntimeError: "cudnn_split" asked for explicitly (or by the override) and cuDNN refused the inputs.
        torch.OutOfMemoryError: from either back end, as raised.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    explicit = backend != "auto"
    if not explicit:
        explicit = CHOICE.override() is not None  # the override is checked as an explicit request
        backend, reason = CHOICE.choose(q.device, q.dtype, q.shape[-1], v.shape[-1], q.shape[-2])
        CHOICE.log(backend, reason)
    if backend == "cudnn_split":
        why = _cudnn_ready(q.device)
        if why:
            raise ValueError(f"prefill attention backend cudnn_split cannot run here: {why}; use 'sdpa'")
        try:
            return split_prefix_attention(q, k, v, scale, start, query_bucket=CUDNN_QUERY_BUCKET)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            if explicit:
                raise
            _refused(q, v, exc)
    return sdpa_prefix_attention(q, k, v, scale, start, pad_values=pad_values)
