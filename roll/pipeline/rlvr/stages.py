"""The stages of one RLVR step, each a named function over the run and the step's Batch.

``roll.pipeline.rlvr.pipeline.run_pipeline`` calls them in order; each one reads the fields the
previous ones wrote (see roll/distributed/strategy/base.py for the field layout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch

from roll.configs.strategies import get_strategy_spec
from roll.core.batch import Batch
from roll.core.roles import Role
from roll.core.sampling import SamplingParams
from roll.models.vision import MULTI_MODAL_DATA, MULTI_MODAL_INPUTS
from roll.pipeline.rewards.health import check_reward_result, reward_error_metrics
from roll.pipeline.rlvr.algorithms.advantages import compute_advantages, token_level_rewards_from_config
from roll.pipeline.rlvr.algorithms.kl import kl_penalty
from roll.pipeline.rlvr.algorithms.losses import make_actor_loss_fn, make_critic_loss_fn
from roll.pipeline.rlvr.algorithms.masked import masked_mean
from roll.pipeline.rlvr.algorithms.metrics import (
    logprob_mismatch,
    masked_stats,
    response_length_stats,
    score_stats_by_domain,
)
from roll.pipeline.rlvr.algorithms.off_policy import correction_weights, importance_weights
from roll.pipeline.rlvr.algorithms.policy_losses import READS_SCORES
from roll.pipeline.rlvr.algorithms.sample_options import apply_sample_options, normalize_scores
from roll.pipeline.rlvr.data.vision import with_vision_fields
from roll.pipeline.rlvr.run import RLVRRun


@contextlib.contextmanager
def on_devices(run: RLVRRun, role: str) -> Iterator[None]:
    """Bring a colocated role's states onto its devices for the block, and move them off after,
    so roles that time-share devices never hold memory at the same time.

    A block that raises leaves the states where they are: the run is ending, the failed role's
    workers are already stopped (asking them to offload would replace the WorkerError with a
    second error), and a healthy role may be blocked in a collective with the dead one."""
    cluster = run.model(role)
    shared = role in run.colocated
    if shared:
        with run.swaps.timed(role, "reload"):
            cluster.reload_states()
    yield
    if shared:
        with run.swaps.timed(role, "offload"):
            cluster.offload_states()


@contextlib.contextmanager
def engine_awake(run: RLVRRun) -> Iterator[None]:
    """actor_infer ready to generate for the block: on its devices and, where sleeping drops its
    weights (``run.refill_on_wake``: vLLM ``sleep_level: 2`` or SGLang with its memory saver, colocated with its trainer), refilled
    by a model update right after the wake, so the engine is woken, updated and used with no
    offload in between."""
    with on_devices(run, "actor_infer"):
        if run.refill_on_wake:
            with run.swaps.timed("actor_infer", "refill"):  # swap/actor_infer/refill_s
                sync_engine_weights(run, run.weight_version)
        yield


def sync_engine_weights(run: RLVRRun, version: int) -> dict[str, float]:
    """Move actor_train's weights into the (awake) engines as ``version``. A colocated trainer's
    gradients and optimizer state stay offloaded: the export brings back its parameters only (when
    offload_params moved them), and they leave again after the sync."""
    metrics = run.model_update.sync(version=version)
    run.weight_version = version
    if "actor_train" in run.colocated:
        run.model("actor_train").offload_states()
    return metrics


def dp_call(dp_size: int, compute: Callable[[Batch], Batch], batch: Batch, rows_per_input: int = 1) -> Batch:
    """Run ``compute`` (a cluster's DP_COMPUTE call) on a batch of any size: pad it to a multiple of
    ``dp_size`` (repeating the last row), then drop the padding's outputs."""
    size = len(batch)
    pad = (-size) % dp_size
    if pad:
        batch = Batch.concat([batch, batch.index([size - 1] * pad)])
    out = compute(batch)
    return out.index(slice(0, size * rows_per_input)) if pad else out


def generate_rollouts(run: RLVRRun, prompts: Batch, params: SamplingParams) -> Batch:
    """``actor_infer`` samples ``params.n`` responses per prompt; rows i*n..i*n+n-1 belong to prompt i."""
    infer = run.model("actor_infer")
    with engine_awake(run):
        batch = dp_call(infer.dp_size, lambda b: infer.generate(b, params), prompts, rows_per_input=params.n)
    batch.non_tensors.pop(MULTI_MODAL_DATA, None)  # the images, for the engine only
    texts = run.tokenizer.batch_decode(
        [row[mask.bool()].tolist() for row, mask in zip(batch["responses"], batch["response_mask"])],
        skip_special_tokens=True,
    )
    batch.non_tensors["response_text"] = np.array(texts, dtype=object)
    return batch


def compute_rewards(run: RLVRRun, batch: Batch) -> Batch:
    """Route each row by its tag to the reward role that claims it; gather ``scores`` [B] and the
    per-sample ``reward_error`` / ``reward_timeout`` flags (a role failing on too many samples
    ends the run, see ``rewards.health``)."""
    scores = torch.full((len(batch),), float("nan"))
    flags = {key: torch.zeros(len(batch)) for key in ("reward_error", "reward_timeout")}
    tags = [str(t) for t in batch["tag"]]
    for name, rows in run.reward_routes(tags).items():
        fields = ["response_text", "ground_truth", "prompt_text", "tag"]
        part = batch.index(rows).select(fields + [k for k in ROW_CONTEXT_FIELDS if k in batch])
        part.meta["reward_samples"] = len(part)  # the whole call's, for each worker's early stop
        scorer = run.reward(name)
        result = dp_call(scorer.dp_size, scorer.compute_rewards, part)
        check_reward_result(Role.reward(name).key, run.config.rewards[name], result)
        scores[torch.as_tensor(rows)] = result["scores"]
        for key, flag in flags.items():
            if key in result:
                flag[torch.as_tensor(rows)] = result[key].float()
    batch.tensors["scores"] = scores
    batch.tensors.update(flags)
    return batch


def compute_reference_log_probs(run: RLVRRun, batch: Batch) -> Batch:
    """``ref_log_probs`` [B, R] from the reference model (for the KL terms); nothing without one."""
    if "reference" not in run.clusters:
        return batch
    return _log_probs(run, batch, "reference", "ref_log_probs")


def compute_old_log_probs(run: RLVRRun, batch: Batch) -> Batch:
    """The trainer's log-probs before the update: the PPO ratio's denominator and the measure of
    train/inference mismatch. Left to the training forward (``train_models`` puts them in the batch)
    where ``old_log_probs_from_train`` says that gives the same values."""
    if old_log_probs_from_train(run, batch):
        return batch
    return _log_probs(run, batch, "actor_train", "old_log_probs")


def _log_probs(run: RLVRRun, batch: Batch, role: str, output_key: str) -> Batch:
    """The batch with ``output_key``: ``role``'s log-probs of the sampled responses, one forward
    split over its data-parallel ranks while the role is on its devices."""
    model = run.model(role)
    with on_devices(run, role):
        out = dp_call(
            model.dp_size, lambda b: model.compute_log_probs(b, output_key=output_key), _model_inputs(batch)
        )
    return batch.union(out)


def old_log_probs_from_train(run: RLVRRun, batch: Batch) -> bool:
    """Whether the training forward gives exactly the old log-probs (``recompute_old_log_probs:
    auto``): the step is one optimizer step over the whole batch (one PPO epoch, each rank's rows one
    mini-batch), so every micro-batch's forward runs before the update, and nothing reads them
    before training (``add_token_level_kl`` puts them into the rewards; ``overlong.filter`` masks
    rows out of the training batch that the metrics still read). The strategy must return them
    (its registry row's ``records_train_log_probs``)."""
    config = run.config
    if config.recompute_old_log_probs == "always" or config.ppo_epochs != 1:
        return False
    if config.add_token_level_kl or config.overlong.filter:
        return False
    if not get_strategy_spec(config.actor_train.strategy_args.strategy_name).records_train_log_probs:
        return False
    args = config.actor_train.training_args
    rows_per_rank = -(-len(batch) // run.model("actor_train").dp_size)
    return rows_per_rank <= args.per_device_train_batch_size * args.gradient_accumulation_steps


def compute_off_policy_weights(run: RLVRRun, batch: Batch) -> Batch:
    """``is_weights`` [B, R] from ``off_policy_correction`` (TIS / MIS of old_log_probs over the
    engine's infer_logprobs); nothing when the mode is ``none``, or when the old log-probs come
    from the training forward (the loss computes the same weights from them)."""
    correction = run.config.off_policy_correction
    if correction.mode == "none":
        return batch
    if "infer_logprobs" not in batch:
        strategy = run.config.actor_infer.strategy_args.strategy_name
        raise RuntimeError(
            f"off_policy_correction.mode={correction.mode!r} needs the engine's log-probs, and actor_infer "
            f"({strategy}) returned none; set off_policy_correction.mode: none"
        )
    if "old_log_probs" in batch:
        batch.tensors["is_weights"] = correction_weights(
            batch["old_log_probs"], batch["infer_logprobs"], batch["response_mask"],
            correction.mode, correction.level, correction.cap,
        )  # fmt: skip
    return batch


def off_policy_metrics(run: RLVRRun, batch: Batch) -> dict[str, float]:
    """``off_policy/*`` (``importance_weights``) of the step's old log-probs, after training (they
    may come from the training forward); nothing when the correction is off."""
    correction = run.config.off_policy_correction
    if correction.mode == "none":
        return {}
    _, metrics = importance_weights(
        batch["old_log_probs"], batch["infer_logprobs"], batch["response_mask"],
        correction.mode, correction.level, correction.cap,
    )  # fmt: skip
    return metrics


def compute_values(run: RLVRRun, batch: Batch) -> Batch:
    if "critic" not in run.clusters:
        return batch
    critic = run.model("critic")
    with on_devices(run, "critic"):
        out = dp_call(critic.dp_size, critic.compute_values, _model_inputs(batch))
    return batch.union(out)


def compute_advantages_stage(run: RLVRRun, batch: Batch) -> tuple[Batch, dict[str, float]]:
    config = run.config
    mask, groups = batch["response_mask"], batch["group_id"].tolist()
    scores = batch["scores"]
    if config.norm_mean_type or config.norm_std_type:
        scores = normalize_scores(scores, groups, config.norm_mean_type, config.norm_std_type)
    rewards, metrics = token_level_rewards_from_config(
        config, scores, mask, batch.tensors.get("old_log_probs"), batch.tensors.get("ref_log_probs")
    )
    advantages, returns = compute_advantages(config, rewards, mask, groups, batch.tensors.get("values"))
    train_mask, advantages, sample_metrics = apply_sample_options(
        config, batch["scores"], mask, groups, advantages
    )
    metrics |= sample_metrics
    batch.tensors.update(
        token_level_rewards=rewards, advantages=advantages, returns=returns, response_mask=train_mask
    )
    metrics |= masked_stats("critic/advantages", advantages, mask)
    metrics |= masked_stats("critic/returns", returns, mask)
    return batch, metrics


def train_models(run: RLVRRun, batch: Batch, step: int) -> tuple[Batch, dict[str, float]]:
    """Train the critic (when configured) and the actor; returns the batch, with ``old_log_probs``
    and ``entropy`` from the actor's training forward when ``compute_old_log_probs`` left them to it,
    and the metrics."""
    config = run.config
    metrics: dict[str, float] = {}
    train_fields = [k for k in _TRAIN_FIELDS + VISION_FIELDS if k in batch]
    if config.off_policy_correction.mode != "none" and "old_log_probs" not in batch:
        train_fields.append("infer_logprobs")  # the loss computes the weights
    if config.pg_variant in READS_SCORES:
        train_fields.append("scores")
    train_batch = batch.select(train_fields)
    if config.overlong.filter and "truncated" in batch:
        # DAPO overlong filtering: truncated responses leave the loss (and its token count).
        keep = (~batch["truncated"]).unsqueeze(-1).to(batch["response_mask"].dtype)
        train_batch.tensors["response_mask"] = batch["response_mask"] * keep
    seed = config.seed + step
    if "critic" in run.clusters:
        with on_devices(run, "critic"):
            out = run.model("critic").train_step(
                train_batch, make_critic_loss_fn(config), seed, config.ppo_epochs
            )
        metrics |= _mean_over_ranks(out, "critic")
    actor, loss_fn = run.model("actor_train"), make_actor_loss_fn(config)
    with on_devices(run, "actor_train"):
        if "old_log_probs" in batch:
            out = actor.train_step(train_batch, loss_fn, seed, config.ppo_epochs)
        else:
            out, recorded = actor.train_step_with_log_probs(train_batch, loss_fn, seed)
            batch = batch.union(recorded)
    return batch, metrics | _mean_over_ranks(out, "actor")


def rollout_metrics(run: RLVRRun, batch: Batch) -> dict[str, float]:
    mask = batch["response_mask"]
    metrics = score_stats_by_domain(batch["scores"], batch["domain"]) | response_length_stats(mask)
    metrics |= reward_error_metrics(batch, run.reward_routes([str(t) for t in batch["tag"]]))
    if "old_log_probs" in batch and "infer_logprobs" in batch:
        mismatch = logprob_mismatch(batch["old_log_probs"], batch["infer_logprobs"], mask)
        metrics |= mismatch | {"rollout/logprob_mismatch": mismatch["train_infer/logprob_abs_diff/mean"]}
    if "ref_log_probs" in batch:
        kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], run.config.kl_loss_type)
        metrics["actor/ref_kl"] = masked_mean(kl, mask.float()).item()
    if "entropy" in batch:
        metrics["rollout/entropy"] = masked_mean(batch["entropy"], mask.float()).item()
    return metrics | off_policy_metrics(run, batch)


