"""Packing with document boundaries: the packer, the data path, the teacher and the ILD / KD losses on packed rows."""

from __future__ import annotations

import pytest
import torch

from hylo_bench.config.mixture import parse_mixture
from hylo_bench.config.student import hybrid_config_for
from hylo_bench.models.varlen import cu_seqlens_from_position_ids
from hylo_bench.upcycle.data import build_rows, build_windows, text_rows
from hylo_bench.upcycle.mixture import MixtureSampler, mixture_rows, mixture_windows
from hylo_bench.upcycle.packing import pack_documents, positions_from_starts
from hylo_bench.upcycle.train.losses import ild_loss, kd_loss, teacher_layer_io
from hylo_bench.upcycle.transfer import init_student
from tests.conftest import make_base

EOS = 1


def test_pack_documents_rows_positions_and_split_record():
    docs = [[5] * 3, [6] * 12, [7] * 2, [8] * 9]  # + EOS each: 4 + 13 + 3 + 10 = 30 tokens = 5 rows of 6
    rows = pack_documents(iter(docs), 6, eos_id=EOS)
    assert rows.input_ids.tolist() == [[5, 5, 5, 1, 6, 6], [6] * 6, [6, 6, 6, 6, 1, 7], [7, 1, 8, 8, 8, 8],
                                       [8, 8, 8, 8, 8, 1]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 0],
                                          [0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    # document 1 (longer than a row) is in three pieces; 2 and 3 are cut by row ends
    assert rows.splits == [{"doc": 1, "pieces": [[0, 4, 2], [1, 0, 6], [2, 0, 5]]},
                           {"doc": 2, "pieces": [[2, 5, 1], [3, 0, 2]]}, {"doc": 3, "pieces": [[3, 2, 4], [4, 0, 6]]}]
    assert rows.dropped is None and rows.summary()["split_documents"] == 3
    again = pack_documents(docs, 6, eos_id=EOS)
    assert torch.equal(again.input_ids, rows.input_ids) and torch.equal(again.position_ids, rows.position_ids)
    cut = pack_documents(docs, 6, eos_id=EOS, num_rows=3)  # document 2 loses 2 of its 3 tokens
    assert cut.dropped == {"doc": 2, "tokens": 2} and len(cut.splits) == 1 and cut.num_docs == 3
    tail = pack_documents(docs[:2], 6, eos_id=EOS)  # 17 tokens: 2 rows, 5 tokens of document 1 dropped
    assert tail.dropped == {"doc": 1, "tokens": 5} and tail.splits == [{"doc": 1, "pieces": [[0, 4, 2], [1, 0, 6]]}]
    with pytest.raises(ValueError, match="5 rows of 6 tokens; 6 were asked"):
        pack_documents(docs, 6, eos_id=EOS, num_rows=6)


def test_positions_from_starts():
    starts = torch.tensor([[False, False, True, False, True], [True, True, False, False, False]])
    assert positions_from_starts(starts).tolist() == [[0, 1, 0, 1, 0], [0, 0, 1, 2, 3]]


def test_data_rows_are_the_same_windows_with_document_positions(tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    docs = ["A dog is a kind of animal.", "Peace: in international affairs, a period of cheating.",
            "Ocean, n. A body of water occupying about two-thirds of a world made for man."] * 3
    rows = text_rows(docs, tok, 24)
    ids, pos = rows.input_ids.flatten(), rows.position_ids.flatten()
    after_eos = torch.cat([torch.tensor([True]), ids[:-1] == EOS])
    row_start = torch.arange(len(ids)) % 24 == 0
    assert torch.equal(pos == 0, after_eos | row_start)  # a document (piece) starts after each EOS and per row
    demo = build_rows("demo", tok, 64, 6, seed=1)
    assert torch.equal(demo.input_ids, build_windows("demo", tok, 64, 6, seed=1))
    # retrieval rows (BOS ... EOS + filler): position 0 at the row start and right after every EOS
    flat_ids, flat_pos = demo.input_ids, demo.position_ids
    assert (flat_pos[:, 0] == 0).all()
    assert (flat_pos[:, 1:][flat_ids[:, :-1] == EOS] == 0).all()
    (tmp_path / "a.txt").write_text("\n\n".join(docs))
    mix = parse_mixture({"seed": 3, "sources": [{"name": "a", "path": "a.txt", "weight": 1.0}]})
    mix.docs = [[(f"a#{k}", d) for k, d in enumerate(docs)]]
    r, drawn = mixture_rows(MixtureSampler(mix), tok, 16, 5)
    w, drawn2 = mixture_windows(MixtureSampler(mix), tok, 16, 5)
    assert torch.equal(r.input_ids, w) and drawn == drawn2 and r.position_ids.shape == (5, 16)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_teacher_with_packed_position_ids_gives_per_document_logits(kind):
    """transformers builds the block-diagonal causal mask from position_ids that restart per document, provided no
    cache is passed (use_cache=False, as the losses call it; with a cache it silently attends across documents)."""
    base = make_base(kind, vocab_size=200).double()
    lens = [5, 11, 3]
    ids = torch.randint(3, 200, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = base(ids, position_ids=pos, use_cache=False).logits[0]
        s = 0
        for n in lens:
            torch.testing.assert_close(packed[s:s + n], base(ids[:, s:s + n]).logits[0], rtol=0, atol=1e-10)
            s += n
        ins, _, _ = teacher_layer_io(base, ids, pos)
        plain, _, _ = teacher_layer_io(base, ids)
    assert (ins[2][0, 5:] - plain[2][0, 5:]).abs().max() > 1e-3  # without the positions documents leak


def _pair(linear_type: str = "gdn"):
    base = make_base("llama", vocab_size=200).requires_grad_(False).double()
    student = init_student(base, hybrid_config_for(base.config, [1, 3], linear_type, kv_lora_rank=64,
                                                   q_lora_rank=64)).double()
    return base, student


@pytest.mark.parametrize("linear_type", ["gdn", "mamba"])
def test_kd_and_ild_losses_on_packed_rows_are_token_weighted_document_means(linear_type):
    base, student = _pair(linear_type)
    torch.manual_seed(5)
    lens = [[4, 8], [7, 5]]  # two rows of 12 tokens, four documents
    ids = torch.randint(3, 200, (2, 12))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
    with_ild = linear_type == "gdn"  # ILD runs the same packed layers; once is enough
    kd, _ = kd_loss(student, base, ids, chunk_size=7, position_ids=pos)
    if with_ild:
        ild, logs = ild_loss(student, base, ids, position_ids=pos)
    kd_ref = ild_ref = hid_ref = 0.0
    cu = cu_seqlens_from_position_ids(pos).tolist()
    assert cu == [0, 4, 12, 19, 24]
    flat = ids.flatten()
    for s, e in zip(cu[:-1], cu[1:]):
        doc = flat[s:e][None]
        kd_ref += kd_loss(student, base, doc)[0] * (e - s) / 24
        if with_ild:
            loss, lg = ild_loss(student, base, doc)
            ild_ref += loss * (e - s) / 24
            hid_ref += lg["ild_hidden"] * (e - s) / 24
    torch.testing.assert_close(kd, kd_ref, rtol=1e-10, atol=0)
    if with_ild:
        torch.testing.assert_close(ild, ild_ref, rtol=1e-10, atol=0)
        assert logs["ild_hidden"] == pytest.approx(hid_ref, rel=1e-10)
    plain, _ = kd_loss(student, base, ids, chunk_size=7)
    assert abs(plain.item() - kd.item()) > 1e-4  # boundaries change the loss: the check can fail
