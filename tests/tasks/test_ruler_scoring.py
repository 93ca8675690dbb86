"""RULER scoring on hand-made predictions (ruler.md section 6)."""

from __future__ import annotations

import pytest

from hylo_bench.tasks.ruler import postprocess_pred, score_prediction, string_match_all, string_match_part, task_score
from hylo_bench.tasks.ruler.scoring import mean_score


def test_postprocess_strips_and_replaces_control_chars():
    assert postprocess_pred("  \n 1234567\x00and\t7654321 \r\n") == "1234567\nand\n7654321"
    assert postprocess_pred(" \x01\x1f ") == ""
    assert postprocess_pred("no change") == "no change"


def test_string_match_all_partial_credit_case_insensitive():
    golds = ["AAAAA", "BBBBB", "CCCCC", "DDDDD"]
    assert string_match_all("aaaaa bbbbb ccccc ddddd", golds) == 1.0
    assert string_match_all("AAAAA, BBBBB and CCCCC", golds) == 0.75
    assert string_match_all("nothing", golds) == 0.0
    assert string_match_all("", ["x"]) == 0.0


def test_string_match_part_any_match_vs_lm_eval_fraction():
    golds = ["Denver Broncos", "Broncos"]
    assert string_match_part("the Broncos", golds) == 1.0
    assert string_match_part("the Broncos", golds, flavor="lm-eval") == 0.5
    assert string_match_part("the Bears", golds) == 0.0
    with pytest.raises(ValueError, match="flavor must be one of"):
        string_match_part("x", golds, flavor="nvidia")


def test_score_prediction_post_processes_first():
    assert score_prediction("niah_single_1", "\x00 1234567.\n", ["1234567"]) == 1.0
    pred = " 1111111, 2222222, 3333333"
    assert score_prediction("niah_multivalue", pred, ["1111111", "2222222", "3333333", "111"]) == 1.0
    assert score_prediction("niah_multivalue", pred, ["1111111", "2222222", "3333333", "9"]) == 0.75
    with pytest.raises(ValueError, match="unknown RULER task"):
        score_prediction("ruler_qa", "x", ["x"])


def test_task_score_is_100x_mean_and_counts_nulls():
    golds = [["a1", "b2", "c3", "d4"], ["e5"], ["f6"], ["g7", "h8"]]
    preds = ["A1 B2 C3", "e5", "", "  \n"]
    out = task_score("ruler_vt", preds, golds)
    assert out == {"score": pytest.approx(100 * (0.75 + 1 + 0 + 0) / 4), "n": 4, "nulls": 2}
    oracle = task_score("ruler_cwe", [" ".join(g) for g in golds], golds)
    assert oracle["score"] == 100.0 and oracle["nulls"] == 0
    empty = task_score("ruler_cwe", [""] * 4, golds)
    assert empty == {"score": 0.0, "n": 4, "nulls": 4}
    with pytest.raises(ValueError, match="equal, non-zero"):
        task_score("ruler_vt", ["x"], golds)


def test_mean_score_is_unweighted():
    assert mean_score([100.0, 50.0, 0.0]) == 50.0
    with pytest.raises(ValueError):
        mean_score([])