def run_validation(run: RLVRRun, step: int) -> dict[str, float]:
    """Score the held-out prompts with the validation sampling settings: ``val/score/mean`` overall
    and per domain."""
    if run.val_prompts is None:
        return {}
    # Nothing reads validation's log-probs: the engine is spared computing them.
    params = run.val_generating_args.sampling_params(seed=run.config.seed + 10_000_019 + step, logprobs=False)
    chunks = []
    size = run.val_batch_size
    for chunk in run.progress(run.val_prompts.split(size), desc=f"validation@{step}"):
        chunk = with_vision_fields(chunk, run.processor)  # a VL run's images, this chunk's only
        chunks.append(compute_rewards(run, generate_rollouts(run, chunk, params)))
    batch = Batch.concat(chunks)
    stats = score_stats_by_domain(batch["scores"], batch["domain"])
    out = {k.replace("critic/score", "val/score"): v for k, v in stats.items()}
    out["val/response_length/mean"] = batch["response_mask"].float().sum(-1).mean().item()
    return out


# Per-row fields that go with the rows where present: a reward's ``reward_context`` (detection:
# options and image size), a vision-language model's inputs (``roll.models.vision``).
ROW_CONTEXT_FIELDS = ("reward_context",)
VISION_FIELDS = (MULTI_MODAL_INPUTS,)

_TRAIN_FIELDS = (
    "input_ids", "attention_mask", "position_ids", "responses", "response_mask", "prompts", "prompt_mask",
    "old_log_probs", "ref_log_probs", "advantages", "returns", "values", "is_weights",
)  # fmt: skip


def _model_inputs(batch: Batch) -> Batch:
    fields = [
        "input_ids",
        "attention_mask",
        "position_ids",
        "responses",
        "response_mask",
        "prompts",
        "prompt_mask",
    ]
    return batch.select(fields + [k for k in VISION_FIELDS if k in batch])


def _mean_over_ranks(per_rank: list[dict[str, float]], prefix: str) -> dict[str, float]:
    keys = per_rank[0].keys() if per_rank else []
    out = {}
    for key in keys:
        name = key if "/" in key else f"{prefix}/{key}"
        out[name] = float(np.mean([m[key] for m in per_rank]))
    return out
