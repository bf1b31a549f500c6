"""The Ray runtime on CPU: fake device slots, colocated roles, rank environment, dispatch, errors.

One local Ray with 4 fake GPU slots is started for the whole module (through ResourceManager, i.e.
our own init code). The plan has 2 "nodes" of 2 slots (two placement groups, here on one machine).
Roles: actor_train on slots 0-3, actor_infer (2 workers of 2 slots, like vLLM TP=2) on 0-3,
reference on 2-3 (three roles share slots 2-3), and a CPU-only reward role.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time

import psutil
import pytest
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RewardConfig, RoleConfig, StrategyArgs
from roll.configs.strategy_configs import VLLMConfig
from roll.configs.timeouts import WorkerTimeoutsConfig
from roll.core.batch import Batch
from roll.distributed.executor.dispatch import (
    Dispatch,
    DPRank,
    check_dp_layout,
    gather_from_dp,
    register,
    split_for_dp,
)
from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler import ray_start, resource_manager
from roll.distributed.scheduler.cluster import Cluster
from roll.distributed.scheduler.errors import WorkerError, WorkerTimeout
from roll.distributed.scheduler.placement import PlacementPlan, plan_placement, plan_role
from roll.distributed.scheduler.ray_start import init_ray
from roll.distributed.scheduler.resource_manager import ResourceManager, check_capacity
from roll.distributed.scheduler.watchdog import Deadline

# Ray workers cannot import this test module by name; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ROLL_DEVICE",
    "ROLL_DEVICE_IDS",
)
ENV_KEYS += ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "FROM_PIPELINE", "FROM_ROLE")


class FakeTPStrategy:
    """Stands in for Megatron: ``tp`` consecutive ranks form one DP rank; the first one outputs."""

    def __init__(self, rank: int, world_size: int, tp: int):
        self.rank, self.world_size, self.tp = rank, world_size, tp

    def dp_layout(self) -> tuple[int, int, bool]:
        return self.rank // self.tp, self.world_size // self.tp, self.rank % self.tp == 0


class ProbeWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def report(self) -> dict:
        return {
            "env": {k: os.environ.get(k) for k in ENV_KEYS},
            # {resource: [(instance id, fraction)]}: which GPU slot Ray gave this actor, and how much of it.
            "resources": ray._private.worker.global_worker.core_worker.resource_ids(),
            "seed": torch.initial_seed(),
            "device": str(self.ctx.device),
            "local_rank": self.ctx.local_rank,
            "threads": torch.get_num_threads(),
        }

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        value = torch.tensor([float(self.rank)])
        dist.all_reduce(value)
        return value.item()

    @register(Dispatch.ONE_TO_ALL)
    def use_fake_tp(self, tp: int | None) -> None:
        self.strategy = FakeTPStrategy(self.rank, self.world_size, tp) if tp else None

    @register(Dispatch.DP_COMPUTE)
    def scale_rows(self, batch: Batch, factor: int) -> Batch:
        self.seen = batch["x"].tolist()
        return Batch.from_dict({"x": batch["x"] * factor}, {"rank": [self.rank] * len(batch)})

    @register(Dispatch.ONE_TO_ALL)
    def last_seen(self) -> list[int]:
        return self.seen

    @register(Dispatch.ONE_TO_ALL)
    def count_rows(self, batch: Batch | None = None) -> int:
        return len(batch)

    @register(Dispatch.RANK_ZERO)
    def whoami(self) -> int:
        return self.rank

    def not_registered(self) -> int:
        return self.rank


class FailingWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, bad_rank: int, how: str) -> int:
        if self.rank == bad_rank and how == "raise":
            raise ValueError(f"boom on rank {self.rank}")
        if self.rank == bad_rank:
            os._exit(3)
        if how == "raise":
            dist.all_reduce(torch.ones(1))  # never completes: the failing rank does not join
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def sleep_on(self, bad_rank: int, seconds: float) -> int:
        if self.rank == bad_rank:
            time.sleep(seconds)  # a hung rank (a stopped process answers no better)
        return self.rank


class BrokenInitWorker(Worker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.rank == 1:
            raise KeyError("missing_key")


def make_config() -> RLVRConfig:
    vllm = StrategyArgs("vllm", VLLMConfig(tensor_parallel_size=2))
    return RLVRConfig(
        actor_train=RoleConfig(device_mapping=[0, 1, 2, 3], system_envs={"FROM_ROLE": "train"}),
        actor_infer=RoleConfig(strategy_args=vllm, device_mapping=[0, 1, 2, 3]),
        reference=RoleConfig(device_mapping=[2, 3]),
        rewards={"math": RewardConfig(world_size=2)},
        num_gpus_per_node=2,
        seed=7,
        system_envs={"FROM_PIPELINE": "yes"},
    )


@pytest.fixture(scope="module")
def runtime():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if ray.is_initialized():
        ray.shutdown()
    config = make_config()
    plan = plan_placement(config)
    rm = ResourceManager(plan, "cpu", log_to_driver=False)
    roles = config.roles()
    clusters = {name: Cluster(name, ProbeWorker, rm, plan.roles[name], roles[name], config) for name in roles}
    yield rm, clusters, config
    for cluster in clusters.values():
        cluster.shutdown()
    rm.destroy()
    ray.shutdown()


def _bundle_key(rm: ResourceManager, device: int) -> str:
    node, slot = divmod(device, rm.plan.devices_per_node)
    return f"GPU_group_{slot}_{rm.placement_groups[node].id.hex()}"


EXPECTED = {
    # role: [(global devices, LOCAL_RANK, share of the first device's GPU)] by rank
    "actor_train": [((0,), 0, 0.5), ((1,), 1, 0.5), ((2,), 0, 0.3333), ((3,), 1, 0.3333)],
    "actor_infer": [((0, 1), 0, 0.5), ((2, 3), 0, 0.3333)],
    "reference": [((2,), 0, 0.3333), ((3,), 1, 0.3333)],
    "rewards.math": [((), 0, None), ((), 1, None)],
}


@pytest.mark.parametrize("role", list(EXPECTED))
def test_each_worker_gets_its_rank_env_and_device_slot(runtime, role):
    rm, clusters, _ = runtime
    cluster = clusters[role]
    reports = cluster.call(ProbeWorker.report)
    assert len(reports) == len(EXPECTED[role])
    for rank, (report, (devices, local_rank, share)) in enumerate(zip(reports, EXPECTED[role])):
        env = report["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == str(len(reports))
        assert env["LOCAL_RANK"] == str(local_rank) and report["local_rank"] == local_rank
        if role != "actor_infer":  # vllm workers join no role group: vLLM makes its own
            assert env["MASTER_ADDR"] == cluster.master_addr and env["MASTER_PORT"] == str(
                cluster.master_port
            )
        assert env["ROLL_DEVICE"] == "cpu" and report["device"] == "cpu"
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["ROLL_DEVICE_IDS"] == ",".join(map(str, devices))
        assert env["FROM_PIPELINE"] == "yes"
        assert env["FROM_ROLE"] == ("train" if role == "actor_train" else None)
        assert report["seed"] == 7 + rank
        assert report["threads"] == int(env["OMP_NUM_THREADS"]) >= 1
        gpus = {k: v for k, v in report["resources"].items() if k.startswith("GPU")}
        if share is None:
            assert gpus == {}
        else:  # pinned to the bundle of its first device, on the GPU the probe found there, with a 1/k share
            [(gpu_id, fraction)] = gpus[_bundle_key(rm, devices[0])]
            assert str(gpu_id) == rm.slots[devices[0]].gpu_id and fraction == pytest.approx(share)


def test_probe_maps_every_device_to_a_slot_of_one_node(runtime):
    rm, _, _ = runtime
    assert len(rm.slots) == 4
    assert sorted(slot.gpu_id for slot in rm.slots) == ["0", "1", "2", "3"]
    assert len({slot.node_id for slot in rm.slots}) == 1
    assert len(rm.placement_groups) == 2
    assert "node 0:" in rm.describe() and "node 1:" in rm.describe()


def test_gpu_env_lists_the_physical_ids_of_all_worker_devices(runtime, monkeypatch):
    rm, _, _ = runtime
    monkeypatch.setattr(rm, "device", "cuda")
    engine = rm.worker_env(rm.plan.roles["actor_infer"], 1)
    assert engine["CUDA_VISIBLE_DEVICES"] == f"{rm.slots[2].gpu_id},{rm.slots[3].gpu_id}"
    assert engine["ROLL_DEVICE"] == "cuda"
    reward = rm.worker_env(rm.plan.roles["rewards.math"], 0)
    assert reward["CUDA_VISIBLE_DEVICES"] == "" and reward["ROLL_DEVICE"] == "cpu"


def test_gloo_all_reduce_within_each_role(runtime):
    _, clusters, _ = runtime
    assert clusters["actor_train"].call(ProbeWorker.all_reduce_rank) == [6.0] * 4
    assert clusters["reference"].call(ProbeWorker.all_reduce_rank) == [1.0, 1.0]


def test_engine_role_workers_join_no_default_group(runtime):
    """vLLM's in-process executor builds its own default group and would adopt a role group as its
    world, so a vllm role's workers have none (``StrategySpec.role_process_group``)."""
    _, clusters, _ = runtime
    with pytest.raises(
        WorkerError, match="actor_infer rank .*Default process group has not been initialized"
    ):
        clusters["actor_infer"].call(ProbeWorker.all_reduce_rank)


