"""An engine on vLLM's Ray executor across nodes, on CPU: its nodes' placement group, its bundles,
where its worker runs and what that worker's own Ray actors (vLLM's GPU workers) can take.

Three Ray nodes on one machine (``ray.cluster_utils.Cluster``, 2 device slots each as ``ray start
--num-gpus=2`` would): actor_train on node 0 (devices 0-1), one engine at TP 4 on devices 2-5
(nodes 1 and 2). The worker class stands in for the vLLM strategy: it starts one actor per bundle
the way vLLM 0.24's Ray executor does (``PlacementGroupSchedulingStrategy`` on the bundle index,
``num_gpus=VLLM_RAY_PER_WORKER_GPUS``) and reports where each one runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster as RayCluster
from ray.util.placement_group import get_current_placement_group, placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RoleConfig, StrategyArgs
from roll.configs.strategy_configs import MegatronConfig, VLLMConfig
from roll.distributed.executor.dispatch import Dispatch, register
from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.cluster import Cluster
from roll.distributed.scheduler.errors import PlacementError
from roll.distributed.scheduler.machines import NODE_ID_LABEL, GroupLayout, choose_machines, node_selector
from roll.distributed.scheduler.placement import plan_placement
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.distributed.strategy.vllm_strategy import ray_executor_env


def test_group_layout_numbers_bundles_node_by_node():
    layout = GroupLayout(((0,), (1,), (2, 3)), 8)
    assert layout.bundle(5) == (0, 5) and layout.bundle(9) == (1, 1)
    assert layout.bundle(16) == (2, 0) and layout.bundle(27) == (2, 11)
    with pytest.raises(PlacementError, match="device 40 \\(node 5\\) is in no reserved node group"):
        layout.bundle(40)


def test_choose_machines_prefers_distinct_roomy_machines():
    assert choose_machines([(2, 3)], {"a": 0, "b": 1, "c": 1}, 8) == [("b", "c")]
    assert choose_machines([(2, 3), (4, 5)], {"a": 2, "b": 1, "c": 1}, 8) == [("a", "b"), ("a", "c")]
    assert choose_machines([(0, 1)], {"local": 4}, 2) == [("local", "local")]  # CPU mode: one node
    with pytest.raises(
        PlacementError, match="no machine left with 8 free GPUs for node 3 of the nodes \\[2, 3\\]"
    ):
        choose_machines([(2, 3)], {"a": 1, "b": 0}, 8)


def test_node_selector_pins_each_nodes_bundles():
    assert node_selector(("a", "b"), 2) == [{NODE_ID_LABEL: m} for m in ("a", "a", "b", "b")]


def test_ray_executor_env_names_the_bundles_and_share():
    env = {"ROLL_ENGINE_BUNDLES": "0,1,2,3", "ROLL_ENGINE_DEVICE_SHARE": "0.5"}
    assert ray_executor_env(env) == {
        "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1",
        "VLLM_RAY_BUNDLE_INDICES": "0,1,2,3",
        "VLLM_RAY_PER_WORKER_GPUS": "0.5",
    }
    assert ray_executor_env({"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"}) == {
        "VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "0"
    }


@ray.remote(num_cpus=0)
class FakeGPUWorker:
    """What vLLM's RayWorkerProc asks of Ray before it loads anything: its node and GPU id."""

    def where(self) -> tuple[str, list[str]]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ctx.get_accelerator_ids()["GPU"]


class EngineHostWorker(Worker):
    """The engine's worker (the engine core's process): starts one GPU worker per bundle as vLLM's
    Ray executor does, from the variables the strategy turns into vLLM's."""

    @register(Dispatch.ONE_TO_ALL)
    def start_gpu_workers(self) -> dict:
        vllm_env = ray_executor_env(os.environ)
        group = get_current_placement_group()
        share = float(vllm_env["VLLM_RAY_PER_WORKER_GPUS"])
        actors = [
            FakeGPUWorker.options(
                num_gpus=share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=int(b)
                ),
            ).remote()
            for b in vllm_env["VLLM_RAY_BUNDLE_INDICES"].split(",")
        ]
        runtime_env = ray.get_runtime_context().runtime_env.get("env_vars", {})
        return {
            "group": group.id.hex(),
            "gpu_workers": ray.get([a.where.remote() for a in actors], timeout=60),
            "own_gpus": ray.get_runtime_context().get_accelerator_ids()["GPU"],
            "process_cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "runtime_env_cuda": "CUDA_VISIBLE_DEVICES" in runtime_env,
        }


