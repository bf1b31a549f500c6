"""Starting a run (roll/pipeline/rlvr/start.py): which roles initialize together, which are
offloaded between stages on CPU slots and GPUs, and every role's workers starting at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RewardConfig, RoleConfig, StrategyArgs
from roll.configs.strategy_configs import FSDP2Config, HFInferConfig, MegatronConfig, VLLMConfig
from roll.distributed.scheduler.placement import plan_placement
from roll.pipeline.common.timing import StageTimer
from roll.pipeline.rlvr import prestart, start
from roll.pipeline.rlvr.perf import record_launch, startup_metrics
from roll.pipeline.rlvr.start import init_waves, offloaded_roles, offloads_after_waves


def role(mapping: str, strategy: str, typed) -> RoleConfig:
    args = StrategyArgs(strategy, typed)
    return RoleConfig(strategy_args=args, device_mapping=parse_device_mapping(mapping))


def config(device: str = "cpu", trainer: str = "fsdp2_train", **roles) -> RLVRConfig:
    typed = MegatronConfig() if trainer == "megatron_train" else FSDP2Config()
    roles.setdefault("actor_train", role("0-1", trainer, typed))
    roles.setdefault("actor_infer", role("0-1", "hf_infer", HFInferConfig()))
    roles.setdefault("reference", role("0-1", "hf_infer", HFInferConfig()))
    rewards = {"math": RewardConfig(reward_fn="math_rule", world_size=2)}
    return RLVRConfig(device=device, num_gpus_per_node=4, rewards=rewards, **roles)


def test_only_engines_initialize_alone_on_their_devices_and_first():
    names = ["actor_train", "actor_infer", "reference", "rewards.math"]
    # No engine sizes memory from free memory: every role at once, colocated or not.
    colocated = plan_placement(config())
    assert init_waves(colocated, names) == [names]
    assert init_waves(colocated, names, all_at_once=True) == [names]
    # A colocated vLLM engine first and alone on its devices (with the CPU-only reward), then the
    # trainer and the reference together.
    vllm = plan_placement(config(actor_infer=role("0-1", "vllm", VLLMConfig())))
    assert init_waves(vllm, names) == [["actor_infer", "rewards.math"], ["actor_train", "reference"]]
    # Disaggregated: the engine shares no device, so everything initializes at once.
    disagg = plan_placement(
        config(
            actor_train=role("0-1", "fsdp2_train", FSDP2Config()),
            actor_infer=role("2-3", "vllm", VLLMConfig()),
            reference=role("0-1", "hf_infer", HFInferConfig()),
        )
    )
    assert init_waves(disagg, names) == [["actor_infer", "actor_train", "reference", "rewards.math"]]
    # Engines that share no device initialize together; a role sharing a device with one waits.
    judge = config(
        actor_infer=role("0-1", "vllm", VLLMConfig()),
        reference=role("1-2", "hf_infer", HFInferConfig()),
        actor_train=role("2-3", "vllm", VLLMConfig()),
    )
    waves = init_waves(plan_placement(judge), names)
    assert waves == [["actor_train", "actor_infer", "rewards.math"], ["reference"]]
    overlapping = config(
        actor_infer=role("0-1", "vllm", VLLMConfig()),
        actor_train=role("1-2", "vllm", VLLMConfig()),
        reference=role("2-3", "hf_infer", HFInferConfig()),
    )
    # actor_train (an engine here, first in ``names``) before actor_infer, with which it shares
    # device 1; the reference shares device 2 only with actor_train, so it joins actor_infer's wave.
    assert init_waves(plan_placement(overlapping), names) == [
        ["actor_train", "rewards.math"],
        ["actor_infer", "reference"],
    ]


def test_an_engine_given_its_kv_cache_in_bytes_initializes_with_the_others():
    names = ["actor_train", "actor_infer", "reference", "rewards.math"]
    cfg = config(actor_infer=role("0-1", "vllm", VLLMConfig(kv_cache_memory_gb=8)))
    plan = plan_placement(cfg)
    assert start.fixed_engine_memory(cfg) == {"actor_infer"}
    assert init_waves(plan, names, fixed_memory=start.fixed_engine_memory(cfg)) == [names]
    # every colocated role is then offloaded once that one wave is done
    assert offloads_after_waves(plan, [names], {"actor_train", "actor_infer", "reference"}) == [
        ["actor_infer", "actor_train", "reference"]
    ]
    profiled = config(actor_infer=role("0-1", "vllm", VLLMConfig()))
    assert start.fixed_engine_memory(profiled) == set()


def test_a_colocated_role_leaves_its_devices_before_a_later_wave_uses_them():
    names = ["actor_train", "actor_infer", "reference", "rewards.math"]
    plan = plan_placement(config(actor_infer=role("0-1", "vllm", VLLMConfig())))
    waves = init_waves(plan, names)
    colocated = {"actor_train", "actor_infer", "reference"}
    # The engine sleeps before the trainer and the reference load; they go after the last wave.
    assert offloads_after_waves(plan, waves, colocated) == [["actor_infer"], ["actor_train", "reference"]]
    # A role of an early wave that no later wave touches is offloaded with the last wave.
    mixed = plan_placement(
        config(
            actor_infer=role("0-1", "vllm", VLLMConfig()),
            reference=role("2-3", "hf_infer", HFInferConfig()),
            actor_train=role("0-1", "fsdp2_train", FSDP2Config()),
        )
    )
    waves = init_waves(mixed, names)
    assert waves == [["actor_infer", "reference", "rewards.math"], ["actor_train"]]
    assert offloads_after_waves(mixed, waves, {"actor_infer", "actor_train", "reference"}) == [
        ["actor_infer"],
        ["actor_train", "reference"],
    ]
    # One wave (CPU slots): everything colocated goes once it is done; nothing else is offloaded.
    assert offloads_after_waves(plan, [names], {"actor_train"}) == [["actor_train"]]


@pytest.mark.parametrize(
    ("device", "trainer", "offloaded"),
    [
        # CPU slots: hf_infer and fsdp2_train only free device memory, so nothing is offloaded ...
        ("cpu", "fsdp2_train", set()),
        # ... but megatron's offloader frees and restores storage on CPU too (its CPU tests use it).
        ("cpu", "megatron_train", {"actor_train"}),
        # GPUs: every colocated model role, as before.
        ("cuda", "fsdp2_train", {"actor_train", "actor_infer", "reference"}),
    ],
)
def test_offloaded_roles_on_cpu_slots_and_gpus(device, trainer, offloaded):
    cfg = config(device, trainer)
    assert offloaded_roles(cfg, plan_placement(cfg)) == offloaded


def test_a_role_on_its_own_devices_is_never_offloaded():
    cfg = config("cuda", reference=role("2-3", "hf_infer", HFInferConfig()))
    assert offloaded_roles(cfg, plan_placement(cfg)) == {"actor_train", "actor_infer"}


def test_every_roles_workers_start_at_once_and_a_failure_keeps_the_others(monkeypatch):
    """Each Cluster() blocks until its ranks answer; they are built on threads, so a role whose
    workers are slow to answer does not hold back the next role's processes."""
    started = threading.Barrier(4, timeout=10)  # every role's start is in flight together

    class FakeCluster:
        def __init__(self, name, *args):
            started.wait()
            if name == "reference":
                raise RuntimeError("reference failed to start")
            self.role = name

    from roll.pipeline.workers import classes

    monkeypatch.setattr(classes, "role_classes", lambda name: (FakeCluster, None))
    cfg = config()
    clusters = {}
    with pytest.raises(RuntimeError, match="reference failed to start"):
        prestart.start_workers(cfg, plan_placement(cfg), None, None, clusters)
    # The roles that did start are kept, in config order, so shutdown stops them.
    assert list(clusters) == ["actor_train", "actor_infer", "rewards.math"]


