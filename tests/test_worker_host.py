"""Host processes on CPU slots (roll/distributed/scheduler/hosting.py, executor/worker_host.py):
which roles share a process, calls reaching the right role's worker, members running together,
and failures named by role and rank as with a process per worker."""

from __future__ import annotations

import builtins
import os
import re
import sys
import threading
import time

import pytest
import ray
import ray.cloudpickle
import torch
import torch.distributed as dist

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RewardConfig, RoleConfig, StrategyArgs
from roll.configs.strategy_configs import FSDP2Config, HFInferConfig, MegatronConfig
from roll.distributed.executor.dispatch import Dispatch, register
from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.cluster import Cluster, get_all
from roll.distributed.scheduler.errors import WorkerError
from roll.distributed.scheduler.hosting import plan_hosts
from roll.distributed.scheduler.placement import plan_placement
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.pipeline.rlvr.prestart import rule_reward_roles, start_hosts

# Ray workers cannot import this test module by name; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def role(mapping: str, strategy: str, typed, **kwargs) -> RoleConfig:
    args = StrategyArgs(strategy, typed)
    return RoleConfig(strategy_args=args, device_mapping=parse_device_mapping(mapping), **kwargs)


def config(device: str = "cpu", reward_ranks: int = 1, **roles) -> RLVRConfig:
    """The default example's layout: actor_train (FSDP2), actor_infer and reference (hf_infer)
    on slots 0-1, a math_rule reward."""
    roles.setdefault("actor_train", role("0-1", "fsdp2_train", FSDP2Config()))
    roles.setdefault("actor_infer", role("0-1", "hf_infer", HFInferConfig()))
    roles.setdefault("reference", role("0-1", "hf_infer", HFInferConfig()))
    rewards = {"math": RewardConfig(reward_fn="math_rule", world_size=reward_ranks)}
    return RLVRConfig(device=device, num_gpus_per_node=2, rewards=rewards, **roles)


def hosts_of(cfg: RLVRConfig, device: str = "cpu") -> list[tuple[tuple[str, int], ...]]:
    plan = plan_placement(cfg)
    return [h.members for h in plan_hosts(plan, cfg.roles(), device, rule_reward_roles(cfg))]


# Planning (pure).


def test_the_default_example_has_one_host_per_slot_and_the_reward_rides_on_the_first():
    cfg = config()
    plan = plan_placement(cfg)
    hosts = plan_hosts(plan, cfg.roles(), "cpu", riders=rule_reward_roles(cfg))
    assert [h.members for h in hosts] == [
        (("actor_train", 0), ("actor_infer", 0), ("reference", 0), ("rewards.math", 0)),
        (("actor_train", 1), ("actor_infer", 1), ("reference", 1)),
    ]
    assert [h.devices for h in hosts] == [(0,), (1,)]
    assert {h.group_owner for h in hosts} == {"actor_train"}


def test_riders_spread_over_the_hosts_by_rank():
    assert hosts_of(config(reward_ranks=3))[0][-2:] == (("rewards.math", 0), ("rewards.math", 2))
    assert hosts_of(config(reward_ranks=3))[1][-1] == ("rewards.math", 1)


def test_gpus_keep_one_process_per_worker():
    assert hosts_of(config(device="cuda"), device="cuda") == []


@pytest.mark.parametrize(
    ("change", "hosted"),
    [
        # megatron keeps process-wide parallel state: it keeps its own processes.
        ({"actor_train": role("0-1", "megatron_train", MegatronConfig())}, ["actor_infer", "reference"]),
        # A role on other devices (or in another rank order) shares nothing.
        ({"reference": role("1,0", "hf_infer", HFInferConfig())}, ["actor_train", "actor_infer"]),
        # Its own system_envs would clash with the host's environment.
        (
            {"reference": role("0-1", "hf_infer", HFInferConfig(), system_envs={"X": "1"})},
            ["actor_train", "actor_infer"],
        ),
        # A second role on the default group keeps its own processes (one group per process).
        ({"critic": role("0-1", "fsdp2_train", FSDP2Config())}, ["actor_train", "actor_infer", "reference"]),
    ],
)
def test_a_role_shares_only_when_it_is_safe(change, hosted):
    members = hosts_of(config(**change))
    assert [name for name, _ in members[1]] == hosted