def test_dp_compute_splits_and_gathers_in_dp_order(runtime):
    _, clusters, _ = runtime
    cluster = clusters["actor_train"]
    batch = Batch.from_dict({"x": torch.arange(8)})
    out = cluster.call(ProbeWorker.scale_rows, batch, 10)
    assert out["x"].tolist() == [10 * i for i in range(8)]
    assert out["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="7 rows does not split into 4"):
        cluster.call(ProbeWorker.scale_rows, Batch.from_dict({"x": torch.arange(7)}), 1)


def test_dp_compute_with_two_ranks_per_dp_group(runtime):
    _, clusters, _ = runtime
    cluster = clusters["actor_train"]
    cluster.call(ProbeWorker.use_fake_tp, 2)
    cluster.refresh_dp_layout()
    try:
        assert cluster.dp_size == 2
        out = cluster.async_call(
            ProbeWorker.scale_rows, Batch.from_dict({"x": torch.arange(8)}), factor=3
        ).get()
        assert out["x"].tolist() == [3 * i for i in range(8)]
        assert out["rank"].tolist() == [0] * 4 + [2] * 4  # only the output rank of each DP group
        assert cluster.call(ProbeWorker.last_seen) == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    finally:
        cluster.call(ProbeWorker.use_fake_tp, None)
        cluster.refresh_dp_layout()
    assert cluster.dp_size == 4


def test_dispatch_by_registered_mode(runtime):
    _, clusters, _ = runtime
    cluster = clusters["reference"]
    assert cluster.call(ProbeWorker.whoami) == 0
    batch = Batch.from_dict({"x": torch.arange(5)})
    assert cluster.call(ProbeWorker.count_rows, batch=batch) == [5, 5]
    assert [info["rank"] for info in cluster.ping()] == [0, 1]
    with pytest.raises(TypeError, match="ProbeWorker.not_registered' is not marked with @register"):
        cluster.call(ProbeWorker.not_registered)


def test_typed_cluster_refuses_another_worker_class(runtime):
    from roll.pipeline.workers.model_worker import ModelCluster

    rm, _, _ = runtime
    with pytest.raises(TypeError, match="ModelCluster runs ModelWorker workers, got ProbeWorker"):
        ModelCluster("critic", ProbeWorker, rm, _cpu_role("critic", 1), RoleConfig(world_size=1))


def _cpu_role(name: str, world_size: int):
    return plan_role(name, RoleConfig(world_size=world_size), devices_per_node=2)


@pytest.mark.timeout(120, func_only=True)  # a hang here is the bug under test
def test_failing_worker_raises_worker_error_and_stops_the_role(runtime):
    rm, _, _ = runtime
    cluster = Cluster("critic", FailingWorker, rm, _cpu_role("critic", 3), RoleConfig(world_size=3))
    workers = list(cluster.workers)
    with pytest.raises(WorkerError) as info:
        cluster.call(FailingWorker.fail_on, 1, "raise")  # ranks 0 and 2 wait in an all-reduce for rank 1
    err = info.value
    assert str(err) == "critic rank 1: ValueError: boom on rank 1"
    assert (err.role, err.rank, err.exc_type) == ("critic", 1, "ValueError")
    assert "raise ValueError" in err.remote_traceback
    with pytest.raises(RuntimeError, match="stopped after an error"):
        cluster.ping()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[0].ping.remote(), timeout=30)


