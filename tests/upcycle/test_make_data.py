"""make-data: long rows sized to their length with answers found in their documents, teacher-written
instruction answers, the RULER decontamination check, deterministic output, no foreign files overwritten."""

from __future__ import annotations

import copy
import json
import re

import pytest

from hylo_bench.upcycle import make_data as MD

CHATML = ("{% for m in messages %}{{ '<|bos|>' + m['role'] + '\n' + m['content'] + '<|eos|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|bos|>assistant\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_teacher(tmp_path_factory, tiny_tokenizer):
    from tests.conftest import make_base

    d = tmp_path_factory.mktemp("chat_teacher")
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHATML
    make_base("llama", vocab_size=len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d, tok


def test_long_rows_fit_their_length_and_hold_their_answers(chat_teacher):
    from hylo_bench.text.chat import render_conversation

    _, tok = chat_teacher
    passages = MD.read_passages([])
    ptoks = [len(tok(p, add_special_tokens=False).input_ids) for _, p in passages]
    for L in (512, 2048):
        for i, kind in enumerate(MD.LONG_KINDS * 2):
            row, n = MD.sized_long_row(kind, i, L, tok, passages, ptoks, seed=7)
            msgs = MD.row_messages(row)
            assert n == len(render_conversation(tok, msgs).ids)
            assert (1 - MD.LENGTH_SLACK) * L <= n <= L, (kind, L, n)
            doc = msgs[0]["content"].split("\n\nQuestion: ")[0]
            if row.kind == "multi_needle":
                codes = re.findall(r"\d{3}-\d{4}", row.answer)
                assert codes and all(f" is {c}." in doc for c in codes)
            elif row.kind == "multi_hop":
                steps = row.answer.split(". The code is ")[0].split(" -> ")
                for a, b in zip(steps, steps[1:]):
                    want = f"{a[0].upper()}{a[1:]} points to {b}." if not re.fullmatch(r"\d{3}-\d{4}", b) \
                        else f"{a[0].upper()}{a[1:]} points to the code {b}."
                    assert want in doc
            else:
                for part in re.split(r" (?=[A-Z][A-Z'\- ]+: )", row.answer):
                    word, definition = part.split(": ", 1)
                    assert f"{word}, " in doc and definition.removesuffix(" ...").split(" ")[0] in doc


def test_make_data_end_to_end(chat_teacher, tmp_path):
    import yaml

    from hylo_bench.decode.greedy import generate_batch
    from hylo_bench.tasks.ruler.cache import decontamination_samples
    from hylo_bench.upcycle.mixture import MixtureSampler, load_mixture

    d, tok = chat_teacher
    cfg = MD.MakeDataConfig(out=str(tmp_path / "data"), teacher=str(d), lengths=[384, 768], long_rows=4,
                            instruction_rows=3, max_answer_tokens=8, device="cpu", ruler_tasks=["niah_single_1"],
                            ruler_samples=2, ruler_lengths=[768])
    man = MD.make_data(cfg, ruler_samples=decontamination_samples)
    out = tmp_path / "data"
    assert man["rows"] == {"instructions": 3, "long-384": 4, "long-768": 4}
    instr = [json.loads(x) for x in (out / "instructions.jsonl").read_text().splitlines()]
    from hylo_bench.models.loading import load_model

    model, _, _ = load_model(str(d), device="cpu")
    q = instr[0]["messages"][0]["content"]
    ids = tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
              add_special_tokens=False).input_ids
    assert instr[0]["messages"][1]["content"] == generate_batch(model, tok, [ids], 8)[0].strip()
    mix = yaml.safe_load((out / "mixture.yaml").read_text())
    assert [s.get("seq_lens") for s in mix["sources"]] == [None, [384], [768]]
    assert [s["weight"] for s in mix["sources"]] == [3.0, 4.0, 4.0]  # row counts: every row drawn equally often
    sampler = MixtureSampler(load_mixture(out / "mixture.yaml"), seq_len=384)
    assert {sampler.next_document()[0] for _ in range(40)} == {0, 1}  # never the 768-token rows at 384
    rep = json.loads((out / "decontamination.json").read_text())
    assert rep["ruler_samples_checked"] == 2 and rep["num_gold_overlaps"] == 0
    # same settings, same bytes
    cfg2 = copy.deepcopy(cfg)
    cfg2.out = str(tmp_path / "again")
    MD.make_data(cfg2, ruler_samples=decontamination_samples)
    for f in ("instructions.jsonl", "long-384.jsonl", "long-768.jsonl", "mixture.yaml"):
        assert (out / f).read_bytes() == (tmp_path / "again" / f).read_bytes()


def test_long_tokens_gives_every_length_the_same_tokens(chat_teacher, tmp_path):
    """--long-tokens N: ceil(N / L) rows at each length L."""
    d, _ = chat_teacher
    assert MD.MakeDataConfig(out="x", long_tokens=4_000_000).rows_at(1024) == 3907
    assert MD.MakeDataConfig(out="x", long_tokens=4_000_000).rows_at(8192) == 489
    assert MD.MakeDataConfig(out="x", long_rows=7).rows_at(8192) == 7
    cfg = MD.MakeDataConfig(out=str(tmp_path / "a"), teacher=str(d), lengths=[384, 768], long_tokens=1536,
                            instruction_rows=1, max_answer_tokens=4, device="cpu")
    man = MD.make_data(cfg)
    assert man["rows"] == {"instructions": 1, "long-384": 4, "long-768": 2}
    with pytest.raises(ValueError, match="--long-tokens"):
        MD.make_data(MD.MakeDataConfig(out=str(tmp_path / "c"), teacher=str(d), long_tokens=-1))


def test_decontamination_finds_a_planted_ruler_gold(chat_teacher, tmp_path):
    from hylo_bench.tasks.ruler.cache import decontamination_samples, load_or_generate
    from hylo_bench.text.haystack import default_haystack_text

    _, tok = chat_teacher
    gold = load_or_generate("niah_single_1", tok, 512, 1, seed=42, haystack_text=default_haystack_text(),
                            chat_template=False, cache_dir=tmp_path / "cache")[0]["outputs"][0]
    rows = [{"messages": [{"role": "user", "content": "Question: x"}], "kind": "multi_needle", "placed": [gold]}]
    cfg = MD.MakeDataConfig(out=str(tmp_path), lengths=[512], ruler_tasks=["niah_single_1"], ruler_samples=1)
    rep = MD.ruler_decontamination(rows, cfg, tok, default_haystack_text(), tmp_path / "cache",
                                   decontamination_samples)
    assert rep["num_gold_overlaps"] == 1 and rep["gold_overlaps"][0]["golds"] == [gold]
    # a sample with several golds overlaps only when one row holds them all
    sample = load_or_generate("niah_multivalue", tok, 1024, 1, seed=42, haystack_text=default_haystack_text(),
                              chat_template=False, cache_dir=tmp_path / "cache")[0]
    golds = sample["outputs"]
    assert len(golds) > 1
    cfg = MD.MakeDataConfig(out=str(tmp_path), lengths=[1024], ruler_tasks=["niah_multivalue"], ruler_samples=1)
    split = [{"messages": rows[0]["messages"], "kind": "qa", "placed": [g]} for g in golds]
    rep = MD.ruler_decontamination(split, cfg, tok, default_haystack_text(), tmp_path / "cache",
                                   decontamination_samples)
    assert rep["num_gold_overlaps"] == 0 and rep["single_gold_hits_by_task"] == {"niah_multivalue": len(golds)}
    whole = [{"messages": rows[0]["messages"], "kind": "qa", "placed": list(golds)}]
    assert MD.ruler_decontamination(whole, cfg, tok, default_haystack_text(), tmp_path / "cache",
                                    decontamination_samples)["num_gold_overlaps"] == 1


def test_foreign_output_folder_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"holds files make-data did not write \(model\.safetensors\)"):
        MD.check_out_dir(tmp_path, overwrite=False)
    MD.check_out_dir(tmp_path, overwrite=True)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        MD.check_out_dir(f, overwrite=False)