def test_one_role_alone_gets_no_host():
    cfg = config(
        actor_infer=role("0", "hf_infer", HFInferConfig()), reference=role("1", "hf_infer", HFInferConfig())
    )
    assert hosts_of(cfg) == []


# Hosts on a private CPU Ray.


class HostedProbe(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {
            "role": self.role,
            "rank": self.rank,
            "pid": os.getpid(),
            "made_group": self.made_default_group,
            "env_rank": os.environ["RANK"],
        }

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return t.item()

    @register(Dispatch.ONE_TO_ALL)
    def meet(self, key: str) -> str:
        """Returns once a second member of this process has called it with ``key`` (so only when
        the two run at the same time)."""
        barriers = builtins.__dict__.setdefault("_roll_test_barriers", {})
        barrier = barriers.setdefault((key, self.rank), threading.Barrier(2, timeout=30))
        barrier.wait()
        return self.role

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, bad_rank: int, how: str) -> int:
        if self.rank == bad_rank and how == "raise":
            raise ValueError(f"boom on rank {self.rank}")
        if self.rank == bad_rank:
            os._exit(3)
        return self.rank


class BrokenHostedWorker(HostedProbe):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.rank == 1:
            raise KeyError("missing_key")


@pytest.fixture(scope="module")
def resources():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if ray.is_initialized():
        ray.shutdown()
    cfg = config()
    plan = plan_placement(cfg)
    rm = ResourceManager(plan, "cpu", log_to_driver=False)
    yield cfg, plan, rm
    rm.destroy()
    ray.shutdown()


def start(resources, worker_cls=HostedProbe, only: tuple[str, ...] | None = None) -> dict[str, Cluster]:
    cfg, plan, rm = resources
    hosted, _ = start_hosts(cfg, plan, rm)
    clusters = {}
    for name, role_config in cfg.roles().items():
        if only is None or name in only:
            hosts, joins = hosted[name]
            clusters[name] = Cluster(name, worker_cls, rm, plan.roles[name], role_config, cfg, hosts, joins)
    return clusters


@pytest.fixture(scope="module")
def clusters(resources):
    clusters = start(resources)
    yield clusters
    for cluster in clusters.values():
        cluster.shutdown()


@pytest.fixture
def slots_free(resources, clusters):
    """The shared hosts are gone: a host of three roles holds its whole slot (three 1/3 shares)."""
    for cluster in clusters.values():
        cluster.shutdown()
    return resources


def test_calls_reach_the_workers_of_their_role_in_one_process_per_slot(clusters):
    seen = {name: cluster.call(HostedProbe.whoami) for name, cluster in clusters.items()}
    for name, reports in seen.items():
        assert [(r["role"], r["rank"]) for r in reports] == [(name, rank) for rank in range(len(reports))]
    pids = {name: [r["pid"] for r in reports] for name, reports in seen.items()}
    assert pids["actor_train"] == pids["actor_infer"] == pids["reference"]
    assert len(set(pids["actor_train"])) == 2 and pids["rewards.math"] == pids["actor_train"][:1]
    assert [r["env_rank"] for r in seen["actor_infer"]] == ["0", "1"]


def test_only_the_group_owner_joins_the_default_group(clusters):
    assert clusters["actor_train"].call(HostedProbe.all_reduce_rank) == [1.0, 1.0]
    made = {name: [r["made_group"] for r in c.call(HostedProbe.whoami)] for name, c in clusters.items()}
    assert made == {
        "actor_train": [True, True],
        "actor_infer": [False, False],
        "reference": [False, False],
        "rewards.math": [False],
    }


