"""``recompute_old_log_probs``: with one optimizer step per RL step the training forward gives the
old log-probs, so ``auto`` skips their separate pass. Checked here: the same loss, gradient norm,
updated weights, old log-probs and off-policy weights with and without the pass (fp32, tiny model,
fsdp2_train on one gloo rank), and that the pass still runs wherever it is not the same."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from test_fsdp2_strategy import global_batch, make_strategy  # noqa: E402
from tiny_models import build_tiny_model_dir  # noqa: E402

from roll.configs.pipeline_config import RLVRConfig  # noqa: E402
from roll.configs.rl_options import OffPolicyCorrectionConfig, OverlongConfig  # noqa: E402
from roll.configs.role import RoleConfig, StrategyArgs, TrainingArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.loss import ROW_INDEX, LogProbRecorder  # noqa: E402
from roll.pipeline.rlvr import stages  # noqa: E402
from roll.pipeline.rlvr.algorithms.losses import make_actor_loss_fn  # noqa: E402
from roll.pipeline.rlvr.algorithms.off_policy import correction_weights  # noqa: E402
from roll.pipeline.workers.model_worker import ModelWorker, in_row_order  # noqa: E402

torch.set_num_threads(1)
MICRO = 2  # rows per micro-batch; the 4-row batch is one optimizer step of 2 micro-batches


def rl_config(**overrides) -> RLVRConfig:
    train = RoleConfig(
        training_args=TrainingArgs(per_device_train_batch_size=MICRO, gradient_accumulation_steps=2),
        strategy_args=StrategyArgs("fsdp2_train"),
    )
    defaults = {
        "use_kl_loss": True,
        "kl_loss_coef": 0.01,
        "off_policy_correction": OffPolicyCorrectionConfig(mode="tis", level="token", cap=1.05),
    }
    return RLVRConfig(actor_train=train, actor_infer=RoleConfig(), **(defaults | overrides))


def rl_batch() -> Batch:
    batch = global_batch()
    mask = batch["response_mask"].float()
    gen = torch.Generator().manual_seed(1)
    batch.tensors["advantages"] = torch.tensor([[1.0], [-0.5], [0.25], [-1.0]]) * mask
    batch.tensors["ref_log_probs"] = (-5.0 + 0.1 * torch.randn(mask.shape, generator=gen)) * mask
    return batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def group():
    owns = not dist.is_initialized()
    yield
    if owns and dist.is_initialized():
        dist.destroy_process_group()


def fresh(model_dir):
    return make_strategy(model_dir, 0, 1, lr=1e-2, sequence_packing=False)


def weights(strategy) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in strategy.iter_hf_weights()}


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_train_forward_gives_the_old_log_probs_and_the_same_update(model_dir, group, level):
    config = rl_config(off_policy_correction=OffPolicyCorrectionConfig(mode="tis", level=level, cap=1.05))
    loss_fn = make_actor_loss_fn(config)
    correction = config.off_policy_correction

    # With the pass: old log-probs from compute_log_probs, weights on the driver (stages).
    with_pass = fresh(model_dir)
    batch = rl_batch()
    before_update = with_pass.compute_log_probs(batch)
    old = before_update["log_probs"]
    # The engine's log-probs: close to the trainer's, some tokens past the cap.
    infer = (old - 0.1 * torch.rand(old.shape, generator=torch.Generator().manual_seed(2))) * batch[
        "response_mask"
    ]
    batch.tensors["infer_logprobs"] = infer
    full = batch.union(Batch.from_dict({"old_log_probs": old}))
    full.tensors["is_weights"] = correction_weights(
        old, infer, batch["response_mask"], correction.mode, correction.level, correction.cap
    )
    assert (full["is_weights"][batch["response_mask"] > 0] == correction.cap).any()  # the cap is active
    metrics_pass = with_pass.train_step(full.split(MICRO), loss_fn)

    # Without: the loss records its forward's log-probs and computes the weights from them.
    without = fresh(model_dir)
    recorder = LogProbRecorder(loss_fn)
    indexed = batch.union(Batch.from_dict({ROW_INDEX: torch.arange(len(batch))}))
    metrics_skip = without.train_step(indexed.split(MICRO), recorder)
    recorded = in_row_order(recorder.batch(), len(batch), "actor_train")

    torch.testing.assert_close(recorded["old_log_probs"], old, rtol=0, atol=1e-6)
    torch.testing.assert_close(recorded["entropy"], before_update["entropy"], rtol=0, atol=1e-6)
    for key in ("loss", "actor/pg_loss", "actor/kl_loss", "actor/total_loss", "grad_norm"):
        assert metrics_skip[key] == pytest.approx(metrics_pass[key], rel=1e-6, abs=1e-8), key
    assert metrics_pass["grad_norm"] > 0
    before, after_pass, after_skip = weights(fresh(model_dir)), weights(with_pass), weights(without)
    for name, tensor in after_pass.items():
        torch.testing.assert_close(after_skip[name], tensor, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(before[name], after_pass[name]) for name in before)  # the step moved them


def test_recorder_keeps_rows_in_any_order_and_names_missing_ones():
    parts = [
        Batch.from_dict({ROW_INDEX: torch.tensor([2, 0]), "log_probs": torch.tensor([[2.0], [0.0]])}),
        Batch.from_dict({ROW_INDEX: torch.tensor([1, 3]), "log_probs": torch.tensor([[1.0], [3.0]])}),
    ]
    out = in_row_order(Batch.concat(parts), 4, "actor_train")
    assert out["old_log_probs"].flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match=r"rows \[1, 3\]"):
        in_row_order(parts[0], 4, "actor_train")
    assert LogProbRecorder(make_actor_loss_fn(rl_config())).keywords["loss_agg_mode"] == "token-mean"


class FakeActor:
    """A ModelCluster stand-in that records which calls the stages make."""

    dp_size = 2

    def __init__(self) -> None:
        self.calls: list[str] = []

    def compute_log_probs(self, batch: Batch, output_key: str) -> Batch:
        self.calls.append("compute_log_probs")
        return Batch.from_dict({output_key: torch.full(batch["responses"].shape, -1.0)})

    def train_step(self, batch, loss_fn, seed, ppo_epochs):
        self.calls.append(f"train_step:{ppo_epochs}")
        return [{"loss": 0.0}] * self.dp_size

    def train_step_with_log_probs(self, batch, loss_fn, seed):
        self.calls.append("train_step_with_log_probs")
        assert "old_log_probs" not in batch and "infer_logprobs" in batch  # the loss computes the weights
        shape = batch["responses"].shape
        recorded = Batch.from_dict({"old_log_probs": torch.full(shape, -2.0), "entropy": torch.ones(shape)})
        return [{"loss": 0.0}] * self.dp_size, recorded


def fake_run(config: RLVRConfig) -> SimpleNamespace:
    actor = FakeActor()
    return SimpleNamespace(
        config=config, colocated=set(), clusters={"actor_train": actor}, model=lambda role: actor
    )


def one_step(run: SimpleNamespace, rows: int = 8) -> Batch:
    """The stages between the reference and the metrics, as run_pipeline calls them."""
    width = 3
    ids = torch.ones(rows, 2 * width, dtype=torch.long)
    batch = Batch.from_dict(
        {
            **{key: ids for key in ("input_ids", "attention_mask", "position_ids")},
            **{key: ids[:, :width] for key in ("prompts", "prompt_mask", "responses")},
            "response_mask": torch.ones(rows, width),
            "advantages": torch.zeros(rows, width),
            "infer_logprobs": torch.full((rows, width), -2.1),
        }
    )
    batch = stages.compute_old_log_probs(run, batch)
    batch = stages.compute_off_policy_weights(run, batch)
    batch, _ = stages.train_models(run, batch, step=1)
    return batch


@pytest.mark.parametrize("strategy", ["fsdp2_train", "megatron_train"])
def test_auto_skips_the_pass_and_takes_the_train_forwards_log_probs(strategy):
    config = rl_config()
    config = replace(config, actor_train=replace(config.actor_train, strategy_args=StrategyArgs(strategy)))
    run = fake_run(config)
    batch = one_step(run)
    assert run.model("actor_train").calls == ["train_step_with_log_probs"]
    assert batch["old_log_probs"].unique().tolist() == [-2.0] and "entropy" in batch
    assert stages.off_policy_metrics(run, batch)["off_policy/ratio_mean"] == pytest.approx(
        torch.exp(torch.tensor(0.1)).item()
    )


def per_rank_steps(**training) -> RLVRConfig:
    config = rl_config()
    return replace(config, actor_train=replace(config.actor_train, training_args=TrainingArgs(**training)))


@pytest.mark.parametrize(
    "config",
    [
        rl_config(recompute_old_log_probs="always"),
        rl_config(ppo_epochs=2),
        per_rank_steps(per_device_train_batch_size=2, gradient_accumulation_steps=1),  # 4 rows/rank: 2 steps
        rl_config(add_token_level_kl=True),
        rl_config(overlong=OverlongConfig(filter=True)),
    ],
    ids=[
        "always",
        "ppo_epochs_2",
        "two_optimizer_steps",
        "kl_in_reward",
        "overlong_filter",
    ],
)
def test_the_pass_runs_where_the_train_forward_is_not_the_same(config):
    run = fake_run(config)
    batch = one_step(run)
    calls = run.model("actor_train").calls
    assert calls == ["compute_log_probs", f"train_step:{config.ppo_epochs}"]
    assert batch["old_log_probs"].unique().tolist() == [-1.0] and "is_weights" in batch


@pytest.mark.parametrize(("rows", "epochs", "steps"), [(4, 1, 2), (2, 2, 2)])
def test_the_worker_refuses_to_record_over_several_optimizer_steps(rows, epochs, steps):
    worker = SimpleNamespace(
        role="actor_train",
        role_config=RoleConfig(
            training_args=TrainingArgs(per_device_train_batch_size=2, gradient_accumulation_steps=1)
        ),
    )
    batch = Batch.from_dict({"x": torch.zeros(rows)})
    with pytest.raises(
        ValueError, match=f"record_log_probs needs one optimizer step, .* make {steps} of 2 rows"
    ):
        ModelWorker.train_step(worker, batch, lambda o, m: None, 0, epochs, record_log_probs=True)
