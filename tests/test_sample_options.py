"""ROLL's per-sample options against hand-computed values."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from roll.configs.errors import ConfigError
from roll.pipeline.rlvr.algorithms.sample_options import (
    apply_sample_options,
    length_weights,
    normalize_scores,
    sample_mask,
)

SCORES = torch.tensor([1.0, 0.0, 1.0, 1.0])
GROUPS = ["a", "a", "b", "b"]
# Valid lengths 4, 2, 3, 1 of response_length 4.
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mean_type", "std_type", "expected"),
    [
        (None, None, [1.0, 0.0, 1.0, 1.0]),
        ("group", None, [0.5, -0.5, 0.0, 0.0]),
        # group a: std of [1, 0] (unbiased) = sqrt(0.5); group b: std 0, so 0 / 1e-6 = 0
        ("group", "group", [0.5 / (0.5**0.5 + 1e-6), -0.5 / (0.5**0.5 + 1e-6), 0.0, 0.0]),
        # batch mean 0.75, unbiased var (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5
        ("batch", "batch", [0.25 / 0.500001, -0.75 / 0.500001, 0.25 / 0.500001, 0.25 / 0.500001]),
        (None, "batch", [1 / 0.500001, 0.0, 1 / 0.500001, 1 / 0.500001]),
        ("batch", "group", [0.25 / (0.5**0.5 + 1e-6), -0.75 / (0.5**0.5 + 1e-6), 0.25 / 1e-6, 0.25 / 1e-6]),
    ],
)
def test_normalize_scores(mean_type, std_type, expected):
    out = normalize_scores(SCORES, GROUPS, mean_type, std_type)
    assert out.tolist() == pytest.approx(expected, rel=1e-5)


def test_normalize_scores_refuses_running():
    with pytest.raises(ValueError, match="norm_mean_type"):
        normalize_scores(SCORES, GROUPS, "running", None)


def _config(**kw):
    base = dict(
        response_length=4,
        max_len_mask=False,
        difficulty_mask=False,
        difficulty_low_threshold=0.1,
        difficulty_high_threshold=0.95,
        error_max_len_clip=False,
        error_max_len_threshold=3,
        length_loss_weight=False,
    )
    return SimpleNamespace(**(base | kw))


def test_max_len_mask_drops_cut_off_responses():
    keep, metrics = sample_mask(_config(max_len_mask=True), SCORES, MASK, GROUPS)
    assert keep.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert metrics["actor/max_len_mask_ratio"] == 0.75


def test_difficulty_mask_drops_groups_outside_the_thresholds():
    # group a mean 0.5 (kept), group b mean 1.0 (>= 0.95: dropped)
    keep, _ = sample_mask(_config(difficulty_mask=True), SCORES, MASK, GROUPS)
    assert keep.tolist() == [1.0, 1.0, 0.0, 0.0]
    # a group of one is never dropped
    keep, _ = sample_mask(_config(difficulty_mask=True), SCORES, MASK, ["a", "b", "c", "d"])
    assert keep.tolist() == [1.0] * 4


def test_error_max_len_clip_drops_long_wrong_answers():
    scores = torch.tensor([0.0, 0.0, 1.0, 0.5])  # lengths 4, 2, 3, 1; threshold 3
    keep, _ = sample_mask(_config(error_max_len_clip=True), scores, MASK, GROUPS)
    assert keep.tolist() == [0.0, 1.0, 1.0, 0.0]  # 0.5 is neither 0 nor 1: dropped, as in ROLL


def test_masks_combine():
    keep, metrics = sample_mask(_config(max_len_mask=True, difficulty_mask=True), SCORES, MASK, GROUPS)
    assert keep.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert metrics["actor/samples_used"] == 1.0


def test_length_weights():
    # lengths 4, 2, 3, 1: 1.5 - (len - 1) / 3 = 0.5, 7/6, 5/6, 1.5; they sum to 4 (mean 1 already)
    assert length_weights(MASK).tolist() == pytest.approx([0.5, 7 / 6, 5 / 6, 1.5], rel=1e-6)
    assert length_weights(MASK[:2]).tolist() == pytest.approx([2 * 0.5 / 2.0, 2 * 1.5 / 2.0])


def test_apply_sample_options_masks_loss_tokens_and_weights_advantages():
    advantages = torch.ones(4, 4) * MASK
    config = _config(max_len_mask=True, length_loss_weight=True)
    train_mask, weighted, _ = apply_sample_options(config, SCORES, MASK, GROUPS, advantages)
    assert train_mask.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]
    assert weighted[:, 0].tolist() == pytest.approx([0.5, 7 / 6, 5 / 6, 1.5], rel=1e-6)


def test_config_refuses_running_and_inverted_thresholds():
    from roll.configs.loader import load_config
    from roll.launch.checks import check_before_launch

    base = Path(__file__).parent / "configs" / "good" / "minimal.yaml"
    with pytest.raises(ConfigError, match="norm_std_type: .*'running' is not supported"):
        check_before_launch(load_config(base, ["norm_std_type=running"]), files=False)
    with pytest.raises(ConfigError, match="difficulty_low_threshold: must be below"):
        load_config(
            base, ["difficulty_mask=true", "difficulty_low_threshold=0.9", "difficulty_high_threshold=0.1"]
        )
