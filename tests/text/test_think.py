"""strip_think / ThinkStripper on hand-written model outputs, and the RULER scorer's strip_think path."""

from __future__ import annotations

import random

import pytest

from hylo_bench.tasks.ruler import score_prediction, task_score
from hylo_bench.text.think import ThinkStripper, strip_think

CASES = [
    ("<think>\n\n</think>\n\nParis", "Paris"),  # Qwen3 non-thinking prefix
    ("<think>\nThe capital of France... is Paris.\n</think>\n\nThe answer is Paris.", "The answer is Paris."),
    ("A <think>x</think> B", "A B"),
    ("one<think>a</think>two<think>b</think>\tthree", "onetwothree"),
    ("Paris <think>but maybe", "Paris "),  # unterminated: cut to the end
    ("<think>never closed", ""),
    ("<think>a<think>b</think> c", "c"),  # a span ends at the first </think>
    ("no tags at all\n", "no tags at all\n"),
    ("x < y and <thin k> stays", "x < y and <thin k> stays"),
    ("", ""),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_strip_think_exact(text, expected):
    assert strip_think(text) == expected


def test_stray_close_tag_drops_everything_before_it():
    # the chat template opened the span: the model's output starts inside it
    assert strip_think("reasoning here</think>\n\nParis") == "Paris"
    assert strip_think("r</think>A<think>b</think>C") == "AC"


def _stream(text: str, sizes: list[int], start_inside: bool = False) -> str:
    st, out, i = ThinkStripper(start_inside), [], 0
    for n in sizes:
        out.append(st.feed(text[i:i + n]))
        i += n
    out.append(st.feed(text[i:]))
    return "".join(out) + st.flush()


@pytest.mark.parametrize("text, expected", CASES)
def test_streaming_equals_whole_string_for_any_split(text, expected):
    rng = random.Random(0)
    assert _stream(text, [1] * len(text)) == expected
    for _ in range(20):
        assert _stream(text, [rng.randint(0, 4) for _ in range(len(text))]) == expected


def test_streaming_holds_back_only_possible_tags():
    st = ThinkStripper()
    assert st.feed("Paris <thi") == "Paris "
    assert st.feed("s is not a tag") == "<this is not a tag"
    assert st.feed(" <") == " "
    assert st.flush() == "<"


def test_streaming_started_inside_a_span():
    assert _stream("reasoning</think>\n\nParis", [3] * 9, start_inside=True) == "Paris"
    assert _stream("still thinking", [2] * 7, start_inside=True) == ""
    # without start_inside a stray close tag is dropped alone (text before it was already printed)
    assert _stream("early</think> late", [4] * 5) == "earlylate"


def test_ruler_scoring_strips_think_only_when_asked():
    pred = "<think>the number might be 1234567</think>\n\nThe special magic number is 7654321."
    assert score_prediction("niah_single_1", pred, ["1234567"]) == 1.0  # default unchanged: sees the think span
    assert score_prediction("niah_single_1", pred, ["1234567"], strip_think=True) == 0.0
    assert score_prediction("niah_single_1", pred, ["7654321"], strip_think=True) == 1.0
    agg = task_score("niah_single_1", [pred, "<think>\n\n</think>\n\n"], [["7654321"], ["7654321"]],
                     strip_think=True)
    assert agg == {"score": 50.0, "n": 2, "nulls": 1}
    assert task_score("niah_single_1", [pred, "<think>\n\n</think>\n\n"], [["7654321"], ["7654321"]])["nulls"] == 0