def test_startup_metrics_name_each_phase_and_the_time_to_the_first_step():
    timer = StageTimer()
    record_launch(timer)  # this process's life so far: the test session's imports included
    with timer("ray"):
        time.sleep(0.01)
    metrics = startup_metrics(timer)
    assert metrics["startup/ray_s"] >= 0.01
    assert metrics["startup/launch_s"] > 0
    # From this process's start: at least as long as the phases it saw, one after the other.
    assert metrics["startup/to_first_step_s"] >= metrics["startup/launch_s"] + metrics["startup/ray_s"]


def test_the_launchers_marks_split_the_launch_phase_into_parts_that_sum_to_it():
    from roll.pipeline.rlvr import perf

    perf.mark_launch("stale")
    perf.mark_launch("imports", first=True)  # a new launch drops an earlier one's marks
    time.sleep(0.01)
    perf.mark_launch("checks")
    timer = StageTimer()
    record_launch(timer)
    parts = {k: v for k, v in timer.times.items() if k.startswith("time/launch.")}
    assert list(parts) == ["time/launch.imports", "time/launch.checks", "time/launch.to_pipeline"]
    assert parts["time/launch.checks"] >= 0.01
    assert sum(parts.values()) == pytest.approx(timer.times["time/launch"])
    again = StageTimer()
    record_launch(again)  # the marks were taken: a second run in this process has none
    assert list(again.times) == ["time/launch"]


