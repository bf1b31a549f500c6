"""``RLVRRun``: everything one run holds (config, clusters, data, tracker) while it runs.

``roll.pipeline.rlvr.start.build_run`` builds it from a validated config (placement, one cluster
per role, the prompt data, the model-update group); the stages read and update it; ``start.shutdown``
releases it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import GeneratingArgs
from roll.core.batch import Batch
from roll.core.roles import Role
from roll.distributed.scheduler.placement import PlacementPlan
from roll.pipeline.common.timing import SwapTimes

if TYPE_CHECKING:
    from roll.distributed.scheduler.cluster import Cluster
    from roll.pipeline.workers.model_worker import ModelCluster
    from roll.pipeline.workers.reward_worker import RewardCluster


@dataclass
class RLVRRun:
    config: RLVRConfig
    plan: PlacementPlan
    run_dir: Path
    tokenizer: Any
    sampler: Any
    clusters: dict[str, Cluster] = field(default_factory=dict)
    # A vision-language model's tokenizer and image processor (roll.models.vision); None for text.
    processor: Any = None
    resources: Any = None
    # Host processes on CPU slots (``prestart.start_hosts``); their members are the clusters' workers.
    hosts: list = field(default_factory=list)
    model_update: Any = None
    tracker: Any = None
    val_prompts: Batch | None = None
    val_generating_args: GeneratingArgs | None = None
    val_batch_size: int = 64
    # Roles that time-share devices with another role: reloaded before use and offloaded after
    # (on CPU slots only those whose strategy offloads there; see ``start.offloaded_roles``).
    colocated: set[str] = field(default_factory=set)
    # tag -> reward role name
    tag_routes: dict[str, str] = field(default_factory=dict)
    default_reward: str | None = None
    show_progress: bool = True
    # The version actor_infer generates with (the step whose weights were synced last; 0: the initial ones).
    weight_version: int = 0
    # actor_infer drops its weights when it sleeps (vLLM sleep_level 2 or SGLang with its memory
    # saver, colocated): every wake to generate refills them by a model update
    # (stages.engine_awake); see ``start.refills_on_wake``.
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
