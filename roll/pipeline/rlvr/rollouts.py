"""One step's scored rollouts: prompts drawn, generated and rewarded, in DAPO dynamic-sampling
rounds when ``dynamic_sampling.enabled``, then shaped by the overlong penalty.

    batch, metrics = collect_rollouts(run, step, params, timer)   # len(batch) == rollout_batch_size * n

Without dynamic sampling this is one round: sample, generate, reward. With it, every round draws
``rollout_batch_size`` new prompts, keeps the groups whose scores differ and stops once
``rollout_batch_size`` groups are kept or after ``max_rounds``; a short step is filled with dropped
groups. Every row records the weight version it was generated with (``weight_version`` [B]).
Metrics: ``rollout/weight_version``, ``rollout/staleness`` (versions behind step - 1, the synchronous
case), ``dynamic_sampling/{rounds,groups_drawn,groups_dropped,groups_filled}``,
``overlong/{truncated_frac,penalty_mean}``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.pipeline.rlvr import stages
from roll.pipeline.rlvr.algorithms.dapo import informative_groups, overlong_penalty, truncated_rows
from roll.pipeline.rlvr.data.sampler import to_batch
from roll.pipeline.rlvr.run import RLVRRun


def sample_prompts(run: RLVRRun, step: int, round_: int = 0) -> Batch:
    prompts = to_batch(
        run.sampler.next_batch(), run.tokenizer.pad_token_id, run.config.prompt_length, run.processor
    )
    prefix = f"{step}" if round_ == 0 else f"{step}.{round_}"
    prompts.non_tensors["group_id"] = np.array([f"{prefix}-{i}" for i in range(len(prompts))], dtype=object)
    return prompts


def collect_rollouts(
    run: RLVRRun, step: int, params: SamplingParams, timer
) -> tuple[Batch, dict[str, float]]:
    """Generate and score ``rollout_batch_size`` prompt groups for ``step`` (see the module doc)."""
    config = run.config
    version = run.weight_version  # fixed while this runs: weights change only between steps
    sampling = config.dynamic_sampling
    rounds = sampling.max_rounds if sampling.enabled else 1
    n = params.n
    kept: list[Batch] = []
    dropped: list[Batch] = []
    metrics = {"dynamic_sampling/groups_drawn": 0.0, "dynamic_sampling/groups_dropped": 0.0}
    for round_ in range(rounds):
        prompts = sample_prompts(run, step, round_)
        round_params = dataclasses.replace(
            params, seed=None if params.seed is None else params.seed + 7919 * round_
        )
        with timer("generate"):
            batch = stages.generate_rollouts(run, prompts, round_params)
        with timer("reward"):
            batch = stages.compute_rewards(run, batch)
        batch.tensors["weight_version"] = torch.full((len(batch),), version, dtype=torch.long)
        if not sampling.enabled:
            return shape_overlong(run, batch, metrics=_version_metrics(step, version))
        keep, drop = informative_groups(batch["scores"], batch["group_id"].tolist())
        kept.append(batch.index(keep))
        dropped.append(batch.index(drop))
        metrics["dynamic_sampling/groups_drawn"] += len(prompts)
        metrics["dynamic_sampling/groups_dropped"] += len(drop) // n
        if sum(len(b) for b in kept) >= config.rollout_batch_size * n:
            break
    metrics["dynamic_sampling/rounds"] = float(round_ + 1)
    batch, filled = _assemble(kept, dropped, config.rollout_batch_size * n)
    metrics["dynamic_sampling/groups_filled"] = filled / n
    metrics |= _version_metrics(step, version)
    return shape_overlong(run, batch, metrics)


def _version_metrics(step: int, version: int) -> dict[str, float]:
    return {"rollout/weight_version": float(version), "rollout/staleness": float(step - 1 - version)}


def _assemble(kept: list[Batch], dropped: list[Batch], rows: int) -> tuple[Batch, int]:
    """The first ``rows`` kept rows (whole groups, as rows come in groups of n), topped up with
    dropped groups when there are too few; returns the batch and how many rows were topped up."""
    parts = [b for b in kept if len(b)]
    have = sum(len(b) for b in parts)
    filled = max(rows - have, 0)
    if filled:
        parts += [b for b in dropped if len(b)]
    return Batch.concat(parts).index(slice(0, rows)), filled


def shape_overlong(run: RLVRRun, batch: Batch, metrics: dict[str, float]) -> tuple[Batch, dict[str, float]]:
    """Mark truncated rows (``truncated`` [B], read by the overlong filter in ``stages.train_models``)
    and add the soft overlong penalty to ``scores``."""
    overlong = run.config.overlong
    mask = batch["response_mask"]
    eos = [i for i in (run.tokenizer.eos_token_id, run.tokenizer.pad_token_id) if i is not None]
    batch.tensors["truncated"] = truncated_rows(batch["responses"], mask, eos)
    metrics["overlong/truncated_frac"] = batch["truncated"].float().mean().item()
    if overlong.buffer_length > 0:
        penalty = overlong_penalty(
            mask.sum(-1), run.config.response_length, overlong.buffer_length, overlong.penalty_factor
        )
        batch.tensors["scores"] = batch["scores"] + penalty.to(batch["scores"].dtype)
        metrics["overlong/penalty_mean"] = penalty.mean().item()
    return batch, metrics