def test_prestart_hands_its_ray_and_workers_to_the_run_of_the_same_config_and_raises_its_error(monkeypatch):
    """The launcher starts Ray, the hosts and every role's workers on a thread (``prestart``) while
    it checks the config; start_clusters takes them for that config, an error there raises at the
    take (Ray) or at ``wait_workers`` (a role's start, with the roles that started kept), and one
    nobody takes is stopped (``discard_prestart``)."""
    import roll.distributed.scheduler.resource_manager as resource_manager

    class FakeResources:
        def __init__(self, plan, device):
            if device == "cuda":
                raise RuntimeError("no GPUs here")
            self.plan, self.device, self.destroyed = plan, device, False

        def destroy(self):
            self.destroyed = True

    failing: set[str] = set()

    def fake_start_workers(config, plan, resources, hosted, clusters):
        assert resources.plan == plan and hosted == {"actor_train": ([], True)}
        for name in config.roles():
            if name in failing:
                raise RuntimeError(f"{name} failed to start")
            clusters[name] = f"cluster of {name}"

    monkeypatch.setattr(resource_manager, "ResourceManager", FakeResources)
    monkeypatch.setattr(prestart, "start_hosts", lambda config, plan, rm: ({"actor_train": ([], True)}, []))
    monkeypatch.setattr(prestart, "start_workers", fake_start_workers)
    cfg = config()
    prestart.prestart(cfg)
    early = prestart.take_prestart(cfg)
    assert early.resources.plan == plan_placement(cfg) and early.hosts == []
    assert list(early.wait_workers()) == ["actor_train", "actor_infer", "reference", "rewards.math"]
    assert prestart.take_prestart(cfg) is None  # taken once

    failing.add("reference")
    prestart.prestart(cfg)
    early = prestart.take_prestart(cfg)
    with pytest.raises(RuntimeError, match="reference failed to start"):
        early.wait_workers()
    assert list(early.clusters) == ["actor_train", "actor_infer"]  # for the run's shutdown

    prestart.prestart(cfg)
    assert prestart.take_prestart(config()) is None  # another config: stopped, the run starts its own
    prestart.prestart(cfg)
    prestart.discard_prestart()
    assert prestart.take_prestart(cfg) is None

    gpu = config("cuda")
    prestart.prestart(gpu)
    with pytest.raises(RuntimeError, match="no GPUs here"):
        prestart.take_prestart(gpu)


