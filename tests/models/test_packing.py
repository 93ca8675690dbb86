"""Packed documents (cu_seqlens): per-document outputs equal separate runs, for the ops and the hybrid models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hylo_bench.kernels.gated_delta import chunk_gated_delta_rule_torch, gated_delta_rule_reference
from hylo_bench.kernels.ssd import ssd_scan_chunked, ssd_scan_reference
from hylo_bench.kernels.varlen import chunk_layout
from hylo_bench.models.attention import varlen_causal_attention
from hylo_bench.models.hybrid import HyLoForCausalLM
from hylo_bench.models.varlen import cu_seqlens_from_position_ids, position_ids_from_cu_seqlens, varlen_causal_conv1d
from tests.conftest import tiny_hybrid_config

LENS = [5, 11, 3]  # three documents of different lengths, packed in one row of 19 tokens
CU = torch.tensor([0, 5, 16, 19], dtype=torch.int32)


def test_position_ids_and_cu_seqlens_round_trip():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])  # row 1 starts mid-document: a new segment
    cu = cu_seqlens_from_position_ids(pos)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 8, 12]
    assert position_ids_from_cu_seqlens(cu, 2, 6).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]


def test_chunk_layout_pads_each_document_to_whole_chunks_in_lanes():
    lay = chunk_layout(CU, 19, 4)
    # docs of 5, 11, 3 tokens -> 2, 3, 1 chunks of 4, dealt longest first into ceil(6 / 3) = 2 lanes:
    # lane 0 = doc 1 (3 chunks); lane 1 = doc 0 (2) then doc 2 (1); pad slots hold 19 (one past the end)
    assert (lay.num_lanes, lay.num_chunks) == (2, 3)
    assert lay.index.tolist() == [list(range(5, 16)) + [19], [0, 1, 2, 3, 4, 19, 19, 19, 16, 17, 18, 19]]
    assert lay.starts.tolist() == [[True, False, False], [True, False, True]]
    assert lay.ends == {2: ([0, 1], [1, 2]), 1: ([1], [0])}
    assert lay.slot.tolist() == [12, 13, 14, 15, 16] + list(range(0, 11)) + [20, 21, 22]
    one = chunk_layout(CU, 19, 4, lanes=1)  # one lane: documents in packed order, 6 chunks
    assert one.num_chunks == 6 and one.starts.tolist() == [[True, False, True, False, False, True]]
    with pytest.raises(ValueError, match="strictly increasing"):
        chunk_layout(torch.tensor([0, 5, 5, 19]), 19, 4)
    with pytest.raises(ValueError, match="end at the packed length 20"):
        chunk_layout(CU, 20, 4)


@pytest.mark.parametrize("chunk", [4, 64])
def test_gated_delta_chunked_varlen_equals_per_document_recurrence(chunk):
    torch.manual_seed(0)
    T, H, HV, K, V = 19, 1, 2, 8, 6
    q, k = torch.randn(1, T, H, K, dtype=torch.float64), torch.randn(1, T, H, K, dtype=torch.float64)
    v = torch.randn(1, T, HV, V, dtype=torch.float64)
    g, beta = -torch.rand(1, T, HV, dtype=torch.float64), torch.rand(1, T, HV, dtype=torch.float64)
    h0 = torch.randn(3, HV, K, V, dtype=torch.float64)
    o, fin = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, chunk_size=chunk, cu_seqlens=CU)
    for i, (s, e) in enumerate(zip(CU[:-1].tolist(), CU[1:].tolist())):  # naive loop, one document alone
        o_i, f_i = gated_delta_rule_reference(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                              initial_state=h0[i:i + 1], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, s:e], o_i, rtol=0, atol=1e-12)
        torch.testing.assert_close(fin[i:i + 1], f_i, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_gated_delta_rule_torch(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                     g.expand(2, -1, -1), beta.expand(2, -1, -1), cu_seqlens=CU)


def test_ssd_chunked_varlen_equals_per_document_recurrence():
    torch.manual_seed(1)
    T, H, P, G, N = 19, 4, 4, 2, 5
    x, dt = torch.randn(1, T, H, P, dtype=torch.float64), torch.randn(1, T, H, dtype=torch.float64)
    A, D, bias = -torch.rand(H, dtype=torch.float64) - 0.1, torch.randn(H, dtype=torch.float64), torch.randn(H)
    B, C = torch.randn(1, T, G, N, dtype=torch.float64), torch.randn(1, T, G, N, dtype=torch.float64)
    y, fin = ssd_scan_chunked(x, dt, A, B, C, D=D, dt_bias=bias.double(), dt_softplus=True, chunk_size=4,
                              cu_seqlens=CU)
    for i, (s, e) in enumerate(zip(CU[:-1].tolist(), CU[1:].tolist())):
        y_i, f_i = ssd_scan_reference(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], D=D, dt_bias=bias.double(),
                                      dt_softplus=True)
        torch.testing.assert_close(y[:, s:e], y_i, rtol=0, atol=1e-12)
        torch.testing.assert_close(fin[i:i + 1], f_i, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cu", [CU, torch.tensor([0, 1, 2, 4, 19], dtype=torch.int32)])
def test_varlen_conv_and_attention_match_per_document_ops(cu):
    torch.manual_seed(2)
    x, w, b = torch.randn(1, 6, 19, dtype=torch.float64), torch.randn(6, 1, 4, dtype=torch.float64), torch.randn(6)
    pos = position_ids_from_cu_seqlens(cu, 1, 19)
    y = varlen_causal_conv1d(x, w, b.double(), pos)
    q, k = torch.randn(1, 2, 19, 8, dtype=torch.float64), torch.randn(1, 2, 19, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 19, 4, dtype=torch.float64)
    outs = {m: varlen_causal_attention(q, k, v, 0.3, cu, method=m) for m in ("mask", "loop")}
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = F.conv1d(F.pad(x[..., s:e], (3, 0)), w, b.double(), groups=6)
        torch.testing.assert_close(y[..., s:e], ref, rtol=0, atol=1e-12)
        att = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=0.3)
        for m, o in outs.items():
            torch.testing.assert_close(o[:, :, s:e], att, rtol=0, atol=1e-12, msg=m)


@pytest.mark.parametrize("with_bias", [True, False])
def test_varlen_conv_bf16_is_exact_to_one_rounding_after_large_documents(with_bias):
    """bf16: the tokens right after a document start (a one-token document among them) are recomputed, not the row
    conv minus the cross-document taps, whose bf16 cancellation left an error of order eps * |row conv| there."""
    torch.manual_seed(5)
    cu, C, W = torch.tensor([0, 6, 7, 9, 16], dtype=torch.int32), 8, 4
    x = torch.randn(1, C, 16, dtype=torch.float64)
    for s in cu[1:-1].tolist():  # the previous document's last W - 1 tokens are large
        x[..., max(s - (W - 1), 0):s] *= 100
    x, w, b = x.bfloat16(), torch.randn(C, 1, W).bfloat16(), torch.randn(C).bfloat16() if with_bias else None
    y = varlen_causal_conv1d(x, w, b, position_ids_from_cu_seqlens(cu, 1, 16))
    assert y.dtype == torch.bfloat16 and y.shape == (1, C, 16)
    ref = torch.cat([F.conv1d(F.pad(x.double()[..., s:e], (W - 1, 0)), w.double(), None if b is None else b.double(),
                              groups=C) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=-1)
    # one bf16 rounding of the float64 result: |err| <= 2^-8 |ref| (the subtracting version: up to 640 |ref|)
    torch.testing.assert_close(y.double(), ref, rtol=2.0 ** -8, atol=1e-5)


def _model(linear_type: str) -> HyLoForCausalLM:
    torch.manual_seed(0)
    m = HyLoForCausalLM(tiny_hybrid_config(linear_type=linear_type)).eval().double()
    with torch.no_grad():  # stronger recurrent paths, so a leak across documents shows in the logits
        for layer in (m.model.layers[0], m.model.layers[2]):
            for p in layer.mixer.parameters():
                if p.dim() >= 2:
                    p.mul_(3)
    return m


@pytest.mark.parametrize("linear_type", ["gdn", "mamba"])
def test_packed_row_gives_per_document_logits(linear_type):
    """The issue's check: a packed batch gives the same per-document logits as separate runs (float64, CPU)."""
    model = _model(linear_type)
    torch.manual_seed(3)
    docs = [torch.randint(3, 97, (n,)) for n in LENS]
    ids = torch.cat(docs)[None]
    with torch.no_grad():
        packed = model(ids, cu_seqlens=CU).logits[0]
        plain = model(ids).logits[0]  # no boundaries: later documents see earlier ones
        for d, s, e in zip(docs, CU[:-1].tolist(), CU[1:].tolist()):
            alone = model(d[None]).logits[0]
            torch.testing.assert_close(packed[s:e], alone, rtol=0, atol=1e-10)
    assert (plain[5:] - packed[5:]).abs().max() > 1e-3  # the check can fail: without cu_seqlens it differs