@pytest.mark.timeout(120, func_only=True)  # a hang here is the bug under test
def test_worker_process_that_dies_is_reported(runtime):
    rm, _, _ = runtime
    cluster = Cluster("critic", FailingWorker, rm, _cpu_role("critic", 2), RoleConfig(world_size=2))
    with pytest.raises(WorkerError, match=r"^critic rank 1: ActorDiedError: the worker process died"):
        cluster.call(FailingWorker.fail_on, 1, "exit")


@pytest.mark.timeout(120, func_only=True)  # a hang here is the bug under test
def test_error_in_worker_init_names_role_rank_and_exception(runtime):
    rm, _, _ = runtime
    with pytest.raises(WorkerError, match=r"^critic rank 1: KeyError: in __init__: 'missing_key'$"):
        Cluster("critic", BrokenInitWorker, rm, _cpu_role("critic", 2), RoleConfig(world_size=2))


@pytest.mark.timeout(120, func_only=True)
def test_a_long_wait_logs_the_role_ranks_and_call_it_waits_on(runtime, monkeypatch, caplog):
    from roll.distributed.scheduler import cluster as cluster_module

    rm, _, _ = runtime
    cluster = Cluster("critic", FailingWorker, rm, _cpu_role("critic", 2), RoleConfig(world_size=2))
    monkeypatch.setattr(cluster_module, "STALL_REPORT_AFTER_S", 0.5)
    monkeypatch.setattr(cluster_module, "STALL_REPORT_EVERY_S", 0.5)
    with caplog.at_level("WARNING", logger="roll"):
        assert cluster.call(FailingWorker.sleep_on, 1, 1.8) == [0, 1]
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert len(lines) >= 2, lines  # after 0.5 s and then every 0.5 s while rank 1 sleeps
    pattern = (
        r"still waiting after \d+ s for critic rank 1 \(sleep_on, \d+ s left of worker_timeouts.call_s\)"
    )
    assert re.fullmatch(pattern, lines[0]), lines[0]
    cluster.shutdown()


