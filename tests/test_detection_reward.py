"""The detection reward (roll/pipeline/rewards/detection.py) on hand-computed cases, and the row
context it reads passed through the scoring processes."""

from __future__ import annotations

import json

import pytest

from roll.pipeline.rewards.detection import coco_ap, detection_reward, parse_boxes
from roll.pipeline.rewards.registry import REWARD_FUNCTIONS
from roll.pipeline.rewards.scoring import RewardScorer, reward_options


def answer(*boxes: tuple[list[float], str]) -> str:
    items = [{"bbox_2d": b, "label": label} for b, label in boxes]
    return f"<answer>{json.dumps(items)}</answer>"


def only(key: str, **extra) -> dict:
    """det_reward_ratio weighing one score."""
    return (
        {"iou_max_iou_first": 0, "iou_max_label_first": 0, "map": 0, "map50": 0, "map75": 0}
        | {key: 1}
        | extra
    )


def test_exact_boxes_score_one():
    gt = answer(([10, 10, 50, 50], "cat"), ([60, 60, 90, 90], "dog"))
    assert detection_reward(gt, gt) == pytest.approx(1.0)


def test_iou_half_scores_only_at_the_lowest_threshold():
    gt, pred = answer(([0, 0, 10, 20], "cat")), answer(([0, 0, 10, 10], "cat"))  # IoU 100 / 200
    kw = {"format_ratio": 0.0}
    assert (
        detection_reward(pred, gt, iou_threshold=0.5, det_reward_ratio=only("iou_max_iou_first"), **kw) == 0.5
    )
    assert (
        detection_reward(pred, gt, iou_threshold=0.55, det_reward_ratio=only("iou_max_iou_first"), **kw) == 0
    )
    average = detection_reward(pred, gt, det_reward_ratio=only("iou_max_label_first"), **kw)
    assert average == pytest.approx(0.5 / 11)
    assert coco_ap(parse_boxes(pred[8:-9]), parse_boxes(gt[8:-9])) == pytest.approx(
        {"map": 0.1, "map50": 1.0, "map75": 0.0}
    )


def test_extra_box_costs_the_size_penalty_and_completeness():
    gt = answer(([0, 0, 10, 10], "cat"))
    pred = answer(([0, 0, 10, 10], "cat"), ([50, 50, 60, 60], "cat"))
    kw = {"format_ratio": 0.0}
    assert detection_reward(pred, gt, det_reward_ratio=only("iou_max_iou_first"), **kw) == pytest.approx(0.6)
    # completeness 1 - (0 misses + 1/2 false alarms) / 2 = 0.75, weighted 1/2 with the IoU 1
    ratio = only("iou_max_iou_first", iou_completeness=0.5)
    assert detection_reward(pred, gt, det_reward_ratio=ratio, **kw) == pytest.approx(0.6 * 0.875)


def test_map_of_a_false_positive_before_a_hit():
    gt = answer(([0, 0, 10, 10], "cat"), ([20, 20, 30, 30], "cat"))
    pred = answer(([100, 100, 110, 110], "cat"), ([20, 20, 30, 30], "cat"))
    # precision 1/2 up to recall 1/2 (51 of 101 recall points), 0 beyond, at every IoU threshold
    ap = coco_ap(parse_boxes(pred[8:-9]), parse_boxes(gt[8:-9]))
    assert ap == pytest.approx({"map": 25.5 / 101, "map50": 25.5 / 101, "map75": 25.5 / 101})


def test_wrong_label_matches_iou_first_at_zero_and_label_first_not_at_all():
    gt, pred = answer(([0, 0, 10, 10], "cat")), answer(([0, 0, 10, 10], "dog"))
    for key in ("iou_max_iou_first", "iou_max_label_first", "map"):
        assert detection_reward(pred, gt, det_reward_ratio=only(key), format_ratio=0.0) == 0.0


def test_normalized_predictions_use_the_row_image_size():
    gt = answer(([100, 100, 500, 500], "cat"))  # [0, 1000] coordinates
    pred = answer(([20, 10, 100, 50], "cat"))  # pixels of a 200 x 100 image
    context = {"verifier_parm": {"det_verifier_normalized": True}, "image_sizes": [[200, 100]]}
    assert detection_reward(pred, gt, context=context) == pytest.approx(1.0)
    assert detection_reward(pred, gt) < 0.1  # not normalized: wrong place
    with pytest.raises(ValueError, match="image size"):
        detection_reward(pred, gt, det_verifier_normalized=True)


def test_format_and_ratios():
    gt = answer(([0, 0, 10, 10], "cat"))
    assert detection_reward("no answer here", gt) == 0.0
    twice = gt + gt  # two answers: boxes scored, format 0
    assert detection_reward(twice, gt) == pytest.approx(1.0 / 1.1)
    row = {"format_ratio": 1.0, "accuracy_ratio": 1.0, "verifier_parm": {"det_reward_ratio": only("map")}}
    assert detection_reward(twice, gt, context=row) == pytest.approx(0.5)
    nulls = {
        "format_ratio": None,
        "verifier_parm": {"det_verifier_normalized": None, "det_reward_ratio": {"map": None}},
    }
    assert detection_reward(gt, gt, context=nulls) == pytest.approx(1.0)  # ROLL's math rows: nulls


def test_lenient_parsing():
    assert parse_boxes("[{'bbox_2d': [1, 2, 3, 4], 'label': 'Cat'}, {'bbox_2d': [5, 6") == [
        ((1, 2, 3, 4), "cat")
    ]
    assert parse_boxes('[{"bbox_2d": [3, 2, 1, 4], "label": "x"}, {"bbox_2d": [1, 2], "label": "x"}]') == []
    dup = '[{"bbox_2d": [1, 2, 3, 4], "label": "a"}, {"bbox_2d": [1, 2, 3, 4], "label": "b"}]'
    assert parse_boxes(dup) == [((1, 2, 3, 4), "a")]


def test_ground_truth_without_boxes_is_an_error():
    with pytest.raises(ValueError, match="no boxes"):
        detection_reward(answer(([0, 0, 1, 1], "a")), "<answer>[]</answer>")
    with pytest.raises(ValueError, match="iou_threshold"):
        detection_reward("", answer(([0, 0, 1, 1], "a")), iou_threshold="dynamic")


def test_registered_and_context_is_not_an_option():
    assert REWARD_FUNCTIONS["detection"].target.endswith("detection:detection_reward")
    options = reward_options("detection")
    assert "context" not in options and "det_reward_ratio" in options


def test_scorer_passes_row_context_only_to_functions_that_take_it():
    gt = answer(([100, 100, 500, 500], "cat"))
    pred = answer(([20, 10, 100, 50], "cat"))
    context = {"verifier_parm": {"det_verifier_normalized": True}, "image_sizes": [[200, 100]]}
    scorer = RewardScorer("detection", {}, timeout_s=30)
    try:
        result = scorer.score_detailed([pred, pred], [gt, gt], contexts=[context, None])
        assert result.scores[0] == pytest.approx(1.0) and result.scores[1] < 0.1 and not any(result.errors)
    finally:
        scorer.close()
    math = RewardScorer("math_rule", {}, timeout_s=30)
    try:  # a math row of a vision-language file carries a context math_rule does not take
        result = math.score_detailed(["\\boxed{4}"], ["4"], contexts=[context])
        assert result.scores == [1.0] and not any(result.errors)
    finally:
        math.close()