@pytest.fixture(scope="module")
def three_nodes():
    ray.shutdown()
    env = pytest.MonkeyPatch()  # the nodes' workers import this module's worker classes
    env.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2})
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        env.undo()


def spanning_config() -> RLVRConfig:
    engine = VLLMConfig(tensor_parallel_size=4, distributed_executor_backend="ray")
    return RLVRConfig(
        num_gpus_per_node=2,
        actor_train=RoleConfig(
            strategy_args=StrategyArgs("megatron_train", MegatronConfig()),
            device_mapping=parse_device_mapping("0-1"),
        ),
        actor_infer=RoleConfig(
            strategy_args=StrategyArgs("vllm", engine), device_mapping=parse_device_mapping("2-5")
        ),
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engine_across_two_nodes_gets_one_group_and_its_gpu_workers_land_on_their_bundles(three_nodes):
    cfg = spanning_config()
    plan = plan_placement(cfg)
    assert plan.node_groups == ((0,), (1, 2))
    rm = ResourceManager(plan, "cpu")
    try:
        single, spanning = rm.placement_groups
        assert len(single.bundle_specs) == 2 and len(spanning.bundle_specs) == 4
        single_node = set(placement_group_table(single)["bundles_to_node_id"].values())
        spanning_nodes = placement_group_table(spanning)["bundles_to_node_id"]
        by_bundle = [spanning_nodes[i] for i in range(4)]
        # node 1's two bundles on one machine, node 2's on another, neither actor_train's
        assert by_bundle[0] == by_bundle[1] and by_bundle[2] == by_bundle[3] and by_bundle[0] != by_bundle[2]
        assert not single_node & set(by_bundle)
        assert [rm.slots[d].node_id for d in range(2, 6)] == by_bundle

        infer = plan.roles["actor_infer"]
        options = rm.worker_options(infer, 0)
        strategy = options["scheduling_strategy"]
        assert options["num_gpus"] == 0 and strategy.placement_group_capture_child_tasks
        assert strategy.placement_group_bundle_index == 0 and strategy.placement_group.id == spanning.id
        env = options["runtime_env"]["env_vars"]
        assert "CUDA_VISIBLE_DEVICES" not in env and env["ROLL_ENGINE_BUNDLES"] == "0,1,2,3"
        assert env["ROLL_ENGINE_DEVICE_SHARE"] == "1.0" and env["ROLL_ENGINE_NODES"] == "2"
        assert rm.worker_env(infer, 0)["CUDA_VISIBLE_DEVICES"] == ""  # CPU slots; its first device on GPUs
        assert "actor_infer ranks 0" in rm.describe().splitlines()[1]

        engine = Cluster("actor_infer", EngineHostWorker, rm, infer, cfg.actor_infer)
        try:
            rm.check_worker_nodes(infer, [p["node_id"] for p in engine.ping()])  # on its first device's node
            (found,) = engine.call(EngineHostWorker.start_gpu_workers)
        finally:
            engine.shutdown()
        assert found["group"] == spanning.id.hex() and found["own_gpus"] == []
        assert [node for node, _ in found["gpu_workers"]] == by_bundle
        assert all(len(gpus) == 1 for _, gpus in found["gpu_workers"])
        assert found["process_cuda"] == "" and not found["runtime_env_cuda"]
    finally:
        rm.destroy()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engine_shares_its_devices_with_the_reference(three_nodes):
    """A colocated role (the reference) on the engine's devices takes half of each bundle, and
    each GPU worker the other half."""
    cfg = spanning_config()
    cfg.reference = RoleConfig(
        strategy_args=StrategyArgs("megatron_infer", MegatronConfig()),
        device_mapping=parse_device_mapping("2-5"),
    )
    plan = plan_placement(cfg)
    rm = ResourceManager(plan, "cpu")
    try:
        infer = plan.roles["actor_infer"]
        assert rm.worker_options(infer, 0)["runtime_env"]["env_vars"]["ROLL_ENGINE_DEVICE_SHARE"] == "0.5"
        ref = plan.roles["reference"]
        assert [rm.worker_options(ref, r)["num_gpus"] for r in range(4)] == [0.5] * 4
        assert [
            rm.worker_options(ref, r)["scheduling_strategy"].placement_group_bundle_index for r in range(4)
        ] == [
            0,
            1,
            2,
            3,
        ]
        engine = Cluster("actor_infer", EngineHostWorker, rm, infer, cfg.actor_infer)
        try:
            (found,) = engine.call(EngineHostWorker.start_gpu_workers)
        finally:
            engine.shutdown()
        assert len(found["gpu_workers"]) == 4
    finally:
        rm.destroy()
