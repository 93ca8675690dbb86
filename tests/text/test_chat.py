"""Conversational rows: row shapes, rendering equal to apply_chat_template, the assistant mask, packing, the KL mask."""

from __future__ import annotations

import json

import pytest
import torch

from hylo_bench.text.chat import conversation_from_row, render_conversation

CHATML = ("{% for m in messages %}{{ '<|bos|>' + m['role'] + '\n' + m['content'] + '<|eos|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|bos|>assistant\n' }}{% endif %}")
# the same template with transformers' {% generation %} markers around what an assistant turn writes
CHATML_GEN = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|bos|>assistant\n' }}{% generation %}"
              "{{ m['content'] + '<|eos|>\n' }}{% endgeneration %}{% else %}"
              "{{ '<|bos|>' + m['role'] + '\n' + m['content'] + '<|eos|>\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|bos|>assistant\n' }}{% endif %}")
CONV = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a bore?"},
        {"role": "assistant", "content": "A person who talks when you wish him to listen."},
        {"role": "user", "content": "And a cynic?"}, {"role": "assistant", "content": "A blackguard."}]


@pytest.fixture(scope="module")
def chat_tok(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHATML
    return tok


def _ids(enc):
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def test_render_equals_apply_chat_template_and_mask_equals_generation_blocks(chat_tok):
    r = render_conversation(chat_tok, CONV)
    assert r.text == chat_tok.apply_chat_template(CONV, tokenize=False)
    assert r.ids == _ids(chat_tok.apply_chat_template(CONV, tokenize=True))
    ref = chat_tok.apply_chat_template(CONV, tokenize=True, chat_template=CHATML_GEN, return_dict=True,
                                       return_assistant_tokens_mask=True)
    assert _ids(ref) == r.ids  # the two templates render the same text
    assert [bool(m) for m in ref["assistant_masks"]] == r.assistant_mask
    masked = chat_tok.decode([t for t, m in zip(r.ids, r.assistant_mask) if m])
    assert masked == "A person who talks when you wish him to listen.<|eos|>\nA blackguard.<|eos|>\n"


def test_row_shapes_give_one_conversation():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert conversation_from_row({"messages": msgs}, "x") == msgs
    assert conversation_from_row({"conversations": [{"from": "human", "value": "Q"},
                                                    {"from": "gpt", "value": "A"}]}, "x") == msgs
    assert conversation_from_row({"prompt": "Q", "response": "A"}, "x") == msgs
    assert conversation_from_row({"instruction": "Q", "output": "A", "system": "S"}, "x") == \
        [{"role": "system", "content": "S"}] + msgs
    assert conversation_from_row({"text": "plain"}, "x") is None
    with pytest.raises(ValueError, match=r"f\.jsonl:3: conversations\[1\] has role 'narrator'"):
        conversation_from_row({"conversations": [{"from": "human", "value": "Q"},
                                                 {"from": "narrator", "value": "A"}]}, "f.jsonl:3")
    with pytest.raises(ValueError, match=r"f\.jsonl:4: messages\[0\] must be an object with 'role' and 'content'"):
        conversation_from_row({"messages": [{"role": "user"}]}, "f.jsonl:4")


def test_no_chat_template_is_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match="needs a chat template, and the tokenizer has none"):
        render_conversation(tiny_tokenizer, CONV, where="d.jsonl:1")


def test_jsonl_rows_packed_with_boundaries_and_mask(chat_tok, tmp_path):
    from hylo_bench.upcycle.data import text_rows
    from hylo_bench.upcycle.documents import load_documents_with_ids

    f = tmp_path / "mix.jsonl"
    rows = [{"messages": CONV[1:3]}, {"text": "Plain prose with no speaker at all."},
            {"conversations": [{"from": "human", "value": "Define war."}, {"from": "gpt", "value": "A by-product."}]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = load_documents_with_ids(f)
    assert [i for i, _ in docs] == ["mix.jsonl:1", "mix.jsonl:2", "mix.jsonl:3"]
    assert isinstance(docs[1][1], str) and docs[2][1][1] == {"role": "assistant", "content": "A by-product."}
    r0 = render_conversation(chat_tok, docs[0][1])
    text_ids = chat_tok(docs[1][1], add_special_tokens=False).input_ids + [chat_tok.eos_token_id]
    r2 = render_conversation(chat_tok, docs[2][1])
    stream = r0.ids + text_ids + r2.ids
    mask = r0.assistant_mask + [False] * len(text_ids) + r2.assistant_mask
    T = 16
    packed = text_rows([d for _, d in docs], chat_tok, T)
    n = len(stream) // T
    assert torch.equal(packed.input_ids.flatten(), torch.tensor(stream[:n * T]))
    assert packed.assistant_mask.flatten().tolist() == mask[:n * T]
    # positions restart at each document start and at each row start
    starts = {0, len(r0.ids), len(r0.ids) + len(text_ids)}
    expect, p = [], 0
    for i in range(n * T):
        p = 0 if i in starts or i % T == 0 else p + 1
        expect.append(p)
    assert packed.position_ids.flatten().tolist() == expect
    km = packed.kl_mask("assistant")
    flat_m, flat_p = packed.assistant_mask.flatten().tolist(), packed.position_ids.flatten().tolist()
    for i in range(n * T):
        want = (i % T != T - 1) and flat_m[i + 1] and flat_p[i + 1] != 0 if i + 1 < n * T else False
        assert km.flatten()[i].item() == want
    assert packed.kl_mask("all") is None
    with pytest.raises(ValueError, match="--kl-tokens 'some'"):
        packed.kl_mask("some")
    plain = text_rows(["only text here " * 10], chat_tok, 8)
    with pytest.raises(ValueError, match="--kl-tokens assistant: the data has no conversations"):
        plain.kl_mask("assistant")


def test_bad_jsonl_row_names_file_and_line(tmp_path):
    from hylo_bench.upcycle.documents import load_documents_with_ids

    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"question": "no known field"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object with a 'text' field, or 'messages'"
                                         r".*found \['question'\]"):
        load_documents_with_ids(f)


def test_kd_loss_with_a_mask_is_the_mean_kl_over_the_masked_positions():
    from hylo_bench.upcycle.train.losses import kd_loss
    from tests.conftest import make_base

    torch.manual_seed(0)
    teacher, student = make_base(vocab_size=50, seed=1).double(), make_base(vocab_size=50, seed=2).double()
    x = torch.randint(0, 50, (2, 12))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 3:7] = True
    mask[1, 9] = True
    loss, _ = kd_loss(student, teacher, x, kl_mask=mask)
    with torch.no_grad():
        zs, zt = student(x).logits, teacher(x).logits
    p_t = zt.log_softmax(-1)
    rows = (p_t.exp() * (p_t - zs.log_softmax(-1))).sum(-1)  # per-position KL, float64
    assert loss.item() == pytest.approx(rows[mask].mean().item(), rel=1e-10)
    full, _ = kd_loss(student, teacher, x)
    assert full.item() == pytest.approx(rows.mean().item(), rel=1e-10)
