"""Math rule and format rewards, and scoring with a per-sample time limit."""

from __future__ import annotations

import time

import pytest

from roll.configs.errors import ConfigError
from roll.pipeline.rewards.format_reward import format_reward
from roll.pipeline.rewards.math_rule import extract_answer, last_boxed, math_rule_reward
from roll.pipeline.rewards.registry import load_reward_fn
from roll.pipeline.rewards.scoring import RewardScorer, check_reward_kwargs, score_batch


def slow_reward(response: str, ground_truth: str) -> float:
    """Test-only reward: "hang" never returns in time, "boom" raises, otherwise exact match."""
    if response == "hang":
        time.sleep(60)
    if response == "boom":
        raise RuntimeError("boom")
    return float(response == ground_truth)


@pytest.mark.parametrize(
    "response, truth",
    [
        ("37 + 48 = 85. \\boxed{85}", "85"),
        ("first \\boxed{3} then \\boxed{85}", "85"),
        ("\\boxed{\\frac{3}{4}}", "3/4"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),
        ("\\boxed{\\dfrac{6}{8}}", "\\frac{3}{4}"),
        ("$\\boxed{-\\frac{1}{2}}$", "-0.5"),
        ("The answer is 1,234.", "1234"),
        ("Answer: $12.50$", "12.5"),
        ("the final answer is 85 marbles", "85"),
        ("\\boxed{\\text{85 apples}}", "85"),
        ("\\boxed{x = 7}", "7"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}"),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2"),
        ("\\boxed{\\text{yes}}", "yes"),
        ("\\boxed{85}", 85),
    ],
)
def test_math_rule_accepts_equal_answers(response, truth):
    assert math_rule_reward(response, truth) == 1.0


@pytest.mark.parametrize(
    "response, truth",
    [
        ("\\boxed{84}", "85"),
        ("\\boxed{85} ... \\boxed{86}", "85"),  # the last boxed answer counts
        ("no answer here, maybe 85", "85"),  # no last-number fallback by default
        ("\\boxed{85", "85"),  # cut off before the closing brace
        ("\\boxed{}", "85"),
        ("\\boxed{0.333}", "1/3"),
        ("\\boxed{x + 1}", "x + 2"),
        ("\\boxed{9^9^9^9}", "1"),  # a power tower is never handed to sympy
        ("\\boxed{x.__class__}", "1"),
        ("", "85"),
    ],
)
def test_math_rule_rejects_wrong_or_missing_answers(response, truth):
    assert math_rule_reward(response, truth) == 0.0


def test_math_rule_options():
    assert math_rule_reward("so it is 12 + 73 = 85", "85", last_number_fallback=True) == 1.0
    assert math_rule_reward("total 1,234 apples", "1234", last_number_fallback=True) == 1.0
    assert math_rule_reward("\\boxed{50\\%}", "0.5") == 0.0
    assert math_rule_reward("\\boxed{50\\%}", "0.5", percent_as_fraction=True) == 1.0
    assert math_rule_reward("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", use_sympy=False) == 0.0
    assert math_rule_reward("\\boxed{0.333}", "1/3", rel_tol=1e-2) == 1.0


def test_answer_extraction():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{7}") == "7"
    assert extract_answer("The answer is: 42\nmore text") == "42"
    assert extract_answer("nothing") is None


def test_format_reward():
    assert format_reward("37 + 48 = 85. \\boxed{85}", "85") == 1.0
    assert format_reward("\\boxed{85}  \n<|im_end|>", "85") == 1.0
    assert format_reward("\\boxed{\\frac{1}{2}}", "") == 1.0
    assert format_reward("\\boxed{85} and more", "85") == 0.0
    assert format_reward("\\boxed{1} \\boxed{85}", "85") == 0.0
    assert format_reward("85", "85") == 0.0
    assert format_reward("\\boxed{85", "85") == 0.0
    assert format_reward("\\boxed{ }", "85") == 0.0
    assert format_reward("<think>x</think> 42", "", pattern=r"<think>.*</think>.+") == 1.0
    assert format_reward("42", "", pattern=r"<think>.*</think>.+") == 0.0


def test_registry_names_load_these_functions():
    assert load_reward_fn("math_rule") is math_rule_reward
    assert load_reward_fn("format") is format_reward


def test_score_batch_in_process_and_kwargs_check():
    stats: dict[str, int] = {}
    scores = score_batch(
        "math_rule", ["\\boxed{1}", "\\boxed{2}", "2"], ["1", "1", "2"], None, None, stats=stats
    )
    assert scores == [1.0, 0.0, 0.0] and stats == {"scored": 3}
    assert score_batch("math_rule", ["2"], ["2"], {"last_number_fallback": True}, None) == [1.0]
    check_reward_kwargs("math_rule", {"rel_tol": 0.1})
    with pytest.raises(
        ConfigError, match=r"rewards\.m\.reward_kwargs\.fallback: 'math_rule' takes no such option"
    ):
        check_reward_kwargs("math_rule", {"fallback": True}, "rewards.m.reward_kwargs")
    with pytest.raises(ConfigError, match="model reward"):
        score_batch("llm_judge", ["a"], ["b"], None, 1.0)
    with pytest.raises(ConfigError, match="did you mean 'math_rule'"):
        score_batch("math_rul", ["a"], ["b"], None, 1.0)
    with pytest.raises(ConfigError, match="cannot load reward function 'no_such_module:f'"):
        score_batch("no_such_module:f", ["a"], ["b"], None, 1.0)


def test_scoring_times_out_runaway_samples_and_keeps_going():
    scorer = RewardScorer(f"{__name__}:slow_reward", None, timeout_s=1.5, num_procs=2)
    try:
        start = time.monotonic()
        responses = ["a", "hang", "b", "boom", "c", "hang", "d"]
        scores = scorer.score(responses, ["a", "x", "b", "x", "x", "x", "d"])
        assert scores == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
        assert scorer.stats == {"scored": 7, "timeouts": 2, "errors": 1}
        assert time.monotonic() - start < 20  # the two hanging samples were cut off, not waited for
        # The replaced workers keep scoring.
        assert scorer.score(["e", "f"], ["e", "x"]) == [1.0, 0.0]
        processes = [w.process for w in scorer.workers]
    finally:
        scorer.close()
    assert all(p.poll() is not None for p in processes)  # close() stops the worker processes