@pytest.mark.timeout(120, func_only=True)  # a hang here is the bug under test
def test_members_of_a_host_run_at_the_same_time(clusters):
    """A model update needs the trainer's send and the engine's receive in one process at once."""
    train, infer = clusters["actor_train"], clusters["actor_infer"]
    got = get_all(train.async_call(HostedProbe.meet, "update"), infer.async_call(HostedProbe.meet, "update"))
    assert got == [["actor_train"] * 2, ["actor_infer"] * 2]


@pytest.mark.timeout(180, func_only=True)
def test_a_failure_names_role_and_rank_and_stops_the_host(slots_free):
    clusters = start(slots_free)
    try:
        with pytest.raises(WorkerError) as info:
            clusters["actor_infer"].call(HostedProbe.fail_on, 1, "raise")
        assert str(info.value) == "actor_infer rank 1: ValueError: boom on rank 1"
        # The failed role's processes are gone, and with them its host mates of those slots. The
        # kill is asynchronous: on a loaded machine a call may still be served while it lands.
        with pytest.raises(WorkerError, match=r"^reference rank \d: ActorDiedError: the worker process died"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                clusters["reference"].call(HostedProbe.whoami)
                time.sleep(0.5)
    finally:
        for cluster in clusters.values():
            cluster.shutdown()


@pytest.mark.timeout(180, func_only=True)
def test_a_host_process_that_dies_is_named_with_every_role_it_hosted(slots_free):
    clusters = start(slots_free, only=("actor_train", "reference"))
    pid = clusters["reference"].call(HostedProbe.whoami)[0]["pid"]
    try:
        with pytest.raises(WorkerError) as info:
            clusters["reference"].call(HostedProbe.fail_on, 0, "exit")
        # Not "reference rank 0": the process held actor_train rank 0 as well.
        assert re.match(
            rf"^host process pid {pid} on [\d.]+ \(actor_train rank 0, reference rank 0\): "
            r"ActorDiedError: the worker process died",
            str(info.value),
        ), str(info.value)
        assert (info.value.role, info.value.rank) == ("reference", 0)
    finally:
        for cluster in clusters.values():
            cluster.shutdown()


def test_killing_a_host_or_worker_after_ray_is_down_does_nothing(monkeypatch):
    """The launcher's clean-up may reach hosts a failed start left behind after Ray has shut down:
    ``ray.kill`` there would start a new Ray and raise ActorHandleNotFoundError."""
    from roll.distributed.executor.worker_host import HostRef

    def refuse(*args, **kwargs):
        raise AssertionError("ray.kill called with Ray down")

    monkeypatch.setattr(ray, "kill", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    HostRef(actor=object(), members=(("actor_train", 0),)).kill()
    cluster = Cluster.__new__(Cluster)
    cluster.workers = [object()]
    cluster._kill()
    assert cluster.workers == []


@pytest.mark.timeout(180, func_only=True)
def test_an_error_in_a_hosted_init_names_role_rank_and_exception(slots_free):
    cfg, plan, rm = slots_free
    hosted, _ = start_hosts(cfg, plan, rm)
    hosts, joins = hosted["reference"]
    with pytest.raises(WorkerError, match=r"^reference rank 1: KeyError: in __init__: 'missing_key'$"):
        Cluster(
            "reference", BrokenHostedWorker, rm, plan.roles["reference"], cfg.reference, cfg, hosts, joins
        )


@pytest.mark.timeout(180, func_only=True)
def test_a_host_ends_when_its_last_member_shuts_down(slots_free):
    clusters = start(slots_free, only=("actor_train", "actor_infer"))
    host = clusters["actor_train"].workers[0].host.actor
    clusters["actor_infer"].shutdown()
    assert [r["role"] for r in clusters["actor_train"].call(HostedProbe.whoami)] == ["actor_train"] * 2
    clusters["actor_train"].shutdown()
    deadline = time.monotonic() + 60  # ray.kill is asynchronous: a call may still land before it
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            try:
                ray.get(host.call.remote("actor_train", 0, "whoami"), timeout=60)
            except ray.exceptions.RayTaskError:
                pass  # the member is gone, the process not yet
            time.sleep(0.2)
