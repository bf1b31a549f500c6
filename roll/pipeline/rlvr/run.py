"""``RLVRRun``: everything one run holds (config, clusters, data, tracker), and how it is built.

``build_run`` turns a validated config into a live run: Ray placement, one cluster per role,
the prompt data, the model-update group and the tracker. ``shutdown`` releases it all.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import GeneratingArgs
from roll.core.batch import Batch
from roll.core.roles import Role
from roll.distributed.scheduler.placement import PlacementPlan, plan_placement
from roll.pipeline.common.run_log import setup_logging
from roll.pipeline.common.timing import StageTimer
from roll.pipeline.rlvr.perf import SwapTimes

if TYPE_CHECKING:
    from roll.distributed.executor.worker import Worker
    from roll.distributed.scheduler.cluster import Cluster
    from roll.pipeline.workers.model_worker import ModelCluster
    from roll.pipeline.workers.reward_worker import RewardCluster

logger = logging.getLogger("roll")


@dataclass
class RLVRRun:
    config: RLVRConfig
    plan: PlacementPlan
    run_dir: Path
    tokenizer: Any
    sampler: Any
    clusters: dict[str, Cluster] = field(default_factory=dict)
    resources: Any = None
    # Host processes on CPU slots (``startup.start_hosts``); their members are the clusters' workers.
    hosts: list = field(default_factory=list)
    model_update: Any = None
    tracker: Any = None
    val_prompts: Batch | None = None
    val_generating_args: GeneratingArgs | None = None
    val_batch_size: int = 64
    # Roles that time-share devices with another role: reloaded before use and offloaded after
    # (on CPU slots only those whose strategy offloads there; see ``startup.offloaded_roles``).
    colocated: set[str] = field(default_factory=set)
    # tag -> reward role name
    tag_routes: dict[str, str] = field(default_factory=dict)
    default_reward: str | None = None
    show_progress: bool = True
    # The version actor_infer generates with (the step whose weights were synced last; 0: the initial ones).
    weight_version: int = 0
    # actor_infer drops its weights when it sleeps (vLLM sleep_level 2, colocated): every wake to
    # generate refills them by a model update (stages.engine_awake); see ``startup.refills_on_wake``.
    refill_on_wake: bool = False
    # Seconds the colocated roles spent reloading and offloading this step (``swap/*`` metrics).
    swaps: SwapTimes = field(default_factory=SwapTimes)

    def model(self, role: str) -> ModelCluster:
        """The cluster of model role ``role`` (actor_train, actor_infer, reference, critic)."""
        return self.clusters[role]  # type: ignore[return-value]

    def reward(self, name: str) -> RewardCluster:
        """The cluster of reward role ``rewards.<name>``."""
        return self.clusters[Role.reward(name).key]  # type: ignore[return-value]

    def reward_routes(self, tags: list[str]) -> dict[str, list[int]]:
        """Row indices per reward role for the given tags."""
        routes: dict[str, list[int]] = {}
        for i, tag in enumerate(tags):
            name = self.tag_routes.get(tag, self.default_reward)
            if name is None:
                raise ConfigError(
                    "rewards", f"no reward role claims tag {tag!r}; add it to a tag_included list"
                )
            routes.setdefault(name, []).append(i)
        return routes

    def progress(self, items: Iterable, desc: str) -> Iterator:
        items = list(items)
        return iter(tqdm(items, desc=desc, leave=False, disable=not self.show_progress or len(items) < 2))


def build_tag_routes(config: RLVRConfig) -> tuple[dict[str, str], str | None]:
    """(tag -> reward role, the role scoring every other tag or None): a role with an empty
    ``tag_included``, or ``default_reward``."""
    routes = {tag: name for name, reward in config.rewards.items() for tag in reward.tag_included}
    catch_all = [name for name, reward in config.rewards.items() if not reward.tag_included]
    if len(catch_all) > 1:
        raise ConfigError(
            f"rewards.{catch_all[1]}.tag_included",
            f"only one reward role may leave tag_included empty (also rewards.{catch_all[0]})",
        )
    if catch_all and config.default_reward not in (None, catch_all[0]):
        raise ConfigError(
            "default_reward",
            f"rewards.{catch_all[0]} already scores every unlisted tag (its tag_included is empty); "
            "give one of the two",
        )
    return routes, (catch_all[0] if catch_all else config.default_reward)


def reward_role_tags(config: RLVRConfig, tags: Iterable[str]) -> dict[str, list[str]]:
    """Each reward role's tags for ``domain_interleave_probs`` keyed by role: its ``tag_included``,
    and for the role scoring unlisted tags (``build_tag_routes``) those of ``tags`` too, so that
    ``math_rule: 0.4`` mixes them in as alibaba/ROLL's math_rule domain does."""
    routes, default = build_tag_routes(config)
    out = {name: list(reward.tag_included) for name, reward in config.rewards.items()}
    if default is not None:
        out[default] += sorted({t for t in tags if t not in routes})
    return out


