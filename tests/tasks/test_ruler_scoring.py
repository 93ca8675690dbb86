"""RULER scoring on hand-made predictions (ruler.md section 6)."""

from __future__ import annotations

import pytest

from hylo_bench.tasks.ruler import postprocess_pred, score_prediction, string_match_all, string_match_part, task_score
from hylo_bench.tasks.ruler.scoring import mean_score, weighted_averages


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
    with pytest.raises(ValueError, match="flavor must be one of nvidia, lm-eval"):
        string_match_part("x", golds, flavor="original")


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


def test_qa_scores_per_flavor_on_hand_made_predictions():
    golds = [["Denver Broncos", "Denver Broncos", "Broncos"], ["Norman"], ["1066", "in 1066"], ["Paris"]]
    preds = [" The Broncos.", "normans", "in 1066\nthey came", "London"]
    # nvidia: any gold -> 1, 1, 1, 0; lm-eval: fraction of golds -> 1/3, 1, 1, 0
    assert [score_prediction("ruler_qa_squad", p, g) for p, g in zip(preds, golds)] == [1.0, 1.0, 1.0, 0.0]
    lm = [score_prediction("ruler_qa_squad", p, g, flavor="lm-eval") for p, g in zip(preds, golds)]
    assert lm == [pytest.approx(1 / 3), 1.0, 1.0, 0.0]
    out = task_score("ruler_qa_squad", preds, golds, flavor="lm-eval")
    assert out["score"] == pytest.approx(100 * (1 / 3 + 2) / 4)
    assert out["score_by_flavor"] == {"nvidia": 75.0, "lm-eval": pytest.approx(100 * (1 / 3 + 2) / 4)}
    hotpot = task_score("ruler_qa_hotpot", ["yes", "no"], [["yes"], ["Yes"]])
    assert hotpot["score"] == 50.0 and hotpot["score_by_flavor"] == {"nvidia": 50.0, "lm-eval": 50.0}
    assert "score_by_flavor" not in task_score("ruler_vt", ["a"], [["a"]])


def test_weighted_averages_match_ruler_readme():
    # NVIDIA/RULER README, Llama3.1-70B: 4K..128K = 96.5 95.8 95.4 94.8 88.4 66.6 -> Avg 89.6, wAvg 85.5 / 93.7
    row = {"4096": 96.5, "8192": 95.8, "16384": 95.4, "32768": 94.8, "65536": 88.4, "131072": 66.6}
    out = weighted_averages(row)
    assert round(out["avg"], 1) == 89.6
    assert out["weighted_avg_inc"] == pytest.approx(1795.1 / 21) and round(out["weighted_avg_inc"], 1) == 85.5
    assert out["weighted_avg_dec"] == pytest.approx(1967.4 / 21) and round(out["weighted_avg_dec"], 1) == 93.7
    # ranks follow the numeric length, not the key order or string order
    two = weighted_averages({"8192": 40.0, "4096": 100.0})
    assert two == {"avg": 70.0, "weighted_avg_inc": pytest.approx(60.0), "weighted_avg_dec": pytest.approx(80.0)}
    assert weighted_averages({131072: 10.0, 65536: 40.0})["weighted_avg_inc"] == pytest.approx(20.0)
    assert weighted_averages({"4096": 55.0}) == {"avg": 55.0, "weighted_avg_inc": 55.0, "weighted_avg_dec": 55.0}
    with pytest.raises(ValueError, match="no per-length scores"):
        weighted_averages({})