@pytest.mark.timeout(120, func_only=True)  # a hang here is the bug under test
def test_hung_worker_times_out_naming_role_and_rank(runtime):
    rm, _, _ = runtime
    cluster = Cluster("critic", FailingWorker, rm, _cpu_role("critic", 3), RoleConfig(world_size=3))
    cluster.timeouts = WorkerTimeoutsConfig(call_s=3)
    workers = list(cluster.workers)
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:
        cluster.call(FailingWorker.sleep_on, 1, 3600)
    assert time.monotonic() - start < 30
    assert str(info.value).startswith(
        "critic rank 1: sleep_on did not answer within 3 s (worker_timeouts.call_s); the workers were stopped"
    )
    with pytest.raises(RuntimeError, match="stopped after an error"):
        cluster.ping()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[1].ping.remote(), timeout=30)


def test_single_node_run_listens_on_loopback_only(runtime):
    """The private Ray of a single-node run (here the CPU one) binds every port to 127.0.0.1 (GCS,
    raylet, agents, workers), and so do the roles' torch process groups (store and gloo pairs)."""
    _, clusters, _ = runtime
    assert (
        clusters["actor_train"].call(ProbeWorker.all_reduce_rank) == [6.0] * 4
    )  # the groups are up and work
    host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)
    assert host == "127.0.0.1"
    ray_pids = {p.pid for p in psutil.Process().children(recursive=True)}
    listening = [
        c.laddr
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ray_pids
    ]
    ports = {addr.port for addr in listening}
    assert int(port) in ports  # the GCS is among them
    assert {cluster.master_port for name, cluster in clusters.items() if name != "actor_infer"} <= ports
    assert {addr.ip for addr in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening


# Pure functions (no Ray needed).


@pytest.mark.parametrize(
    "num_nodes, existing, expected",
    [
        (1, False, [{"address": "local", "_node_ip_address": "127.0.0.1", "num_gpus": None}]),
        (1, True, [{"address": "10.0.0.5:6379"}]),  # joins the cluster `ray start` made on this machine
        (2, False, [{}]),  # multi-node: ray.init() as before
    ],
)
def test_gpu_driver_starts_loopback_ray_only_for_one_node(monkeypatch, num_nodes, existing, expected):
    from ray._private import ray_constants

    calls = []

    def fake_init(**kwargs):
        keys = ("address", "_node_ip_address", "num_gpus")
        calls.append({k: kwargs[k] for k in keys if k in kwargs})
        if kwargs.get("address") == "local":
            assert os.environ[ray_start.LOCAL_ONLY_ENV] == "0" and not ray_constants.ENABLE_RAY_CLUSTER

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray_start, "ray_start_address", lambda: "10.0.0.5:6379" if existing else None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(ray_start.LOCAL_ONLY_ENV, raising=False)
    assert init_ray(PlacementPlan(num_nodes, 8, {}, ()), "cuda") == "cuda"
    assert calls == expected
    assert ray_start.LOCAL_ONLY_ENV not in os.environ and ray_constants.ENABLE_RAY_CLUSTER


def test_only_the_ray_start_address_file_is_joined_and_only_while_its_gcs_answers(monkeypatch, tmp_path):
    """Another run's Ray on a shared host (a running gcs_server that ``ray start`` did not write
    down) is never joined, and a stale address file (its GCS gone) means no cluster."""
    from ray._private import services

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        live = f"127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setattr(services, "find_gcs_addresses", lambda: {live})  # what "auto" would take
        monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
        assert ray_start.ray_start_address() is None
        monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: live)
        assert ray_start.ray_start_address() == live
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: live)  # closed now
    assert ray_start.ray_start_address() is None