def test_packed_batch_of_two_rows_and_gradients():
    """Two packed rows (documents never span rows) equal per-document runs, and so do parameter gradients."""
    model = _model("gdn")
    torch.manual_seed(4)
    rows = torch.randint(3, 97, (2, 10))
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]])
    cu = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 4, 10, 17, 20]
    out = model(rows, cu_seqlens=cu).logits
    out.pow(2).sum().backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    flat = rows.flatten()
    total = 0
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = model(flat[s:e][None]).logits[0]
        torch.testing.assert_close(out.flatten(0, 1)[s:e], alone, rtol=0, atol=1e-10)
        total = total + alone.pow(2).sum()
    total.backward()
    for n, p in model.named_parameters():
        if n in g_packed:
            torch.testing.assert_close(g_packed[n], p.grad, rtol=1e-9, atol=1e-9, msg=n)
    model.zero_grad()
    model.train()
    model.model.gradient_checkpointing = True  # cu_seqlens reaches the layers through checkpoint() too
    model(rows, cu_seqlens=cu).logits.pow(2).sum().backward()
    for n, p in model.named_parameters():
        if n in g_packed:
            torch.testing.assert_close(g_packed[n], p.grad, rtol=1e-9, atol=1e-9, msg=n)


def test_packed_labels_skip_cross_document_targets_and_bad_inputs_raise():
    model = _model("gdn")
    ids = torch.randint(3, 97, (1, 19))
    out = model(ids, labels=ids, cu_seqlens=CU)
    logits, tgt = out.logits[0, :-1], ids[0, 1:].clone()
    tgt[[4, 15]] = -100  # the last token of documents 0 and 1 would predict the next document's first token
    torch.testing.assert_close(out.loss, F.cross_entropy(logits, tgt, ignore_index=-100))
    with pytest.raises(ValueError, match="row"):
        model(torch.randint(3, 97, (2, 10)), cu_seqlens=torch.tensor([0, 5, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match="use_cache"):
        model(ids, cu_seqlens=CU, use_cache=True)
    with pytest.raises(ValueError, match="padding"):
        model(ids, attention_mask=torch.tensor([[0] + [1] * 18]), cu_seqlens=CU)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


HAS_FLA = __import__("importlib").util.find_spec("fla") is not None
CU_GPU = [0, 100, 357, 358, 800, 1000]  # includes a one-token document


@pytest.mark.parametrize("linear_type", ["gdn", "mamba"])
def test_packed_row_per_document_logits_bf16_cpu(linear_type):
    """The CUDA test's bf16 check on CPU (torch kernels): packed logits against separate runs per document. With
    the subtracting varlen conv the one-token document was off by 3e-2 (gdn) / 1e-2 (mamba); now <= 2e-3."""
    model = _model(linear_type).to(torch.bfloat16)
    torch.manual_seed(2)
    cu = torch.tensor(CU_GPU, dtype=torch.int32)
    ids = torch.randint(3, 97, (1, 1000))
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu).logits[0]
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert _rel(packed[s:e], model(ids[:, s:e]).logits[0]) < 5e-3, (s, e)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_FLA, reason="needs a CUDA GPU and fla installed")
def test_fla_varlen_forward_matches_torch_varlen():
    """fla's chunk_gated_delta_rule / chunk_simple_gla with cu_seqlens against the torch per-document layout."""
    from hylo_bench.kernels.gated_delta import gated_delta_rule
    from hylo_bench.kernels.ssd import ssd_scan

    dev = torch.device("cuda")
    torch.manual_seed(0)
    cu = torch.tensor(CU_GPU, dtype=torch.int32, device=dev)
    T, H, K, V = 1000, 4, 128, 256
    q, k = torch.randn(1, T, H, K, device=dev).bfloat16(), torch.randn(1, T, H, K, device=dev).bfloat16()
    v = torch.randn(1, T, H, V, device=dev).bfloat16()
    g, beta = -torch.rand(1, T, H, device=dev) * 0.5, torch.rand(1, T, H, device=dev).bfloat16().float()
    with torch.no_grad():
        o_f, s_f = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True,
                                    backend="fla", cu_seqlens=cu)
        o_t, s_t = gated_delta_rule(q.float(), k.float(), v.float(), g, beta, use_qk_l2norm_in_kernel=True,
                                    output_final_state=True, backend="torch", cu_seqlens=cu)
    assert s_f.shape == (5, H, K, V) and _rel(o_f, o_t) < 2e-2 and _rel(s_f, s_t) < 2e-2
    x, dt = torch.randn(1, T, 8, 64, device=dev).bfloat16(), torch.rand(1, T, 8, device=dev) * 0.1
    A = -torch.rand(8, device=dev) - 0.5
    B, C = torch.randn(1, T, 2, 64, device=dev).bfloat16(), torch.randn(1, T, 2, 64, device=dev).bfloat16()
    with torch.no_grad():
        y_f, _ = ssd_scan(x, dt, A, B, C, backend="fla", cu_seqlens=cu)
        y_t, _ = ssd_scan(x.float(), dt, A, B.float(), C.float(), backend="torch", cu_seqlens=cu)
    assert _rel(y_f, y_t) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("linear_type", ["gdn", "mamba"])
def test_packed_row_per_document_logits_on_cuda(linear_type):
    """bf16 on CUDA (MLA per-document flash loop; fla GDN forward when installed) against separate runs."""
    model = _model(linear_type).to("cuda", torch.bfloat16)
    lens = [100, 257, 1, 442, 200]
    cu = torch.tensor([0, 100, 357, 358, 800, 1000], dtype=torch.int32, device="cuda")
    ids = torch.randint(3, 97, (1, sum(lens)), device="cuda")
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu).logits[0]
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert _rel(packed[s:e], model(ids[:, s:e]).logits[0]) < 2e-2