def load_data(config: RLVRConfig, tokenizer) -> tuple[Any, Batch | None]:
    from roll.pipeline.rlvr.data.dataset import load_prompt_files
    from roll.pipeline.rlvr.data.sampler import PromptSampler, to_batch

    train = load_prompt_files(
        config.actor_train.data_args, tokenizer, config.prompt_length, "actor_train.data_args"
    )
    check_rows_routed(config, train.rows)  # before any worker starts
    sampler = PromptSampler(
        train,
        config.rollout_batch_size,
        config.seed,
        config.actor_train.data_args.domain_interleave_probs,
        path="actor_train.data_args.domain_interleave_probs",
        role_tags=reward_role_tags(config, train.domains()),
    )
    val = None
    if config.validation is not None and config.validation.data_args.file_name:
        rows = load_prompt_files(
            config.validation.data_args, tokenizer, config.prompt_length, "validation.data_args"
        )
        check_rows_routed(config, rows.rows)
        val = to_batch([rows[i] for i in range(len(rows))], tokenizer.pad_token_id, config.prompt_length)
        val.non_tensors["group_id"] = np.array([f"val-{i}" for i in range(len(val))], dtype=object)
    return sampler, val


def check_rows_routed(config: RLVRConfig, rows: Iterable[Any]) -> None:
    """Every prompt row's tag has a reward role; else one ConfigError naming the first unclaimed
    row by ``file:line`` (``PromptRow.source``)."""
    routes, catch_all = build_tag_routes(config)
    if catch_all is not None:
        return
    for row in rows:
        if row.tag not in routes:
            raise ConfigError(
                "rewards",
                f"no reward role claims tag {row.tag!r} of the prompt row {row.source}; add it to a "
                "role's tag_included, or leave one role's tag_included empty to score every other tag",
            )


def role_classes(role: str) -> tuple[type[Cluster], type[Worker]]:
    """The cluster and worker classes of a role: reward roles score, every other role runs a model."""
    from roll.pipeline.workers.model_worker import ModelCluster, ModelWorker
    from roll.pipeline.workers.reward_worker import RewardCluster, RewardWorker

    return (RewardCluster, RewardWorker) if Role.parse(role).is_reward else (ModelCluster, ModelWorker)


def build_run(config: RLVRConfig, timer: StageTimer | None = None) -> RLVRRun:
    """Plan, data, workers (``startup.start_clusters``) and the model-update group; ``timer``
    records the start-up phases (``startup/*`` metrics)."""
    from roll.models.tokenizer import load_tokenizer
    from roll.pipeline.rlvr.startup import offloaded_roles, refills_on_wake, start_clusters

    timer = timer or StageTimer()
    run_dir = Path(config.output_dir)
    setup_logging(run_dir)
    plan = plan_placement(config)
    with timer("data"):
        tokenizer = load_tokenizer(config.actor_train.model_args.model_name_or_path)
        sampler, val = load_data(config, tokenizer)
    routes, default = build_tag_routes(config)
    run = RLVRRun(config, plan, run_dir, tokenizer, sampler, tag_routes=routes, default_reward=default)
    run.val_prompts = val
    if config.validation is not None:
        run.val_generating_args = config.validation.generating_args
        run.val_batch_size = config.validation.val_batch_size or config.rollout_batch_size
    run.colocated = offloaded_roles(config, plan)
    run.refill_on_wake = refills_on_wake(config, run.colocated)
    try:
        start_clusters(run, timer)
        with timer("model_update_setup"):
            run.model_update = _build_model_update(run)
    except BaseException:
        shutdown(run, graceful=False)  # the caller has no run to shut down yet
        raise
    return run


def _build_model_update(run: RLVRRun):
    from roll.distributed.model_update.group import ModelUpdateGroup

    group = ModelUpdateGroup(run.model("actor_train"), run.model("actor_infer"), run.config)
    group.setup()
    return group


def shutdown(run: RLVRRun | None, graceful: bool = True) -> None:
    """Stop every role's workers (``graceful``: let them leave their process groups first) and give
    the devices back."""
    if run is None:
        return
    for cluster in run.clusters.values():
        try:
            cluster.shutdown(graceful=graceful)
        except Exception as exc:  # noqa: BLE001 - best effort while tearing down
            logger.warning("shutting down %s: %s", getattr(cluster, "role", "?"), exc)
    for host in run.hosts:  # those whose members never started (another role failed first)
        host.kill()
    if run.resources is not None:  # after a failure the driver is leaving: do not wait long
        run.resources.destroy(timeout_s=30.0 if graceful else 1.0)
