"""The Ray runtime on real GPUs: CUDA_VISIBLE_DEVICES from the bundle probe, colocation, NCCL groups.

Two GPUs: actor_train (2 workers, 1 GPU each) and actor_infer (one engine owning both GPUs, like vLLM
TP=2) share them. Skipped without 2 CUDA devices.
"""

from __future__ import annotations

import os
import sys

import pytest
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RoleConfig, StrategyArgs
from roll.configs.strategy_configs import VLLMConfig
from roll.distributed.executor.dispatch import Dispatch, register
from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.cluster import Cluster
from roll.distributed.scheduler.errors import WorkerError
from roll.distributed.scheduler.placement import plan_placement
from roll.distributed.scheduler.resource_manager import ResourceManager

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class GpuProbeWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def report(self) -> dict:
        return {
            "visible": os.environ["CUDA_VISIBLE_DEVICES"],
            "count": torch.cuda.device_count(),
            "device": str(self.ctx.device),
            "uuid": str(torch.cuda.get_device_properties(0).uuid),
            "backend": dist.get_backend() if dist.is_initialized() else None,
        }

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        value = torch.tensor([float(self.rank)], device=self.ctx.device)
        dist.all_reduce(value)
        return value.item()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, bad_rank: int) -> int:
        if self.rank == bad_rank:
            raise RuntimeError("cuda worker failed")
        dist.all_reduce(torch.ones(1, device=self.ctx.device))  # waits for the failed rank forever
        return self.rank


@pytest.mark.timeout(300, func_only=True)
def test_gpu_workers_see_their_own_gpus_and_talk_over_nccl():
    if ray.is_initialized():
        ray.shutdown()
    engine = StrategyArgs("vllm", VLLMConfig(tensor_parallel_size=2))
    config = RLVRConfig(
        actor_train=RoleConfig(device_mapping=[0, 1]),
        actor_infer=RoleConfig(strategy_args=engine, device_mapping=[0, 1]),
        num_gpus_per_node=2,
    )
    plan = plan_placement(config)
    rm = ResourceManager(plan, "cuda", log_to_driver=False)
    try:
        train = Cluster(
            "actor_train", GpuProbeWorker, rm, plan.roles["actor_train"], config.actor_train, config
        )
        infer = Cluster(
            "actor_infer", GpuProbeWorker, rm, plan.roles["actor_infer"], config.actor_infer, config
        )
        ids = [slot.gpu_id for slot in rm.slots]
        reports = train.call(GpuProbeWorker.report)
        assert [r["visible"] for r in reports] == ids
        assert all(r["count"] == 1 and r["device"] == "cuda:0" and r["backend"] == "nccl" for r in reports)
        assert reports[0]["uuid"] != reports[1]["uuid"]
        assert train.call(GpuProbeWorker.all_reduce_rank) == [1.0, 1.0]
        [engine_report] = infer.call(GpuProbeWorker.report)
        assert engine_report["visible"] == ",".join(ids) and engine_report["count"] == 2
        assert engine_report["uuid"] == reports[0]["uuid"]  # colocated with actor_train rank 0
        with pytest.raises(WorkerError, match="^actor_train rank 1: RuntimeError: cuda worker failed$"):
            train.call(GpuProbeWorker.fail_on, 1)
        infer.shutdown()
    finally:
        rm.destroy()
        ray.shutdown()
