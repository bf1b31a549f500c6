"""Every pg_variant loss against numbers worked out by hand (values and gradients on 2 x 2 tensors),
and pg_variant / its options loaded from an alibaba/ROLL-style file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from launch_files import launch_overrides, make_launch_files

from roll.configs.loader import load_config
from roll.core.batch import Batch
from roll.launch.rlvr import main
from roll.pipeline.rlvr.algorithms.losses import make_actor_loss_fn, policy_loss
from roll.pipeline.rlvr.algorithms.policy_losses import POLICY_LOSSES, PolicyLossOptions, get_policy_loss

EXAMPLES = Path(__file__).parent.parent / "examples" / "config"

# Token ratios r = pi / pi_old (old log-probs 0, so log_probs = log r), advantages of a GRPO group
# (+1 for the first response, -1 for the second) and one padding token; token-mean divides by 3.
R = [[1.5, 0.5], [0.9, 1.05]]
A = [[1.0, 1.0], [-1.0, -1.0]]
MASK = [[1, 1], [1, 0]]
L = [[math.log(r) for r in row] for row in R]
N = 3
S0, S1 = math.sqrt(1.5 * 0.5), 0.9  # GSPO: geometric mean of each response's valid token ratios

# variant -> (options, loss value, d loss / d log_probs), each worked out by hand from the formulas
# in docs/policy_losses.md (a padding token contributes nothing).
CASES = {
    # max(-A r, -A clamp(r, 0.8, 1.2)): r=1.5 clipped at 1.2 (no gradient); 0.5 and 0.9 unclipped.
    "ppo": ({}, (-1.2 - 0.5 + 0.9) / N, [[0.0, -0.5 / N], [0.9 / N, 0.0]]),
    # one ratio per response (S0 = 0.866, S1 = 0.9, both inside [0.8, 1.2]); d s / d logp_t = s / len.
    "gspo": ({}, (-2 * S0 + S1) / N, [[-S0 / N, -S0 / N], [S1 / N, 0.0]]),
    "vanilla": ({}, (-L[0][0] - L[0][1] + L[1][0]) / N, [[-1 / N, -1 / N], [1 / N, 0.0]]),
    # weight clamp(r, 0, 1) = 1, 0.5, 0.9 as a constant.
    "tis": (
        {},
        (-1.0 * L[0][0] - 0.5 * L[0][1] + 0.9 * L[1][0]) / N,
        [[-1 / N, -0.5 / N], [0.9 / N, 0.0]],
    ),
    # scores [1, 0]: response 0 positive (weight 1, no ratio), response 1 negative (0.5 x clamp(0.9, 0, 1)).
    "topr": (
        {"topr_negative_weight": 0.5},
        (-L[0][0] - L[0][1] + 0.5 * 0.9 * L[1][0]) / N,
        [[-1 / N, -1 / N], [0.45 / N, 0.0]],
    ),
    # weight clamp(r, 0.9, 1.1) = 1.1, 0.9, 0.9 as a constant.
    "cispo": (
        {},
        (-1.1 * L[0][0] - 0.9 * L[0][1] + 0.9 * L[1][0]) / N,
        [[-1.1 / N, -0.9 / N], [0.9 / N, 0.0]],
    ),
    # -A logp + tau / 2 logp^2 with tau = 0.1: gradient -A + 0.1 logp.
    "kimi15": (
        {},
        sum(-a * lp + 0.05 * lp * lp for a, lp in [(1, L[0][0]), (1, L[0][1]), (-1, L[1][0])]) / N,
        [[(-1 + 0.1 * L[0][0]) / N, (-1 + 0.1 * L[0][1]) / N], [(1 + 0.1 * L[1][0]) / N, 0.0]],
    ),
}


def _run(variant: str, options: PolicyLossOptions, **kwargs):
    log_probs = torch.tensor(L, dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(
        log_probs,
        torch.zeros(2, 2, dtype=torch.float64),
        torch.tensor(A, dtype=torch.float64),
        torch.tensor(MASK),
        0.2,
        0.2,
        variant=variant,
        options=options,
        scores=torch.tensor([1.0, 0.0]),
        **kwargs,
    )
    loss.backward()
    return loss.item(), log_probs.grad.tolist(), metrics


def test_every_registered_variant_has_a_hand_computed_case():
    assert set(CASES) == set(POLICY_LOSSES)


@pytest.mark.parametrize("variant", sorted(CASES))
def test_variant_matches_hand_computed_loss_and_gradient(variant):
    options, value, grad = CASES[variant]
    got_value, got_grad, metrics = _run(variant, PolicyLossOptions(**options))
    assert got_value == pytest.approx(value, abs=1e-12)
    for got_row, want_row in zip(got_grad, grad):
        assert got_row == pytest.approx(want_row, abs=1e-12)
    assert metrics["pg_loss"] == pytest.approx(value)


def test_variant_metrics():
    _, _, tis = _run("tis", PolicyLossOptions())
    assert tis["tis_upper_clipfrac"] == pytest.approx(1 / 3)  # r = 1.5 (1.05 is padding)
    _, _, ppo = _run("ppo", PolicyLossOptions())
    assert ppo["clipfrac_high"] == pytest.approx(1 / 3)
    _, _, cispo = _run("cispo", PolicyLossOptions())
    assert (cispo["cispo_upper_clipfrac"], cispo["cispo_lower_clipfrac"]) == (pytest.approx(1 / 3),) * 2


def test_cispo_unified_mask_drops_the_tokens_ppo_would_clip():
    # A > 0 and r = 1.5 > 1.1: dropped; A < 0 and r = 0.9 is not below 0.9: kept.
    value, grad, metrics = _run("cispo", PolicyLossOptions(cispo_use_unified_mask=True))
    assert value == pytest.approx((-0.9 * L[0][1] + 0.9 * L[1][0]) / N)
    assert grad[0] == pytest.approx([0.0, -0.9 / N]) and grad[1] == pytest.approx([0.9 / N, 0.0])
    assert metrics["cispo_masked_frac"] == pytest.approx(1 / 3)


def test_tis_bounds_and_off_policy_weights_multiply():
    # tis_upper_bound 2: weights 1.5, 0.5, 0.9; is_weights [2, 1 | 1, 1] double the first token.
    value, grad, _ = _run(
        "tis", PolicyLossOptions(tis_upper_bound=2.0), is_weights=torch.tensor([[2.0, 1], [1, 1]])
    )
    assert value == pytest.approx((-2 * 1.5 * L[0][0] - 0.5 * L[0][1] + 0.9 * L[1][0]) / N)
    assert grad[0][0] == pytest.approx(-3.0 / N)


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(
        ValueError, match="pg_variant: unknown 'grpo'; known: ppo, gspo, vanilla, tis, topr, cispo"
    ):
        get_policy_loss("grpo")


ROLL_OFFPOLICY = """\
exp_name: qwen2.5-7B-rlvr-offpolicy-${pg_variant}
pg_variant: topr
tis_upper_bound: 1.5
actor_train:
  worker_cls: roll.pipeline.rlvr.actor_pg_worker.ActorPGWorker
  pg_variant: topr
  topr_negative_weight: 0.5
  strategy_args: {strategy_name: fsdp2_train}
