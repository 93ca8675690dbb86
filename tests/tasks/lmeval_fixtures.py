"""Tiny local copies of the 8 short-context tasks' Hub datasets, in their column formats (eval.md §5.3).

``write_fixtures(root)`` writes ``root/<task>/<split>.jsonl``; every row's gold answer is the "forced" one a test
model can be made to prefer: in every multiple-choice row the correct choice is the only one containing
``GOLD_WORD``; GSM8K answers end in ``#### <n>``.
"""

from __future__ import annotations

import json
from pathlib import Path

GOLD_WORD = "zebra"


def _arc(i: int) -> dict:
    labels = ["A", "B", "C", "D"] if i % 2 == 0 else ["1", "2", "3", "4"]
    gold = i % 4
    texts = [f"{GOLD_WORD} stripes" if k == gold else w for k, w in enumerate(["red sky", "blue sea", "warm sand",
                                                                                 "cold rain"])]
    return {"id": f"q{i}", "question": f"Which answer is number {i}?", "choices": {"text": texts, "label": labels},
            "answerKey": labels[gold]}


def _hellaswag(i: int) -> dict:
    gold = (i + 1) % 4
    endings = [f"then a {GOLD_WORD} runs." if k == gold else e for k, e in
               enumerate(["then the man sits.", "then it rains [title] hard.", "then a dog barks.", "then all stop."])]
    return {"ind": i, "activity_label": "Running", "ctx_a": f"A person number {i} starts to run.",
            "ctx_b": "they", "ctx": f"A person number {i} starts to run. they", "endings": endings,
            "source_id": f"s{i}", "split": "val", "split_type": "indomain", "label": str(gold)}


def _openbookqa(i: int) -> dict:
    row = _arc(i)
    return {"id": row["id"], "question_stem": row["question"], "choices": row["choices"], "answerKey": row["answerKey"]}


def _piqa(i: int) -> dict:
    gold = i % 2
    sols = [f"use a {GOLD_WORD} brush" if k == gold else "use a hammer" for k in range(2)]
    return {"goal": f"How to paint fence {i}?", "sol1": sols[0], "sol2": sols[1], "label": gold}


def _race(i: int) -> dict:
    def problem(j: int) -> dict:
        gold = (i + j) % 4
        options = [f"the {GOLD_WORD}" if k == gold else o for k, o in enumerate(["the cat", "the dog", "the bird",
                                                                                  "the fish"])]
        return {"question": f"Who ran in story {i} part {j}?", "answer": "ABCD"[gold], "options": options}

    problems = [problem(0), problem(1)]
    return {"example_id": f"r{i}", "article": f"Story {i}. An animal ran far across the field.",
            "problems": repr(problems)}


def _winogrande(i: int) -> dict:
    gold = i % 2
    options = [GOLD_WORD if k == gold else "stone" for k in range(2)]
    return {"sentence": f"In scene {i} the _ ran away quickly.", "option1": options[0], "option2": options[1],
            "answer": str(gold + 1)}


def _gsm8k(i: int) -> dict:
    return {"question": f"Tom has {i} apples and buys 2 more. How many apples does he have?",
            "answer": f"Tom has {i} + 2 = <<{i}+2={i + 2}>>{i + 2} apples.\n#### {i + 2}"}


# task -> (row builder, splits written); the first split listed is the one lm-eval evaluates.
FIXTURES = {
    "arc_easy": (_arc, ["test", "train", "validation"]),
    "arc_challenge": (_arc, ["test"]),
    "hellaswag": (_hellaswag, ["validation", "train"]),
    "openbookqa": (_openbookqa, ["test"]),
    "piqa": (_piqa, ["validation"]),
    "race": (_race, ["test"]),
    "winogrande": (_winogrande, ["validation"]),
    "gsm8k": (_gsm8k, ["test", "train"]),
}


def write_fixtures(root: str | Path, num_rows: int = 4, tasks: list[str] | None = None) -> Path:
    """Write ``num_rows`` rows per split for ``tasks`` (default all 8) under ``root``; return ``root``."""
    root = Path(root)
    for task in tasks or FIXTURES:
        build, splits = FIXTURES[task]
        (root / task).mkdir(parents=True, exist_ok=True)
        for s, split in enumerate(splits):
            rows = [build(i + 100 * s) for i in range(num_rows)]
            (root / task / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root