def test_the_launch_checks_leave_every_shipped_rlvr_config_as_loaded():
    """The workers are built from the config while the launcher checks it (``prestart``): the
    checks and the memory plan must not change it, or the workers would run another config."""
    import pickle

    from roll.configs.loader import load_config
    from roll.launch.checks import check_before_launch
    from roll.planner.report import memory_report

    examples = Path(__file__).resolve().parents[1] / "examples" / "config"
    checked = 0
    for path in sorted(examples.glob("*.yaml")):
        if "sft" in path.name:
            continue
        cfg = load_config(path, [])
        before = pickle.dumps(cfg)
        memory_report(cfg, check_before_launch(cfg, files=False))
        assert pickle.dumps(cfg) == before, path.name
        checked += 1
    assert checked >= 10


def test_the_timeline_is_the_last_ranks_marks_of_the_role_that_finished_last(caplog):
    """record_initialize keeps each role's slowest seconds, logs the marks of its last-finishing
    rank after the driver's start, and the ``timeline.*`` phases follow the role finishing last."""
    from roll.utils.start_marks import StartMarks, process_started_at

    t0 = process_started_at()

    def report(seconds: float, ready: float, done: float, waited: float = 0.0) -> dict:
        marks = StartMarks()
        marks.at.update(
            process=t0 + 1.0, ready=t0 + ready, initialize=t0 + ready + 1.0, initialized=t0 + done
        )
        if waited:
            marks.span("imports_wait", waited)
        return marks.report(seconds)

    timer = StageTimer()
    with caplog.at_level("INFO", logger="roll"):
        start.record_initialize(timer, "actor_train", [report(9.0, 5.0, 20.0, 2.5), report(12.0, 6.0, 18.0)])
        start.record_initialize(timer, "rewards.math", [report(1.0, 4.0, 7.0)])  # ended earlier
    metrics = startup_metrics(timer)
    assert metrics["startup/initialize.actor_train_s"] == 12.0  # the slowest rank's seconds
    assert metrics["startup/initialize.rewards.math_s"] == 1.0
    # The rank that ended last (initialized at +20 s), not the slowest one, and not the reward role.
    assert metrics["startup/timeline.at.ready_s"] == pytest.approx(5.0)
    assert metrics["startup/timeline.at.initialized_s"] == pytest.approx(20.0)
    assert metrics["startup/timeline.imports_wait_s"] == pytest.approx(2.5)
    assert "start-up of actor_train (its last rank" in caplog.text and "at.initialized 20.0" in caplog.text
    start.record_driver_marks(timer, {"ray": t0 + 2.0, "probed": t0 + 3.5})
    start.record_initialize(timer, "reference", [report(3.0, 7.0, 25.0)])  # a later wave ends after
    metrics = startup_metrics(timer)
    assert metrics["startup/timeline.at.initialized_s"] == pytest.approx(25.0)
    assert "startup/timeline.imports_wait_s" not in metrics  # that role waited for no imports
    assert metrics["startup/timeline.driver.ray_s"] == pytest.approx(2.0)  # kept across roles
    assert metrics["startup/timeline.driver.probed_s"] == pytest.approx(3.5)


def test_a_workers_start_marks_run_from_its_process_start_to_its_initialize():
    from roll.utils.start_marks import ORDER, StartMarks, init_span, relative_marks

    marks = StartMarks()
    with init_span("left.over"):  # before this initialize: not its span
        pass
    marks.mark("initialize")
    marks.span("imports_wait", 0.5)
    with init_span("megatron.build"):
        time.sleep(0.01)
    marks.mark("initialized")
    rel = relative_marks(marks.report(1.0), since=marks.at["process"])
    assert list(rel) == [*(f"at.{m}" for m in ORDER), "imports_wait", "megatron.build"]
    assert 0.0 <= rel["at.ready"] <= rel["at.initialize"] <= rel["at.initialized"]
    assert rel["megatron.build"] >= 0.01
    assert marks.report(1.0)["spans"] == {"imports_wait": 0.5}  # taken once
