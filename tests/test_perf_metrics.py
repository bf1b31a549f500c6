"""Per-step throughput and memory metrics (roll/pipeline/rlvr/perf.py, roll/utils/memory.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from roll.core.batch import Batch
from roll.pipeline.rlvr.perf import memory_metrics, model_devices, throughput_metrics
from roll.utils.memory import GIB, DeviceMemoryMonitor, memory_stats


def role_plan(devices, cpu_only=False, per_worker=1):
    workers = [
        SimpleNamespace(devices=tuple(devices[i : i + per_worker]))
        for i in range(0, len(devices), per_worker)
    ]
    return SimpleNamespace(devices=tuple(devices), workers=workers, cpu_only=cpu_only)


class FakeCluster:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def fake_run(roles: dict, stats: dict):
    plan = SimpleNamespace(roles=roles)
    return SimpleNamespace(plan=plan, clusters={name: FakeCluster(s) for name, s in stats.items()})


def test_throughput_counts_prompt_and_response_tokens_over_model_devices():
    run = fake_run(
        {
            "actor_train": role_plan([0, 1]),
            "actor_infer": role_plan([2, 3]),
            "rewards.math": role_plan([0], cpu_only=True),
        },
        {},
    )
    batch = Batch(
        {
            "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "response_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
        }
    )
    times = {"time/generate": 2.0, "time/train": 1.0, "time/validation": 100.0, "time/reward": 1.0}
    out = throughput_metrics(run, batch, times)
    assert model_devices(run) == (0, 1, 2, 3)
    assert out["perf/tokens"] == 11 and out["perf/response_tokens"] == 6
    assert out["perf/tokens_per_s_per_device"] == pytest.approx(11 / 4.0 / 4)  # validation left out
    assert out["perf/generate_tokens_per_s"] == pytest.approx(6 / 2.0)
    assert out["perf/train_tokens_per_s_per_device"] == pytest.approx(11 / 1.0 / 2)


def test_memory_metrics_take_the_largest_peak_per_device_and_role():
    roles = {
        "actor_train": role_plan([0, 1]),
        "actor_infer": role_plan([0, 1, 2, 3], per_worker=2),  # TP=2 engine workers
        "rewards.math": role_plan([0], cpu_only=True),
    }
    stats = {
        "actor_train": [
            {"peak_allocated": 10.0, "peak_reserved": 12.0, "device_peak_used": 30.0},
            {"peak_allocated": 11.0, "peak_reserved": 13.0, "device_peak_used": 25.0},
        ],
        "actor_infer": [
            {"peak_allocated": 5.0, "peak_reserved": 6.0, "device_peak_used": 40.0},
            {"peak_allocated": 4.0, "peak_reserved": 7.0, "device_peak_used": 20.0},
        ],
        "rewards.math": [{"unexpected": 1.0}],  # never asked: CPU-only role
    }
    out = memory_metrics(fake_run(roles, stats))
    assert out == {
        "memory/actor_train/peak_allocated_gib": 11.0,
        "memory/actor_train/peak_reserved_gib": 13.0,
        "memory/actor_infer/peak_allocated_gib": 5.0,
        "memory/actor_infer/peak_reserved_gib": 7.0,
        "memory/device0/peak_used_gib": 40.0,
        "memory/device1/peak_used_gib": 25.0,
        "memory/device2/peak_used_gib": 20.0,
        "memory/peak_used_gib_max": 40.0,
    }


def test_cpu_memory_stats_report_peak_rss():
    _ = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched
    stats = memory_stats(torch.device("cpu"), None)
    assert set(stats) == {"peak_rss"}
    assert stats["peak_rss"] * GIB >= 64 << 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_monitor_sees_a_peak_that_is_gone():
    device = torch.device("cuda", 0)
    monitor = DeviceMemoryMonitor(device, interval_s=0.01)
    try:
        before = monitor.take_peak()
        big = torch.empty(2 << 30, dtype=torch.uint8, device=device)
        monitor.sample()
        del big
        torch.cuda.empty_cache()
        stats = memory_stats(device, monitor)
        assert stats["device_peak_used"] * GIB >= before + (2 << 30) - (64 << 20)
        assert stats["peak_allocated"] * GIB >= 2 << 30
        # A new window starts: the freed 2 GiB are not in the next peak.
        assert memory_stats(device, monitor)["device_peak_used"] * GIB < before + (1 << 30)
    finally:
        monitor.stop()


class _SwappingCluster:
    def __init__(self, log: list[str]):
        self.log = log

    def reload_states(self):
        self.log.append("reload")

    def offload_states(self):
        self.log.append("offload")


def test_swaps_of_colocated_roles_are_timed_per_role_and_taken_once_a_step():
    from roll.pipeline.common.timing import SwapTimes
    from roll.pipeline.rlvr import stages

    log: list[str] = []
    run = SimpleNamespace(
        colocated={"actor_infer"}, swaps=SwapTimes(), model=lambda role: _SwappingCluster(log)
    )
    for _ in range(2):
        with stages.on_devices(run, "actor_infer"):
            log.append("generate")
    with stages.on_devices(run, "reference"):  # not colocated: no swap, no metric
        log.append("score")
    assert log == ["reload", "generate", "offload"] * 2 + ["score"]
    taken = run.swaps.take()
    assert set(taken) == {"swap/actor_infer/reload_s", "swap/actor_infer/offload_s"}
    assert all(v >= 0 for v in taken.values())
    assert run.swaps.take() == {}  # the next step starts from zero