def test_a_ray_address_nobody_answers_is_one_config_error(monkeypatch):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{free.getsockname()[1]}"  # bound, never listening: refused
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("ray.init must not be reached"))
    monkeypatch.setenv("RAY_ADDRESS", dead)
    with pytest.raises(ConfigError, match=f"RAY_ADDRESS.*no Ray cluster answers at {dead}.*ray start --head"):
        init_ray(PlacementPlan(2, 8, {}, ()), "cuda")
    for other in ("auto", "ray://10.0.0.5:10001"):  # Ray's own forms pass through to ray.init
        ray_start.check_ray_address(other)


def test_a_join_uses_the_auth_mode_the_environment_names_when_it_joins(monkeypatch):
    """Ray caches ``RAY_AUTH_MODE`` when it is imported: a driver that names token authentication
    after that (the two-node GPU test did) must still send the token, and a failed join without it
    says what to set."""
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, Config, get_authentication_mode

    seen = []

    def fake_init(**kwargs):
        seen.append(get_authentication_mode() == AuthenticationMode.TOKEN)
        raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:1.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray_start, "check_ray_address", lambda address: None)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    try:
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        with pytest.raises(ConnectionError) as err:
            init_ray(PlacementPlan(2, 8, {}, ()), "cuda")
        assert seen == [True] and "RAY_AUTH_MODE" not in str(err.value)
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
        with pytest.raises(ConnectionError, match="run this driver with RAY_AUTH_MODE=token"):
            init_ray(PlacementPlan(2, 8, {}, ()), "cuda")
        assert seen == [True, False]
    finally:
        monkeypatch.undo()
        Config.initialize("")  # Ray's mode and token as the restored environment says
        AuthenticationTokenLoader.instance().reset_cache()


def test_each_method_gets_its_stage_timeout():
    timeouts = WorkerTimeoutsConfig(train_s=7, call_s=2)
    assert Deadline.start(timeouts, "train_step").key == "worker_timeouts.train_s"
    assert Deadline.start(timeouts, "train_step").timeout_s == 7
    assert Deadline.start(timeouts, "offload_states").timeout_s == 2
    defaults = WorkerTimeoutsConfig()
    assert (defaults.generate_s, defaults.train_s, defaults.model_update_s, defaults.call_s) == (
        1800,
        1800,
        600,
        300,
    )
    from roll.configs.errors import ConfigError
    from roll.configs.ranges import check_fields

    with pytest.raises(ConfigError, match=r"^worker_timeouts\.train_s: must be in \[1, 86400\], got 0"):
        check_fields(WorkerTimeoutsConfig(train_s=0), "worker_timeouts")


