"""Reward functions that raise, return None / a string / NaN / inf / 1e30, or hang: each such sample
scores 0, is counted (``reward/errors``, ``reward/timeouts``, ``reward/failures``, per role too) and
warned about once per call, and more than ``max_error_fraction`` (default 1%) ends the run with one
RewardError line naming the role, the function and an example; a hanging function stops the call
after one ``timeout_s``."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from roll.configs.errors import ConfigError
from roll.configs.role import RewardConfig
from roll.core.batch import Batch
from roll.core.errors import RewardError
from roll.pipeline.rewards.health import check_reward_result, reward_error_metrics
from roll.pipeline.rewards.scoring import RewardScorer, allowed_failures, checked_score, score_batch
from roll.pipeline.workers.reward_worker import RewardWorker

OUTCOMES = {
    "raise": None,
    "none": None,
    "nan": float("nan"),
    "inf": float("inf"),
    "text": "0.5",
    "huge": 1e30,
}


def faulty_reward(response: str, ground_truth: str) -> object:
    if response == "raise":
        raise KeyError("no field 'answer'")
    if response == "hang":
        time.sleep(3600)
    return OUTCOMES.get(response, 1.0)


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "returned None, not a number"),
        ("0.5", "returned '0.5', not a number"),
        (float("nan"), "returned nan, not a finite number"),
        (float("inf"), "returned inf, not a finite number"),
        ([1.0], "returned a list, not a number"),
        (1e30, "returned 1e\\+30, beyond max_abs_reward=1e\\+06"),
        (-2e6, "returned -2e\\+06, beyond max_abs_reward=1e\\+06"),
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
        result = scorer.score_detailed(["ok", "raise", "none", "nan", "inf", "text", "huge"], ["x"] * 7)
    finally:
        scorer.close()
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert result.errors[0] == "" and result.timeouts == [False] * 7
    assert result.errors[1] == "KeyError: \"no field 'answer'\""
    assert result.errors[2:] == [
        "TypeError: returned None, not a number",
        "ValueError: returned nan, not a finite number",
        "ValueError: returned inf, not a finite number",
        "TypeError: returned '0.5', not a number",
        "ValueError: returned 1e+30, beyond max_abs_reward=1e+06",
    ]
    assert scorer.stats == {"scored": 7, "timeouts": 0, "errors": 6}


def test_the_magnitude_bound_is_the_roles():
    scorer = RewardScorer(f"{__name__}:faulty_reward", None, timeout_s=30.0, max_abs_reward=1e31)
    try:
        assert scorer.score_detailed(["huge"], ["x"]).scores == [1e30]
    finally:
        scorer.close()


@pytest.mark.timeout(60)
def test_a_hanging_reward_stops_the_call_after_one_timeout_not_one_per_sample():
    """64 samples of a function that never returns, timeout_s 0.5: before, each sample waited its
    own timeout (32 s here, ~11 minutes at the default 5 s with 128 samples); with the 1% default
    no failure is allowed in 64 samples, so the first timeout ends the call."""
    scorer = RewardScorer(f"{__name__}:faulty_reward", None, timeout_s=0.5, num_procs=2)
    try:
        started = time.monotonic()
        result = scorer.score_detailed(["hang"] * 64, ["x"] * 64, max_failures=allowed_failures(0.01, 64))
        took = time.monotonic() - started
        assert took < 5, f"{took:.1f} s"
        assert sum(result.timeouts) == 2 and sum(result.skipped) == 62  # the two running, then none
        assert not any(t and s for t, s in zip(result.timeouts, result.skipped))
        assert [w is None for w in scorer.workers] == [True, True]  # killed, restarted when needed
        assert scorer.score_detailed(["ok"], ["x"]).scores == [1.0]
        assert scorer.stats["timeouts"] == 2
    finally:
        scorer.close()


def test_scoring_goes_on_while_the_failures_stay_within_the_allowance():
    scorer = RewardScorer(f"{__name__}:faulty_reward", None, timeout_s=30.0)
    try:
        result = scorer.score_detailed(["raise", "ok", "raise", "ok"], ["x"] * 4, max_failures=2)
        assert result.scores == [0.0, 1.0, 0.0, 1.0] and not any(result.skipped)
        stopped = scorer.score_detailed(["raise", "raise", "ok", "ok"], ["x"] * 4, max_failures=1)
        assert stopped.skipped == [False, False, True, True]
    finally:
        scorer.close()


@pytest.mark.parametrize(
    "fraction, n, allowed", [(0.01, 64, 0), (0.01, 100, 1), (0.29, 100, 29), (1.0, 8, 8)]
)
def test_allowed_failures(fraction, n, allowed):
    assert allowed_failures(fraction, n) == allowed


def test_the_reward_worker_counts_a_timeout_as_a_failure_and_stops_for_the_whole_call():
    """The worker scores one shard; the allowance is over the role's whole call (meta)."""
    worker = RewardWorker.__new__(RewardWorker)
    worker.role_config = RewardConfig(reward_fn=f"{__name__}:faulty_reward", timeout_s=0.5)
    worker.spec = type("Spec", (), {"kind": "rule"})()
    worker.scorer = RewardScorer(f"{__name__}:faulty_reward", None, timeout_s=0.5)
    batch = Batch.from_dict(
        {}, {"response_text": ["ok", "hang", "ok", "ok"], "ground_truth": ["x"] * 4}, {"reward_samples": 64}
    )
    try:
        out = RewardWorker.compute_rewards(worker, batch)
    finally:
        worker.scorer.close()
    assert out["reward_timeout"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert out["reward_skipped"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert list(out["reward_error_msg"])[1] == "TimeoutError: no score within timeout_s=0.5 s"
    with pytest.raises(RewardError, match=r"failed on 1 of 4 samples \(more than max_error_fraction=0.01; "):
        check_reward_result("rewards.math", worker.role_config, out)


def test_in_process_scoring_refuses_non_finite():
    with pytest.raises(ValueError, match="returned nan"):
        score_batch(f"{__name__}:faulty_reward", ["nan"], ["x"], None, None)


def result_batch(errors: list[str], scores: list[float] | None = None, timeouts: list[int] = ()) -> Batch:
    scores = scores if scores is not None else [0.0 if e else 1.0 for e in errors]
    tensors = {
        "scores": torch.tensor(scores),
        "reward_error": torch.tensor([float(bool(e) and i not in timeouts) for i, e in enumerate(errors)]),
        "reward_timeout": torch.tensor([float(i in timeouts) for i in range(len(errors))]),
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


def test_the_default_stops_past_one_percent_and_timeouts_count(caplog):
    config = RewardConfig(reward_fn="math_rule")
    assert config.max_error_fraction == 0.01 and config.max_abs_reward == 1e6
    ok = [""] * 199
    with caplog.at_level(logging.WARNING, logger="roll"):
        check_reward_result("rewards.math", config, result_batch(ok + ["KeyError: x"]))  # 1 of 200
        check_reward_result("rewards.math", config, result_batch(ok + [""]))  # nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        "rewards.math: reward_fn 'math_rule' failed on 1 of 200 samples (1 error(s), 0 timeout(s)), e.g. KeyError: x"
    ]
    timed_out = "TimeoutError: no score within timeout_s=5 s"
    with pytest.raises(RewardError) as err:  # 3 of 200: one error and two timeouts
        check_reward_result(
            "rewards.math",
            config,
            result_batch(ok[:197] + [timed_out, "E: a", timed_out], timeouts=[197, 199]),
        )
    assert str(err.value) == (
        "rewards.math: reward_fn 'math_rule' failed on 3 of 200 samples (more than max_error_fraction=0.01), "
        f"e.g. {timed_out}"
    )


def test_a_non_finite_score_that_reaches_the_driver_is_an_error():
    config = RewardConfig(reward_fn="llm_judge")
    with pytest.raises(
        RewardError, match=r"^rewards\.judge: reward_fn 'llm_judge' gave 1 non-finite score\(s\), e.g. inf"
    ):
        check_reward_result("rewards.judge", config, result_batch(["", ""], scores=[1.0, float("inf")]))
    with pytest.raises(RewardError, match=r"gave 1 score\(s\) beyond max_abs_reward=1e\+06, e.g. -1e\+30$"):
        check_reward_result("rewards.judge", config, result_batch(["", ""], scores=[1.0, -1e30]))


def test_error_metrics_per_step_and_role():
    batch = result_batch(["", "E: a", "E: b", ""])
    batch.tensors["reward_timeout"] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    assert reward_error_metrics(batch, {"math": [0, 1], "code": [2, 3]}) == {
        "reward/errors": 2.0,
        "reward/timeouts": 1.0,
        "reward/failures": 3.0,
        "reward/math/errors": 1.0,
        "reward/math/timeouts": 0.0,
        "reward/math/failures": 1.0,
        "reward/code/errors": 1.0,
        "reward/code/timeouts": 1.0,
        "reward/code/failures": 2.0,
    }


def test_max_error_fraction_is_validated():
    from roll.configs.ranges import check_fields

    with pytest.raises(ConfigError, match=r"^rewards\.m\.max_error_fraction: must be in \[0, 1\], got 1.5"):
        check_fields(RewardConfig(reward_fn="math_rule", max_error_fraction=1.5), "rewards.m")
