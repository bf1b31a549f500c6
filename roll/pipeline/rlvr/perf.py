"""Per-step performance metrics: token throughput and peak memory per device and per role.

    metrics |= throughput_metrics(run, batch, timer.times) | memory_metrics(run)

``perf/tokens_per_s_per_device`` counts every prompt and response token of the step's batch over
the step time (validation left out) and every device a model role holds (reward workers on CPU not counted), the
number peers report as tokens/s/GPU. ``memory/device<d>/peak_used_gib`` is the largest
device-wide used memory sampled on global device ``d`` since the previous step (every process on
it: colocated roles, caches, CUDA contexts); ``memory/<role>/peak_allocated_gib`` is the largest
allocator peak among the role's ranks. On CPU only ``memory/<role>/peak_rss_gib`` is reported.

``perf/driver_gc_s`` / ``perf/driver_gc_max_s`` are the driver's garbage-collection pauses during
the step, summed and the longest (``roll.utils.gc_pauses``): a collection stops the driver's
threads and shows up inside whichever stage it lands in. ``perf/wall_s`` is the driver process's
age when the step ends; the first row a run logs also
carries its start-up phases, ``startup/*_s`` (``startup_metrics``). ``swap/<role>/reload_s`` and
``swap/<role>/offload_s`` are the seconds a colocated role spent coming onto and leaving its devices
during the step (``roll.pipeline.common.timing.SwapTimes``; part of the stage that asked for it, e.g. waking vLLM is part of
``time/generate``); ``swap/actor_infer/refill_s`` the model update that refills an engine whose
sleep dropped its weights, right after its wake (also inside ``time/generate``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from roll.pipeline.common.timing import StageTimer

if TYPE_CHECKING:
    from roll.core.batch import Batch
    from roll.pipeline.rlvr.run import RLVRRun


def model_devices(run: RLVRRun) -> tuple[int, ...]:
    """Global device ids held by the model roles (every role that is not CPU-only)."""
    devices = {d for plan in run.plan.roles.values() if not plan.cpu_only for d in plan.devices}
    return tuple(sorted(devices))


def throughput_metrics(run: RLVRRun, batch: Batch, times: dict[str, float]) -> dict[str, float]:
    prompt_tokens = float(batch["prompt_mask"].sum())
    response_tokens = float(batch["response_mask"].sum())
    tokens = prompt_tokens + response_tokens
    out = {"perf/tokens": tokens, "perf/response_tokens": response_tokens, "perf/wall_s": process_uptime()}
    step_s = sum(v for k, v in times.items() if k != "time/validation")
    if step_s > 0:
        out["perf/tokens_per_s_per_device"] = tokens / step_s / max(1, len(model_devices(run)))
    if times.get("time/generate", 0.0) > 0:
        out["perf/generate_tokens_per_s"] = response_tokens / times["time/generate"]
    train = run.plan.roles["actor_train"]
    if times.get("time/train", 0.0) > 0:
        out["perf/train_tokens_per_s_per_device"] = tokens / times["time/train"] / len(train.devices)
    return out


def memory_metrics(run: RLVRRun) -> dict[str, float]:
    """Peaks since the previous call, from every model role's ranks (see the module docstring)."""
    out: dict[str, float] = {}
    for role, cluster in run.clusters.items():
        plan = run.plan.roles[role]
        if plan.cpu_only:
            continue
        stats = cluster.memory_stats()
        for key in ("peak_allocated", "peak_reserved", "peak_rss"):
            values = [s[key] for s in stats if key in s]
            if values:
                out[f"memory/{role}/{key}_gib"] = max(values)
        for worker, s in zip(plan.workers, stats):
            if "device_peak_used" not in s:
                continue
            # A worker's monitor samples its first device (a multi-GPU engine worker's others
            # belong to the engine's own processes).
            name = f"memory/device{worker.devices[0]}/peak_used_gib"
            out[name] = max(out.get(name, 0.0), s["device_peak_used"])
    device_peaks = [v for k, v in out.items() if k.startswith("memory/device")]
    if device_peaks:
        out["memory/peak_used_gib_max"] = max(device_peaks)
    return out


def process_uptime() -> float:
    """Seconds since this process started (the OS's creation time: imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


# The launcher's marks inside the launch phase: (part, seconds since the process started when that
# part ended), in order (``mark_launch``).
_launch_marks: list[tuple[str, float]] = []


def mark_launch(part: str, first: bool = False) -> None:
    """End the launch sub-phase ``part`` now (the launcher calls it after each of its steps;
    ``first`` drops the marks of an earlier launch in this process, e.g. a ``--dry_run``)."""
    if first:
        _launch_marks.clear()
    _launch_marks.append((part, process_uptime()))


def record_launch(timer: StageTimer) -> None:
    """The ``launch`` phase: from the process's start to the pipeline's (interpreter, imports, the
    launcher's config checks and memory plan, with Ray starting beside them where it prestarts),
    and ``launch.<part>`` for each part the launcher marked (the first from the process's start),
    then ``launch.to_pipeline`` for the rest."""
    now = process_uptime()
    timer.times["time/launch"] = now
    last = 0.0
    for part, at in _launch_marks:
        timer.times[f"time/launch.{part}"] = at - last
        last = at
    if _launch_marks:  # the pipeline's imports, the output_dir lock and the resume check
        timer.times["time/launch.to_pipeline"] = now - last
    _launch_marks.clear()


def startup_metrics(timer: StageTimer) -> dict[str, float]:
    """``startup/<phase>_s`` for each phase ``timer`` saw (launch, data, ray, workers, initialize,
    model_update_setup, first_sync, validation) and ``startup/to_first_step_s``: from the process's
    start to now, the start of the first step."""
    out = {f"startup/{key.removeprefix('time/')}_s": value for key, value in timer.times.items()}
    out["startup/to_first_step_s"] = process_uptime()
    return out