def test_check_capacity_names_the_key_to_fix():
    plan = plan_placement(make_config())  # 2 nodes x 2 devices
    check_capacity(plan, [("10.0.0.1", 4.0)])  # both groups fit on one 4-GPU machine
    check_capacity(plan, [("10.0.0.1", 2.0), ("10.0.0.2", 2.0)])
    with pytest.raises(ConfigError, match="^num_gpus_per_node: is 2 but no node .* 10.0.0.1: 1"):
        check_capacity(plan, [("10.0.0.1", 1.0), ("10.0.0.2", 1.0)])
    with pytest.raises(ConfigError, match="ray start --num-gpus"):
        check_capacity(plan, [("10.0.0.1", 0.0)], device="cpu")
    with pytest.raises(
        ConfigError, match=r"^device_mapping: the mappings need 2 node\(s\) x 2 GPUs .* room for 1"
    ):
        check_capacity(plan, [("10.0.0.1", 2.0), ("10.0.0.2", 1.0)])


def test_each_rank_must_run_on_the_node_its_devices_were_reserved_on():
    """The check after the workers start (``start.check_worker_nodes``): each rank reports its
    own Ray node id, compared with the node its bundle was reserved on."""
    plan = plan_placement(make_config())  # 2 nodes x 2 devices
    rm = ResourceManager.__new__(ResourceManager)
    rm.plan, rm.device = plan, "cpu"
    rm.slots = [resource_manager.DeviceSlot("10.0.0.1", "n0", "0", 4)] * 2
    rm.slots += [resource_manager.DeviceSlot("10.0.0.2", "n1", str(i), 4) for i in range(2)]
    reference = plan.roles["reference"]  # devices 2-3: node 1
    rm.check_worker_nodes(reference, ["n1", "n1"])
    with pytest.raises(
        resource_manager.PlacementError,
        match=r"^reference rank 1 runs on Ray node n0 but its devices \[3\] were reserved on node 1 "
        r"\(10\.0\.0\.2, Ray node n1\)",
    ):
        rm.check_worker_nodes(reference, ["n1", "n0"])
    assert rm.describe({"reference": reference}).splitlines() == [
        "node 0: 10.0.0.1 (Ray node n0) cpu ids 0,0: no workers",
        "node 1: 10.0.0.2 (Ray node n1) cpu ids 0,1: reference ranks 0-1",
    ]
    # A CPU-only role's rank (placed by Ray) is named by the node it reported.
    assert rm.name_node("n1") == "node 1 (10.0.0.2)"
    assert rm.name_node("n7") == "Ray node n7"


def test_dp_layout_checks():
    layouts = [DPRank(0, 2, True), DPRank(0, 2, False), DPRank(1, 2, True), DPRank(1, 2, False)]
    assert check_dp_layout(layouts, "actor_train") == 2
    with pytest.raises(ValueError, match="disagree on the data-parallel size"):
        check_dp_layout([DPRank(0, 2, True), DPRank(1, 3, True)], "actor_train")
    with pytest.raises(ValueError, match="exactly one output rank, got output DP ranks \\[0, 0\\]"):
        check_dp_layout([DPRank(0, 2, True), DPRank(0, 2, True)], "actor_train")


def test_split_and_gather_for_dp():
    batch = Batch.from_dict({"x": torch.arange(6)}, {"tag": list("abcdef")})
    chunks = split_for_dp(batch, 3, "role.method")
    assert [c["x"].tolist() for c in chunks] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(TypeError, match="role.method: DP_COMPUTE needs a Batch"):
        split_for_dp({"x": 1}, 2, "role.method")
    layouts = [DPRank(1, 2, True), DPRank(1, 2, False), DPRank(0, 2, True), DPRank(0, 2, False)]
    parts = [chunks[1], None, chunks[0], None]
    assert gather_from_dp(parts, layouts)["tag"].tolist() == ["a", "b", "c", "d"]
    assert gather_from_dp(["r0", "r1", "r2", "r3"], layouts) == ["r2", "r0"]


def test_register_rejects_a_non_mode():
    with pytest.raises(TypeError, match="takes a Dispatch mode"):
        register("one_to_all")


