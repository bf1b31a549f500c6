"""DAPO dynamic sampling / overlong tools and TIS / MIS off-policy weights against hand-computed values."""

import math
from types import SimpleNamespace

import pytest
import torch

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.core.batch import Batch
from roll.pipeline.rlvr.algorithms.dapo import informative_groups, overlong_penalty, truncated_rows
from roll.pipeline.rlvr.algorithms.losses import clip_range, policy_loss
from roll.pipeline.rlvr.algorithms.off_policy import importance_weights
from roll.pipeline.rlvr.rollouts import _assemble


def test_informative_groups_drops_all_equal_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    gids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    kept, dropped = informative_groups(scores, gids)
    assert kept == [2, 3]
    assert dropped == [0, 1, 4, 5, 6, 7]


def test_overlong_penalty_band():
    lengths = torch.tensor([10, 24, 26, 28, 32])
    # response_length 32, buffer 8: band starts after 24 tokens; -(L - 24) / 8 * 0.5
    expected = torch.tensor([0.0, 0.0, -2 / 8 * 0.5, -4 / 8 * 0.5, -0.5])
    assert torch.allclose(overlong_penalty(lengths, 32, 8, 0.5), expected)
    assert torch.equal(overlong_penalty(lengths, 32, 0), torch.zeros(5))


def test_truncated_rows_full_without_eos():
    eos = 2
    responses = torch.tensor([[5, 6, 7], [5, 6, 2], [5, 2, 0], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    assert truncated_rows(responses, mask, [eos]).tolist() == [True, False, False, False]


def test_assemble_takes_kept_groups_then_fills_with_dropped():
    kept = [Batch.from_dict({"x": torch.tensor([1, 2])}), Batch.from_dict({"x": torch.tensor([3, 4])})]
    dropped = [Batch.from_dict({"x": torch.tensor([9, 9])})]
    batch, filled = _assemble(kept, dropped, 2)
    assert batch["x"].tolist() == [1, 2] and filled == 0
    batch, filled = _assemble(kept, dropped, 6)
    assert batch["x"].tolist() == [1, 2, 3, 4, 9, 9] and filled == 2


def _logps():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.4], [0.3, 0.3, 0.1]]))
    infer = torch.log(torch.tensor([[0.25, 0.4, 0.1], [0.3, 0.1, 0.9]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return old, infer, mask  # token ratios: [2, 0.5, 4], [1, 3, (pad)]


def test_tis_token_truncates_at_cap():
    w, m = importance_weights(*_logps(), "tis", "token", 2.5)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 2.5], [1.0, 2.5, 0.0]]))
    assert m["off_policy/ratio_max"] == pytest.approx(4.0)
    assert m["off_policy/ratio_min"] == pytest.approx(0.5)
    assert m["off_policy/ratio_mean"] == pytest.approx((2 + 0.5 + 4 + 1 + 3) / 5)
    assert m["off_policy/capped_frac"] == pytest.approx(2 / 5)
    assert m["off_policy/ratio_p50"] == pytest.approx(2.0)


def test_mis_token_masks_above_cap():
    w, _ = importance_weights(*_logps(), "mis", "token", 2.5)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]]))


def test_sequence_level_weights():
    # sequence ratios: 2 * 0.5 * 4 = 4 and 1 * 3 = 3 (padding ignored)
    w, m = importance_weights(*_logps(), "tis", "sequence", 3.5)
    assert torch.allclose(w, torch.tensor([[3.5, 3.5, 3.5], [3.0, 3.0, 0.0]]))
    assert m["off_policy/capped_frac"] == pytest.approx(0.5)
    w, _ = importance_weights(*_logps(), "mis", "sequence", 3.5)
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 0.0], [3.0, 3.0, 0.0]]))


def test_weights_scale_the_clipped_policy_loss_and_compose_with_clip_high():
    # r = [1.5, 0.5], A = [1, -1]; clip_low 0.2, clip_high 0.28 (DAPO clip-higher):
    # token 0: max(-1.5, -1.28) = -1.28; token 1: max(0.5, 0.8) = 0.8. Weights 2 and 0.5.
    logp = torch.log(torch.tensor([[1.5, 0.5]]))
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    weights = torch.tensor([[2.0, 0.5]])
    loss, metrics = policy_loss(logp, old, adv, mask, 0.2, 0.28, is_weights=weights)
    assert loss.item() == pytest.approx((-1.28 * 2 + 0.8 * 0.5) / 2)
    assert metrics["clipfrac_high"] == pytest.approx(0.5) and metrics["clipfrac_low"] == pytest.approx(0.5)
    config = SimpleNamespace(pg_clip=0.2, pg_clip_low=None, pg_clip_high=0.28)
    assert clip_range(config) == (0.2, 0.28)


def test_sequence_ratio_overflow_is_bounded():
    old = torch.zeros(1, 50)
    infer = torch.full((1, 50), -1.0)  # log ratio sum 50 -> bounded at e^20
    w, m = importance_weights(old, infer, torch.ones(1, 50), "tis", "sequence", 2.0)
    assert torch.all(w == 2.0)
    assert math.isfinite(m["off_policy/ratio_max"])


@pytest.mark.parametrize(
    "override, key",
    [
        ("off_policy_correction.mode=is", "off_policy_correction.mode"),
        ("off_policy_correction.cap=0", "off_policy_correction.cap"),
        ("dynamic_sampling.max_rounds=0", "dynamic_sampling.max_rounds"),
        ("overlong.buffer_length=-1", "overlong.buffer_length"),
    ],
)
def test_bad_options_name_their_key(override, key):
    from roll.launch.checks import check_before_launch

    with pytest.raises(ConfigError) as err:  # ranges at load, named values before launch
        check_before_launch(load_config("examples/config/rlvr_config.yaml", [override]), files=False)
    assert str(err.value).startswith(f"{key}:")


def test_correction_without_engine_logprobs_is_refused_before_launch():
    from roll.launch.checks import check_before_launch

    overrides = ["off_policy_correction.mode=tis", "actor_infer.generating_args.logprobs=false"]
    with pytest.raises(ConfigError) as err:
        check_before_launch(load_config("examples/config/rlvr_config.yaml", overrides), files=False)
    assert str(err.value).startswith("actor_infer.generating_args.logprobs:")
    assert "tis" in str(err.value)
    # without the correction, the engine may skip its log-probs
    check_before_launch(load_config("examples/config/rlvr_config.yaml", overrides[1:]), files=False)
