"""Hand-computed checks of the RL algorithms (roll.pipeline.rlvr.algorithms). Every expected value
is worked out in the comments next to it."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RoleConfig
from roll.core.batch import Batch
from roll.pipeline.rlvr.algorithms.advantages import (
    compute_advantages,
    compute_token_level_rewards,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    reinforce_advantages,
    reinforce_plus_plus_advantages,
    token_level_rewards_from_config,
)
from roll.pipeline.rlvr.algorithms.kl import KL_ESTIMATORS, get_kl_estimator, kl_penalty
from roll.pipeline.rlvr.algorithms.losses import (
    entropy_loss,
    kl_loss,
    make_actor_loss_fn,
    make_critic_loss_fn,
    policy_loss,
    value_loss,
)
from roll.pipeline.rlvr.algorithms.masked import agg_loss, masked_mean, masked_sum, masked_var, masked_whiten
from roll.pipeline.rlvr.algorithms.metrics import (
    logprob_mismatch,
    masked_stats,
    response_length_stats,
    score_stats_by_domain,
)

torch.set_num_threads(1)
T = torch.tensor


def close(actual, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), T(expected), atol=atol, rtol=0)


def make_config(**overrides) -> RLVRConfig:
    return RLVRConfig(actor_train=RoleConfig(), actor_infer=RoleConfig(), **overrides)


# ---------------------------------------------------------------- masked reductions and agg modes

LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1, 1, 0], [1, 0, 0]])


def test_masked_mean_sum_var_whiten():
    # valid values 1, 2, 4: sum 7, mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 14/3
    close(masked_sum(LOSS, MASK), 7.0)
    close(masked_mean(LOSS, MASK), 7 / 3)
    close(masked_mean(LOSS, MASK, dim=-1), [1.5, 4.0])
    close(masked_var(LOSS, MASK, unbiased=False), 14 / 9)
    close(masked_var(LOSS, MASK), 7 / 3)
    std = math.sqrt(7 / 3)
    white = masked_whiten(LOSS, MASK)
    close(white[MASK > 0], [(1 - 7 / 3) / std, (2 - 7 / 3) / std, (4 - 7 / 3) / std], atol=1e-5)
    close(
        masked_whiten(LOSS, MASK, shift_mean=False)[MASK > 0],
        [(1 - 7 / 3) / std + 7 / 3, (2 - 7 / 3) / std + 7 / 3, (4 - 7 / 3) / std + 7 / 3],
        atol=1e-5,
    )
    # one valid element: variance 0, whitening stays finite
    assert masked_var(LOSS, T([[1, 0, 0], [0, 0, 0]])).item() == 0.0
    assert torch.isfinite(masked_whiten(LOSS, T([[1, 0, 0], [0, 0, 0]]))).all()


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2 sequences
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean", 2.75),
    ],
)
def test_agg_modes(mode, expected):
    close(agg_loss(LOSS, MASK, mode), expected)


@pytest.mark.parametrize(
    "mode, expected", [("token-mean", 1.5), ("seq-mean-token-sum", 3.0), ("seq-mean-token-mean", 1.5)]
)
def test_agg_modes_skip_empty_sequences(mode, expected):
    # the second row has no tokens: it does not count as a sequence
    close(agg_loss(LOSS, T([[1, 1, 0], [0, 0, 0]]), mode), expected)


def test_agg_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match="loss_agg_mode.*token-mean"):
        agg_loss(LOSS, MASK, "sum")


# ---------------------------------------------------------------- KL estimators

LOGP = T([[-1.0, -2.0]])
REF = T([[-1.5, -1.0]])  # d = logp - ref = [0.5, -1.0]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("kl", [0.5, -1.0]),
        ("k1", [0.5, -1.0]),
        ("abs", [0.5, 1.0]),
        ("mse", [0.125, 0.5]),  # 0.5 * d^2
        ("k2", [0.125, 0.5]),
        ("low_var_kl", [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]),  # exp(-d) - 1 + d
        ("k3", [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]),
    ],
)
def test_kl_estimators(name, expected):
    close(kl_penalty(LOGP, REF, name)[0], expected)


def test_low_var_kl_is_clamped():
    # d = -20: exp(20) - 21 ~ 4.9e8; d = +20: exp(-20) - 1 + 20 ~ 19; both clamp to 10
    close(kl_penalty(T([[-20.0, 0.0]]), T([[0.0, -20.0]]), "low_var_kl"), [[10.0, 10.0]])


def test_kl_full_and_unknown_names_raise():
    with pytest.raises(ValueError, match="kl_penalty: 'full' needs"):
        get_kl_estimator("full")
    with pytest.raises(ValueError, match="kl_loss_type: expected one of .*low_var_kl"):
        get_kl_estimator("k4", "kl_loss_type")
    assert set(KL_ESTIMATORS) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}


# ---------------------------------------------------------------- token-level rewards

RESP_MASK = T([[1, 1, 0], [1, 1, 1]])


def test_token_level_rewards_without_kl():
    close(compute_token_level_rewards(T([1.0, -0.5]), RESP_MASK), [[0.0, 1.0, 0.0], [0.0, 0.0, -0.5]])


def test_token_level_rewards_with_kl():
    kl = T([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    # row 0: [-0.5*0.1, 1 - 0.5*0.2, padding 0]; row 1: [-0.2, -0.25, -0.5 - 0.3]
    out = compute_token_level_rewards(T([1.0, -0.5]), RESP_MASK, kl, kl_coef=0.5)
    close(out, [[-0.05, 0.9, 0.0], [-0.2, -0.25, -0.8]])


def test_token_level_rewards_empty_row_drops_score():
    close(compute_token_level_rewards(T([1.0, 2.0]), T([[0, 0], [1, 0]])), [[0.0, 0.0], [2.0, 0.0]])


def test_reward_clipping_and_whitening_from_config():
    mask = torch.ones(3, 2)
    out, metrics = token_level_rewards_from_config(make_config(reward_clip=1.0), T([3.0, -2.0, 0.5]), mask)
    close(out[:, -1], [1.0, -1.0, 0.5])
    assert metrics == {}
    # scores 1, 2, 3: mean 2, unbiased std 1 -> -1, 0, 1
    out, _ = token_level_rewards_from_config(make_config(whiten_rewards=True), T([1.0, 2.0, 3.0]), mask)
    close(out, [[0.0, -1.0], [0.0, 0.0], [0.0, 1.0]], atol=1e-6)
    with pytest.raises(ValueError, match="reward_clip"):
        token_level_rewards_from_config(make_config(reward_clip=0.0), T([1.0, 2.0, 3.0]), mask)


def test_token_level_kl_from_config():
    config = make_config(add_token_level_kl=True, init_kl_coef=0.5, kl_penalty="abs")
    logp, ref = T([[-1.0, -1.0], [-2.0, 0.0]]), T([[-1.2, -0.8], [-1.0, 0.0]])
    mask = T([[1, 1], [1, 0]])
    # |d| = [[0.2, 0.2], [1.0, (padding)]]; rewards = score on last token - 0.5 * |d|
    out, metrics = token_level_rewards_from_config(config, T([1.0, 0.0]), mask, logp, ref)
    close(out, [[-0.1, 0.9], [-0.5, 0.0]])
    close(metrics["critic/kl"], 1.4 / 3)
    assert metrics["critic/kl_coef"] == 0.5
    with pytest.raises(ValueError, match="ref_log_probs"):
        token_level_rewards_from_config(config, T([1.0, 0.0]), mask)


# ---------------------------------------------------------------- advantage estimators


def outcome(scores, width: int = 2) -> torch.Tensor:
    rewards = torch.zeros(len(scores), width)
    rewards[:, -1] = T(scores)
    return rewards


def test_grpo_groups_of_two_with_std():
    # group a: scores 1, 0 -> mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / 0.70711 = +-0.70711
    # group b: identical scores -> 0 (no NaN)
    adv, ret = grpo_advantages(outcome([1.0, 0.0, 1.0, 1.0]), torch.ones(4, 2), ["a", "a", "b", "b"])
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    close(adv, [[s, s], [-s, -s], [0.0, 0.0], [0.0, 0.0]])
    assert torch.equal(adv, ret)


def test_grpo_without_std_interleaved_int_groups_and_padding():
    rewards = T([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 1.0, 0.0]])
    mask = T([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    # scores (summed rewards) 1, 0, 3, 1; groups {0, 2} mean 2, {1, 3} mean 0.5
    adv, _ = grpo_advantages(rewards, mask, torch.tensor([7, 9, 7, 9]), norm_by_std=False)
    close(adv, [[-1.0, -1.0, 0.0], [-0.5, -0.5, -0.5], [1.0, 1.0, 0.0], [0.5, 0.5, 0.0]])


def test_grpo_singleton_group_is_zero():
    adv, _ = grpo_advantages(outcome([2.0, 1.0, 0.0]), torch.ones(3, 2), ["x", "y", "y"])
    assert torch.isfinite(adv).all()
    close(adv[0], [0.0, 0.0])


def test_discounted_returns_and_reinforce():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5: row 0 G = [0.25, 0.5, 1]; row 1 G = [1, 2, pad 0]
    close(discounted_returns(rewards, mask, 0.5), [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # baseline = mean of first-token returns = (0.25 + 1) / 2 = 0.625
    adv, ret = reinforce_advantages(rewards, mask, gamma=0.5)
    close(adv, [[-0.375, -0.125, 0.375], [0.375, 1.375, 0.0]])
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # gamma 1, outcome rewards: advantage = score - mean(score) = [0.5, -0.5, 0]
    adv, _ = reinforce_advantages(outcome([1.0, 0.0, 0.5]), torch.ones(3, 2))
    close(adv, [[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0]])


def test_reinforce_plus_plus_discounting():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    # G (gamma 0.5) on valid tokens: 0.25, 0.5, 1, 1, 2 -> mean 0.95; deviations -0.7, -0.45,
    # 0.05, 0.05, 1.05; sum of squares 1.8 -> unbiased var 0.45
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    std = math.sqrt(0.45)
    close(adv, [[-0.7 / std, -0.45 / std, 0.05 / std], [0.05 / std, 1.05 / std, 0.0]], atol=1e-5)
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])


def test_gae_hand_unrolled():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = T([[0.5, 0.6, 0.7], [0.1, 0.2, 9.0]])  # 9.0 sits on padding and must be ignored
    mask = T([[1, 1, 1], [1, 1, 0]])
    gamma, lam = 0.9, 0.8
    # row 0: d2 = 1 - 0.7 = 0.3            A2 = 0.3
    #        d1 = 0.9*0.7 - 0.6 = 0.03     A1 = 0.03 + 0.72*0.3 = 0.246
    #        d0 = 0.9*0.6 - 0.5 = 0.04     A0 = 0.04 + 0.72*0.246 = 0.21712
    # row 1: d1 = 2 - 0.2 = 1.8            A1 = 1.8
    #        d0 = 0.9*0.2 - 0.1 = 0.08     A0 = 0.08 + 0.72*1.8 = 1.376
    adv, ret = gae_advantages(rewards, values, mask, gamma, lam)
    close(adv, [[0.21712, 0.246, 0.3], [1.376, 1.8, 0.0]], atol=1e-6)
    close(ret, [[0.71712, 0.846, 1.0], [1.476, 2.0, 0.0]], atol=1e-6)


def test_gae_skips_masked_holes_and_matches_mc_when_lambda_one():
    rewards = T([[0.3, 5.0, 0.0, 1.0]])
    values = T([[0.2, 7.0, 0.4, 0.1]])
    holed = T([[1, 0, 1, 1]])
    # the hole (column 1) is skipped: same as the compact sequence r=[0.3, 0, 1], V=[0.2, 0.4, 0.1]
    adv, _ = gae_advantages(rewards, values, holed, 0.9, 0.8)
    compact, _ = gae_advantages(T([[0.3, 0.0, 1.0]]), T([[0.2, 0.4, 0.1]]), torch.ones(1, 3), 0.9, 0.8)
    close(adv[:, [0, 2, 3]], compact.tolist())
    assert adv[0, 1].item() == 0.0
    # gamma = lambda = 1: A_t = sum_{i >= t} r_i - V_t
    adv, ret = gae_advantages(T([[0.3, 0.0, 1.0]]), T([[0.2, 0.4, 0.1]]), torch.ones(1, 3), 1.0, 1.0)
    close(adv, [[1.3 - 0.2, 1.0 - 0.4, 1.0 - 0.1]])
    close(ret, [[1.3, 1.0, 1.0]])


def test_compute_advantages_whiten_then_clip_zero_on_padding():
    config = make_config(adv_estimator="reinforce", whiten_advantages=True, advantage_clip=0.5)
    mask = T([[1, 0], [1, 0], [1, 0], [1, 0]])
    rewards = T([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    # reinforce: [0.75, -0.25, -0.25, -0.25]; whiten: mean 0, unbiased var 0.75/3 = 0.25
    # -> [1.5, -0.5, -0.5, -0.5]; clip at 0.5 -> [0.5, -0.5, -0.5, -0.5]; padding column 0
    adv, ret = compute_advantages(config, rewards, mask, None)
    close(adv, [[0.5, 0.0], [-0.5, 0.0], [-0.5, 0.0], [-0.5, 0.0]], atol=1e-6)
    close(ret, [[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    config = make_config(adv_estimator="reinforce", whiten_advantages=True)
    close(compute_advantages(config, rewards, mask, None)[0][:, 0], [1.5, -0.5, -0.5, -0.5], atol=1e-6)


def test_compute_advantages_dispatch_and_errors():
    rewards, mask = outcome([1.0, 0.0]), torch.ones(2, 2)
    adv, _ = compute_advantages(
        make_config(adv_estimator="grpo", norm_adv_by_std_in_grpo=False), rewards, mask, [0, 0]
    )
    close(adv, [[0.5, 0.5], [-0.5, -0.5]])
    values = T([[0.5, 0.5], [0.5, 0.5]])
    adv, ret = compute_advantages(make_config(adv_estimator="gae"), rewards, mask, None, values)
    close(adv, [[0.5, 0.5], [-0.5, -0.5]])  # gamma = lambda = 1: score - V
    close(ret, [[1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="critic"):
        compute_advantages(make_config(adv_estimator="gae"), rewards, mask, None)
    with pytest.raises(ValueError, match="group ids"):
        compute_advantages(make_config(adv_estimator="grpo"), rewards, mask, None)
    with pytest.raises(ValueError, match="same shape"):
        compute_advantages(make_config(), rewards, torch.ones(2, 3), [0, 0])
    with pytest.raises(ValueError, match="advantage_clip"):
        compute_advantages(make_config(advantage_clip=-1.0), rewards, mask, [0, 1])


# ---------------------------------------------------------------- PPO policy loss

# ratios and advantages: (r=1.5, A=+1) clip high active; (0.5, +1) not; (1.1, +1) inside;
# (0.5, -1) clip low active; (1.5, -1) not
RATIOS = T([[1.5, 0.5, 1.1, 0.5, 1.5]])
ADVS = T([[1.0, 1.0, 1.0, -1.0, -1.0]])
ONES = torch.ones(1, 5)


def test_ppo_clip_both_sides_and_clipfrac():
    logp = RATIOS.log().requires_grad_(True)
    loss, m = policy_loss(logp, torch.zeros(1, 5), ADVS, ONES, 0.2, 0.2)
    # per token: max(-A r, -A clip(r)) = -1.2, -0.5, -1.1, 0.8, 1.5 -> mean -0.1
    close(loss, -0.1)
    assert m["pg_loss"] == pytest.approx(-0.1)
    assert m["clipfrac"] == pytest.approx(0.4)
    assert m["clipfrac_high"] == pytest.approx(0.2) and m["clipfrac_low"] == pytest.approx(0.2)
    assert m["dual_clip_frac"] == 0.0
    assert m["ratio_mean"] == pytest.approx(5.1 / 5) and m["ratio_max"] == pytest.approx(1.5)
    # k3 of the ratio: mean((r - 1) - log r)
    expected_kl = sum((r - 1) - math.log(r) for r in [1.5, 0.5, 1.1, 0.5, 1.5]) / 5
    assert m["approx_kl"] == pytest.approx(expected_kl, abs=1e-6)
    loss.backward()
    # d/dlogp of -A r = -A r / 5 on unclipped tokens; 0 where the clipped term is active
    close(logp.grad, [[0.0, -0.1, -0.22, 0.0, 0.3]])


def test_ppo_asymmetric_clip():
    loss, m = policy_loss(RATIOS.log(), torch.zeros(1, 5), ADVS, ONES, 0.2, 0.28)
    # token 0 becomes -1.28: (-1.28 - 0.5 - 1.1 + 0.8 + 1.5) / 5
    close(loss, -0.116)
    loss, m = policy_loss(RATIOS.log(), torch.zeros(1, 5), ADVS, ONES, 0.2, 0.6)
    # r = 1.5 < 1.6: no clip high; only the (0.5, -1) token clips
    assert m["clipfrac"] == pytest.approx(0.2) and m["clipfrac_high"] == 0.0


def test_dual_clip():
    ratios = T([[1.5, 0.5, 1.1, 0.5, 1.5, 4.0, 4.0]])
    advs = T([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    mask = torch.ones(1, 7)
    # without dual clip: -1.2, -0.5, -1.1, 0.8, 1.5, 4.0 (r=4, A=-1), -1.2 (r=4, A=+1) -> 2.3 / 7
    loss, m = policy_loss(ratios.log(), torch.zeros(1, 7), advs, mask, 0.2, 0.2)
    close(loss, 2.3 / 7)
    # dual clip c=3 caps the (r=4, A=-1) token at -A*c = 3; positive advantages are untouched
    loss, m = policy_loss(ratios.log(), torch.zeros(1, 7), advs, mask, 0.2, 0.2, dual_clip_c=3.0)
    close(loss, 1.3 / 7)
    assert m["dual_clip_frac"] == pytest.approx(1 / 7)
    assert m["ratio_max"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss(ratios.log(), torch.zeros(1, 7), advs, mask, 0.2, 0.2, dual_clip_c=1.0)


def test_ratio_one_gives_minus_mean_advantage():
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 6, generator=gen)
    adv = torch.randn(4, 6, generator=gen)
    mask = (torch.rand(4, 6, generator=gen) > 0.3).float()
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        loss, m = policy_loss(logp, logp.clone(), adv, mask, 0.2, 0.3, dual_clip_c=3.0, loss_agg_mode=mode)
        close(loss, agg_loss(-adv, mask, mode).item(), atol=1e-6)
        assert m["clipfrac"] == 0.0 and m["approx_kl"] == pytest.approx(0.0, abs=1e-7)


def test_policy_loss_ignores_padding():
    logp = T([[0.0, 3.0]])  # ratio e^3 on padding would clip and dominate if counted
    loss, m = policy_loss(logp, torch.zeros(1, 2), T([[2.0, -5.0]]), T([[1, 0]]), 0.2, 0.2)
    close(loss, -2.0)
    assert m["clipfrac"] == 0.0 and m["ratio_max"] == pytest.approx(1.0)


# ---------------------------------------------------------------- value loss


def test_value_loss_clipping():
    values = T([[1.0, 2.0, 0.0, 1.0]])
    old = T([[0.0, 2.0, 0.0, 0.0]])
    returns = T([[2.0, 0.0, 0.3, 0.0]])
    mask = torch.ones(1, 4)
    # t0: (1-2)^2 = 1 vs clipped V 0.5 -> 2.25 (clip active); t1: 4 = 4; t2: 0.09; t3: 1 vs 0.25 -> 1
    loss, m = value_loss(values, old, returns, mask, value_clip=0.5)
    close(loss, 0.5 * (2.25 + 4 + 0.09 + 1) / 4)
    assert m["vf_clipfrac"] == pytest.approx(0.25)
    assert m["vf_loss"] == pytest.approx(0.9175)
    loss, m = value_loss(values, old, returns, mask, value_clip=None)
    close(loss, 0.5 * (1 + 4 + 0.09 + 1) / 4)
    assert m["vf_clipfrac"] == 0.0
    # padding is ignored
    loss, _ = value_loss(values, old, returns, T([[1, 0, 0, 0]]), value_clip=0.5)
    close(loss, 0.5 * 2.25)


# ---------------------------------------------------------------- LossFn factories


def actor_batch(with_old: bool = True) -> tuple[dict, Batch]:
    gen = torch.Generator().manual_seed(1)
    logp = (-torch.rand(3, 4, generator=gen)).requires_grad_(True)
    tensors = {
        "advantages": torch.randn(3, 4, generator=gen),
        "response_mask": T([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]),
        "ref_log_probs": -torch.rand(3, 4, generator=gen),
    }
    if with_old:
        tensors["old_log_probs"] = logp.detach() + 0.3 * torch.randn(3, 4, generator=gen)
    outputs = {"log_probs": logp, "entropy": torch.rand(3, 4, generator=gen).requires_grad_(True)}
    return outputs, Batch.from_dict(tensors)


def test_actor_loss_fn_equals_composed_formula_and_pickles():
    config = make_config(
        pg_clip=0.2,
        pg_clip_high=0.28,
        dual_clip_loss=True,
        dual_clip_c=3.0,
        entropy_loss_coef=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="k2",
        loss_agg_mode="seq-mean-token-mean",
    )
    outputs, batch = actor_batch()
    loss_fn = pickle.loads(pickle.dumps(make_actor_loss_fn(config)))
    loss, metrics = loss_fn(outputs, batch)
    mask, mode = batch["response_mask"], "seq-mean-token-mean"
    pg, pg_m = policy_loss(
        outputs["log_probs"], batch["old_log_probs"], batch["advantages"], mask, 0.2, 0.28, 3.0, mode
    )
    ent = entropy_loss(outputs["entropy"], mask, mode)
    kl = kl_loss(outputs["log_probs"], batch["ref_log_probs"], mask, "k2", mode)
    close(loss, (pg - 0.01 * ent + 0.1 * kl).item())
    assert metrics["actor/pg_loss"] == pytest.approx(pg_m["pg_loss"])
    assert metrics["actor/clipfrac"] == pytest.approx(pg_m["clipfrac"])
    assert metrics["actor/entropy"] == pytest.approx(ent.item())
    assert metrics["actor/kl_loss"] == pytest.approx(kl.item())
    assert metrics["actor/total_loss"] == pytest.approx(loss.item())
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    assert outputs["log_probs"].grad.abs().sum() > 0 and outputs["entropy"].grad.abs().sum() > 0
    assert outputs["log_probs"].grad[0, 3] == 0 and outputs["log_probs"].grad[1, 2:].abs().sum() == 0


def test_actor_loss_fn_hand_computed_without_old_log_probs():
    config = make_config(entropy_loss_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="kl")
    logp = torch.zeros(2, 2, requires_grad=True)
    outputs = {"log_probs": logp, "entropy": T([[0.5, 0.5], [1.0, 0.0]])}
    batch = Batch.from_dict(
        {
            "advantages": T([[1.0, 2.0], [3.0, 0.0]]),
            "response_mask": T([[1, 1], [1, 0]]),
            "ref_log_probs": T([[-0.1, -0.1], [-0.2, 0.0]]),
        }
    )
    # ratio 1: pg = -(1 + 2 + 3) / 3 = -2; entropy = 2 / 3; kl (k1) = (0.1 + 0.1 + 0.2) / 3
    loss, metrics = make_actor_loss_fn(config)(outputs, batch)
    close(loss, -2.0 - 0.01 * 2 / 3 + 0.1 * 0.4 / 3)
    assert metrics["actor/clipfrac"] == 0.0
    loss.backward()
    # d/dlogp: -A / 3 (policy gradient through the detached ratio) + 0.1 / 3 (k1 KL)
    close(logp.grad, [[-1 / 3 + 0.1 / 3, -2 / 3 + 0.1 / 3], [-1.0 + 0.1 / 3, 0.0]])


def test_actor_loss_fn_config_errors_and_missing_fields():
    with pytest.raises(ValueError, match="dual_clip_c"):
        make_actor_loss_fn(make_config(dual_clip_loss=True, dual_clip_c=0.5))
    with pytest.raises(ValueError, match="kl_loss_type: 'full'"):
        make_actor_loss_fn(make_config(use_kl_loss=True, kl_loss_type="full"))
    outputs, batch = actor_batch()
    no_ref = batch.select(["advantages", "response_mask", "old_log_probs"])
    with pytest.raises(KeyError, match="ref_log_probs"):
        make_actor_loss_fn(make_config(use_kl_loss=True, kl_loss_coef=0.1))(outputs, no_ref)
    with pytest.raises(KeyError, match="entropy"):
        make_actor_loss_fn(make_config(entropy_loss_coef=0.1))({"log_probs": outputs["log_probs"]}, batch)


def test_critic_loss_fn_and_pickle():
    loss_fn = pickle.loads(pickle.dumps(make_critic_loss_fn(make_config(value_clip=0.5))))
    values = T([[1.0, 2.0, 0.0, 1.0]], requires_grad=True)
    batch = Batch.from_dict(
        {
            "values": T([[0.0, 2.0, 0.0, 0.0]]),
            "returns": T([[2.0, 0.0, 0.3, 0.0]]),
            "response_mask": torch.ones(1, 4),
        }
    )
    loss, metrics = loss_fn({"values": values}, batch)
    close(loss, 0.9175)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(0.25)
    loss.backward()
    # t0 clipped (grad 0); t1: 0.5*2*(2-0)/4 = 0.5; t2: 0.5*2*(-0.3)/4; t3: 0.5*2*1/4
    close(values.grad, [[0.0, 0.5, -0.075, 0.25]])
    with pytest.raises(ValueError, match="value_clip"):
        make_critic_loss_fn(make_config(value_clip=0.0))


# ---------------------------------------------------------------- metrics


def test_logprob_mismatch():
    train = T([[-1.0, -2.0, -3.0]])
    infer = T([[-1.1, -1.5, 0.0]])
    # valid diffs 0.1, -0.5 (padding diff -3 ignored)
    m = logprob_mismatch(train, infer, T([[1, 1, 0]]))
    assert m["train_infer/logprob_abs_diff/mean"] == pytest.approx(0.3)
    assert m["train_infer/logprob_abs_diff/max"] == pytest.approx(0.5)
    expected = (abs(math.exp(0.1) - 1) + abs(math.exp(-0.5) - 1)) / 2
    assert m["train_infer/ratio_abs_dev/mean"] == pytest.approx(expected, abs=1e-6)


def test_response_length_and_score_stats():
    m = response_length_stats(T([[1, 1, 0], [1, 1, 1]]))
    assert m == {
        "response_length/mean": 2.5,
        "response_length/max": 3.0,
        "response_length/min": 2.0,
        "response_length/clip_ratio": 0.5,
    }
    m = score_stats_by_domain(T([1.0, 0.0, 1.0, 0.5]), ["math", "math", "code", "code"])
    assert m["critic/score/mean"] == pytest.approx(0.625)
    assert m["critic/score/mean/math"] == pytest.approx(0.5) and m["critic/score/std/math"] == pytest.approx(
        0.5
    )
    assert m["critic/score/mean/code"] == pytest.approx(0.75) and m["critic/score/std/code"] == pytest.approx(
        0.25
    )
    with pytest.raises(ValueError, match="domains"):
        score_stats_by_domain(T([1.0]), ["a", "b"])
    m = masked_stats("critic/advantages", T([[1.0, -2.0, 9.0]]), T([[1, 1, 0]]))
    assert m == {"critic/advantages/mean": -0.5, "critic/advantages/max": 1.0, "critic/advantages/min": -2.0}
