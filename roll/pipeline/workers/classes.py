"""The cluster and worker classes each role runs: reward roles score, every other role runs a model.

    cluster_cls, worker_cls = role_classes("actor_infer")   # (ModelCluster, ModelWorker)

The RLVR start-up builds each role's cluster from these, and a host process preloads the worker's
module; tests swap this function to start workers that inject faults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roll.core.roles import Role

if TYPE_CHECKING:
    from roll.distributed.executor.worker import Worker
    from roll.distributed.scheduler.cluster import Cluster


def role_classes(role: str) -> tuple[type[Cluster], type[Worker]]:
    """The cluster and worker classes of role key ``role`` (imported here, on first use)."""
    from roll.pipeline.workers.model_worker import ModelCluster, ModelWorker
    from roll.pipeline.workers.reward_worker import RewardCluster, RewardWorker

    return (RewardCluster, RewardWorker) if Role.parse(role).is_reward else (ModelCluster, ModelWorker)
