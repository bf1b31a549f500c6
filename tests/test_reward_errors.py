"""Reward functions that raise, return None / a string / NaN / inf: each such sample scores 0, is
counted (``reward/errors``, per role too), and more than ``max_error_fraction`` ends the run with
one RewardError line naming the role, the function and an example."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll.configs.errors import ConfigError, RewardError
from roll.configs.role import RewardConfig
from roll.core.batch import Batch
from roll.pipeline.rlvr.rewards.health import check_reward_result, reward_error_metrics
from roll.pipeline.rlvr.rewards.scoring import RewardScorer, checked_score, score_batch

OUTCOMES = {"raise": None, "none": None, "nan": float("nan"), "inf": float("inf"), "text": "0.5"}


def faulty_reward(response: str, ground_truth: str) -> object:
    if response == "raise":
        raise KeyError("no field 'answer'")
    return OUTCOMES.get(response, 1.0)


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "returned None, not a number"),
        ("0.5", "returned '0.5', not a number"),
        (float("nan"), "returned nan, not a finite number"),
        (float("inf"), "returned inf, not a finite number"),
        ([1.0], "returned a list, not a number"),
    ],
)
def test_checked_score_refuses_non_numbers(value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        checked_score(value)


def test_checked_score_accepts_numbers():
    assert [checked_score(v) for v in (1, 0.25, np.float32(0.5), torch.tensor(2.0), True)] == [
        1.0,
        0.25,
        0.5,
        2.0,
        1.0,
    ]


def test_scorer_counts_each_bad_return_as_an_error():
    scorer = RewardScorer(f"{__name__}:faulty_reward", None, timeout_s=30.0)
    try:
        result = scorer.score_detailed(["ok", "raise", "none", "nan", "inf", "text"], ["x"] * 6)
    finally:
        scorer.close()
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert result.errors[0] == "" and result.timeouts == [False] * 6
    assert result.errors[1] == "KeyError: \"no field 'answer'\""
    assert result.errors[2:] == [
        "TypeError: returned None, not a number",
        "ValueError: returned nan, not a finite number",
        "ValueError: returned inf, not a finite number",
        "TypeError: returned '0.5', not a number",
    ]
    assert scorer.stats == {"scored": 6, "timeouts": 0, "errors": 5}


def test_in_process_scoring_refuses_non_finite():
    with pytest.raises(ValueError, match="returned nan"):
        score_batch(f"{__name__}:faulty_reward", ["nan"], ["x"], None, None)


def result_batch(errors: list[str], scores: list[float] | None = None) -> Batch:
    scores = scores if scores is not None else [0.0 if e else 1.0 for e in errors]
    tensors = {
        "scores": torch.tensor(scores),
        "reward_error": torch.tensor([float(bool(e)) for e in errors]),
        "reward_timeout": torch.zeros(len(errors)),
    }
    return Batch.from_dict(tensors, {"reward_error_msg": errors})


def test_too_many_errors_end_the_run_naming_role_function_and_example():
    config = RewardConfig(reward_fn="my_pkg.rewards:score", max_error_fraction=0.5)
    check_reward_result("rewards.math", config, result_batch(["", "", "", "KeyError: x"]))
    check_reward_result("rewards.math", config, result_batch(["", "", "TypeError: a", "KeyError: b"]))
    with pytest.raises(RewardError) as err:
        check_reward_result(
            "rewards.math", config, result_batch(["", "TypeError: a", "", "KeyError: b", "E: c"])
        )
    assert str(err.value) == (
        "rewards.math: reward_fn 'my_pkg.rewards:score' failed on 3 of 5 samples "
        "(more than max_error_fraction=0.5), e.g. TypeError: a"
    )
    never = RewardConfig(reward_fn="format", max_error_fraction=1.0)
    check_reward_result("rewards.f", never, result_batch(["E: a", "E: b"]))


def test_a_non_finite_score_that_reaches_the_driver_is_an_error():
    config = RewardConfig(reward_fn="llm_judge")
    with pytest.raises(
        RewardError, match=r"^rewards\.judge: reward_fn 'llm_judge' gave 1 non-finite score\(s\), e.g. inf"
    ):
        check_reward_result("rewards.judge", config, result_batch(["", ""], scores=[1.0, float("inf")]))


def test_error_metrics_per_step_and_role():
    batch = result_batch(["", "E: a", "E: b", ""])
    batch.tensors["reward_timeout"] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    assert reward_error_metrics(batch, {"math": [0, 1], "code": [2, 3]}) == {
        "reward/errors": 2.0,
        "reward/timeouts": 1.0,
        "reward/math/errors": 1.0,
        "reward/math/timeouts": 0.0,
        "reward/code/errors": 1.0,
        "reward/code/timeouts": 1.0,
    }


def test_max_error_fraction_is_validated():
    from roll.configs.ranges import check_fields

    with pytest.raises(ConfigError, match=r"^rewards\.m\.max_error_fraction: must be in \[0, 1\], got 1.5"):
        check_fields(RewardConfig(reward_fn="math_rule", max_error_fraction=1.5), "rewards.m")