actor_infer:
  strategy_args: {strategy_name: hf_infer}
"""


def test_roll_file_pg_variant_and_options_load_and_train(tmp_path):
    path = tmp_path / "rlvr_config.yaml"
    path.write_text(ROLL_OFFPOLICY)
    cfg = load_config(path)
    assert cfg.exp_name == "qwen2.5-7B-rlvr-offpolicy-topr"
    assert cfg.pg_variant == "topr"
    assert (cfg.policy_loss.topr_negative_weight, cfg.policy_loss.tis_upper_bound) == (0.5, 1.5)
    loss_fn = make_actor_loss_fn(cfg)
    batch = Batch.from_dict(
        {
            "advantages": torch.tensor(A),
            "response_mask": torch.tensor(MASK),
            "old_log_probs": torch.zeros(2, 2),
            "scores": torch.tensor([1.0, 0.0]),
        }
    )
    log_probs = torch.tensor(L, requires_grad=True)
    loss, metrics = loss_fn({"log_probs": log_probs}, batch)
    assert loss.item() == pytest.approx(CASES["topr"][1], rel=1e-5)
    assert metrics["actor/topr_positive_frac"] == 0.5


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["pg_variant=grpo"],
            "pg_variant: expected one of ['ppo', 'gspo', 'vanilla', 'tis', 'topr', 'cispo', 'kimi15'], got 'grpo'",
        ),
        (["actor_train.pg_variant=cispo", "pg_variant=topr"], "actor_train.pg_variant='cispo' (conflicts"),
        (["policy_loss.tis_lower_bound=1.0"], "tis_lower_bound: must be below tis_upper_bound"),
    ],
)
def test_bad_pg_variant_settings_are_one_line_naming_the_key(tmp_path, capsys, overrides, words):
    files = make_launch_files(tmp_path)
    argv = ["--config_name", "rlvr_config", "--config_path", str(EXAMPLES), "--dry_run"]
    code = main([*argv, *launch_overrides(files), *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err
