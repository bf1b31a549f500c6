"""Command line of ``examples/start_rlvr_pipeline.py``.

    python examples/start_rlvr_pipeline.py --config_name rlvr_config [--config_path DIR] [--dry_run] [key.sub=value ...]

A bad config prints one ``ConfigError: <key path>: <message>`` line and exits with code 2; a failed
or hung worker one ``WorkerError``/``WorkerTimeout`` line (exit 1, its traceback in run.log); a
checkpoint or run file that cannot be trusted or written (``CheckpointError`` / ``StorageError``,
naming the file) exits with 3; a reward role failing on too many samples (``RewardError``) with 4;
SIGTERM and SIGINT stop the workers and exit with 143 and 130 (see docs/runtime_faults.md and
docs/faults.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.core.errors import RewardError, StorageError
from roll.distributed.model_update.errors import ModelUpdateError
from roll.distributed.scheduler.errors import WorkerError
from roll.distributed.scheduler.ray_shutdown import RAY_SHUTDOWN_GRACE_S, shutdown_ray
from roll.pipeline.common.checkpoint import checkpoint_root, newest_checkpoint
from roll.pipeline.common.signals import interruption, release_signals, take_signals, terminal
from roll.pipeline.rlvr.prestart import discard_prestart


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run an RLVR pipeline from a YAML config.")
    parser.add_argument(
        "--config_name", required=True, help="file name in --config_path, with or without .yaml"
    )
    parser.add_argument("--config_path", default="examples/config", help="directory of config files")
    parser.add_argument(
        "--dry_run", action="store_true", help="validate and print the placement plan, then exit"
    )
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides applied before validation")
    return parser.parse_args(argv)


def config_file(config_path: str, config_name: str) -> Path:
    name = config_name if config_name.endswith((".yaml", ".yml")) else f"{config_name}.yaml"
    path = Path(config_path) / name
    if not path.exists() and not Path(config_path).is_absolute():
        # Also accept paths relative to the repository root when started from elsewhere.
        alt = Path(__file__).resolve().parents[2] / config_path / name
        if alt.exists():
            return alt
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    take_signals()
    try:
        # Only what reading the config and starting Ray need (no torch, transformers or engine):
        # Ray and the workers start before the checks' imports, which take seconds (~15 s on a
        # fresh GPU host), and go on while they run (docs/architecture_ray.md).
        from roll.configs.loader import load_config
        from roll.pipeline.rlvr.perf import mark_launch
        from roll.pipeline.rlvr.prestart import prestart

        mark_launch("imports", first=True)  # the interpreter and the launcher's own imports
        config = load_config(config_file(args.config_path, args.config_name), args.overrides)
        if not args.dry_run and prestarts_here(config):
            prestart(config)
        mark_launch("config")
        from roll.distributed.scheduler.placement import format_plan
        from roll.launch.checks import check_before_launch
        from roll.launch.roles import check_engines_installed, engines_missing_here
        from roll.planner.report import memory_report

        plan = check_before_launch(config)  # for --dry_run and a launch alike, before any worker
        mark_launch("checks")
        memory = memory_report(config, plan)  # predicted peaks; ConfigError with memory_check: error
        mark_launch("memory_plan")
        if args.dry_run:
            kind = "CPU slot" if config.device == "cpu" else "GPU"
            print(format_plan(plan, device_kind=kind))
            print(memory.format())
            for missing in engines_missing_here(config):
                print(f"missing engine: {missing} (a one-node launch from here stops on this)")
            if memory.warnings:  # refused: a launch would run out of device memory (memory_check: warn)
                print(f"roll: --dry_run: does not fit: {memory.warnings[0]}", file=sys.stderr)
                return 1
            return 0
        check_engines_installed(config, plan)
        for warning in memory.warnings:
            print(f"WARNING: {warning}", file=sys.stderr)
        return run(config)
    except ConfigError as exc:
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:  # the checkpoint to resume from fails verification (check_files)
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # a signal before any worker started
        stop = interruption()
        print(f"roll: {stop}", file=terminal())
        return stop.exit_code
    finally:
        discard_prestart()  # one a ConfigError left behind
        release_signals()


def prestarts_here(config: RLVRConfig) -> bool:
    """Whether Ray and the device reservation start while the driver checks the config: on CPU
    slots, and for a GPU config where its GPUs can be: a Ray cluster to join (``RAY_ADDRESS``) or
    NVIDIA devices on this machine. A GPU config launched on a machine with neither fails its
    checks, and starting Ray for it would only slow that down."""
    if config.device == "cpu":
        return True
    if os.environ.get("RAY_ADDRESS"):
        return True
    return any(os.path.exists(path) for path in NVIDIA_MARKERS) or shutil.which("nvidia-smi") is not None


# Present wherever the NVIDIA driver exposes GPUs to this machine or container.
NVIDIA_MARKERS = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


# torch intra-op threads of the driver process. Its tensors are a step's rollouts (a few MB), so a
# pool as wide as the host only adds wake-ups, which cost most where the workers keep the cores busy:
# with both cores of a 2-core machine loaded, the 1.5B shape's advantages stage took 85.7 ms median
# (0.5 s worst) on 2 threads and 6.5 ms on 1 (benchmarks/driver_threads.py); on the 64-core GPU host
# it took 15-300 ms a step.
DRIVER_TORCH_THREADS = 1


def run(config: RLVRConfig) -> int:
    """Run the pipeline; a failure or a signal ends it with one line on stderr, printed after Ray
    has shut down (so it is the last line), and the details in run.log (the clean-up in
    ``run_pipeline`` has stopped the workers by then)."""
    import torch

    from roll.pipeline.rlvr import pipeline

    torch.set_num_threads(DRIVER_TORCH_THREADS)  # this process is the driver from here on
    try:
        pipeline.run_pipeline(config)
        code, line = 0, None
    except ConfigError as exc:  # found while loading the data, or output_dir in use
        code, line = 2, f"ConfigError: {exc}"
    except (WorkerError, ModelUpdateError, StorageError, RewardError) as exc:
        code, line = _report(exc, config)
    except KeyboardInterrupt as exc:  # SIGTERM/SIGINT; Ray may re-raise it as a plain one
        code, line = _report(exc, config)
    finally:
        discard_prestart()  # host processes a failure before start_clusters left (Ray still up)
        clean = shutdown_ray(RAY_SHUTDOWN_GRACE_S)
    if line:
        print(line, file=terminal())  # after a signal, stderr itself goes to run.log
    if not clean:  # ray.shutdown is blocked on dying Ray processes (a SIGTERM to the process group)
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Leave without the interpreter's exit hooks: Ray's would block on the same dead processes."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr, terminal()):
        stream.flush()
    os._exit(code)


def _report(exc: BaseException, config: RLVRConfig) -> tuple[int, str]:
    """Log the details of how the run ended to run.log; the exit code and the one line for stderr."""
    log = logging.getLogger("roll")
    if isinstance(exc, KeyboardInterrupt):
        stop = interruption()
        last = newest_checkpoint(checkpoint_root(config))  # not re-hashed: the user is waiting
        kept = f"last checkpoint: {last}" if last else "no checkpoint was saved"
        log.debug("interrupted at:", exc_info=exc)
        return stop.exit_code, f"roll: {stop}; the workers were stopped; {kept}"
    if isinstance(exc, WorkerError):
        # The worker's traceback goes to the run's log, where it helps without burying the message.
        log.debug("worker traceback:\n%s", exc.remote_traceback)
    log.debug("driver traceback:", exc_info=exc)
    code = (
        3 if isinstance(exc, StorageError) else 4 if isinstance(exc, RewardError) else 1
    )  # CheckpointError is a StorageError
    return code, f"{type(exc).__name__}: {exc}"