def test_a_rank_that_fails_after_another_node_went_down_names_that_node(monkeypatch):
    """On a run that spans nodes, a rank on a live node often fails first when a peer's node dies
    (its collective's connection resets): the line names the node that went down. Ray marks a
    killed node dead only after its health checks time out, so a raylet that refuses connections
    counts as gone too."""
    from ray.exceptions import RayError

    from roll.distributed.scheduler import cluster as cluster_mod

    with socket.socket() as live, socket.socket() as closed:
        live.bind(("127.0.0.1", 0))
        live.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused like a killed raylet's port
        nodes = [
            {
                "NodeID": "a",
                "Alive": True,
                "NodeManagerAddress": "127.0.0.1",
                "NodeManagerPort": live.getsockname()[1],
            },
            {
                "NodeID": "b",
                "Alive": True,
                "NodeManagerAddress": "127.0.0.1",
                "NodeManagerPort": closed.getsockname()[1],
            },
            {
                "NodeID": "c",
                "Alive": False,
                "NodeManagerAddress": "127.0.0.1",
                "NodeManagerPort": live.getsockname()[1],
            },
        ]
        monkeypatch.setattr(ray, "nodes", lambda: nodes)
        run_nodes = {"a": "node 0 (127.0.0.1)", "b": "node 1 (127.0.0.1)", "c": "node 2 (127.0.0.1)"}
        assert cluster_mod.gone_nodes(run_nodes) == ["node 1 (127.0.0.1)", "node 2 (127.0.0.1)"]
        assert cluster_mod.gone_nodes({"a": "node 0 (127.0.0.1)"}) == []

        role = cluster_mod.Cluster.__new__(cluster_mod.Cluster)
        role.role, role.workers, role.nodes, role._error = "actor_train", [], {}, None
        role.run_nodes = {"a": "node 0 (127.0.0.1)", "b": "node 1 (127.0.0.1)"}
        monkeypatch.setattr(role, "_kill", lambda *args, **kwargs: None)
        error = role._fail(0, RayError("RuntimeError: [gloo] Read error: Connection reset by peer"))
    assert str(error) == (
        "actor_train rank 0, after node 1 (127.0.0.1) went down: RayError: "
        "RuntimeError: [gloo] Read error: Connection reset by peer"
    )
    role.run_nodes = {}  # one node: the line stays the rank's own
    role._error = None
    assert str(role._fail(0, RayError("boom"))) == "actor_train rank 0: RayError: boom"
    # A rank on the node that went down is named with its node, and not "after" its own death.
    monkeypatch.setattr(cluster_mod, "gone_nodes", lambda run_nodes: ["node 1 (127.0.0.1)"])
    role.run_nodes, role.nodes, role._error = {"b": "node 1 (127.0.0.1)"}, {0: "node 1 (127.0.0.1)"}, None
    line = str(role._fail(0, ray.exceptions.RayActorError()))
    assert line.startswith(
        "actor_train rank 0 on node 1 (127.0.0.1): RayActorError: the worker process died"
    ), line


@pytest.mark.parametrize("host, kept", [("127.0.0.1", True), ("10.0.0.5", False)])
def test_joining_a_loopback_ray_address_keeps_it_loopback(monkeypatch, host, kept):
    """A cluster started on 127.0.0.1 (``ray start --node-ip-address=127.0.0.1``): ray.init would
    turn the address into the machine's (its ENABLE_RAY_CLUSTER flag, read when Ray was imported)
    and dial a port nothing listens on, until its GCS client timed out (seen on a 2-GPU host)."""
    from ray._private import ray_constants, services

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        seen = {}

        def fake_init(**kwargs):
            seen["canonical"] = services.canonicalize_bootstrap_address(kwargs["address"])
            seen["flag"] = ray_constants.ENABLE_RAY_CLUSTER

        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(ray, "init", fake_init)
        monkeypatch.setattr(ray_start, "check_ray_address", lambda address: None)
        monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
        monkeypatch.setenv("RAY_ADDRESS", f"{host}:{port}")
        init_ray(PlacementPlan(2, 8, {}, ()), "cuda")
    assert seen["flag"] is (not kept)
    if kept:
        assert seen["canonical"] == f"127.0.0.1:{port}"
    assert ray_constants.ENABLE_RAY_CLUSTER  # restored
