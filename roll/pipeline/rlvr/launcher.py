"""Command line of ``examples/start_rlvr_pipeline.py``.

    python examples/start_rlvr_pipeline.py --config_name rlvr_config [--config_path DIR] [--dry_run] [key.sub=value ...]

A bad config prints one ``ConfigError: <key path>: <message>`` line and exits with code 2; a
checkpoint or run file that cannot be trusted or written (``CheckpointError`` / ``StorageError``,
naming the file) exits with 3; a reward role failing on too many samples (``RewardError``) with 4.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from roll.configs.errors import ConfigError, RewardError, StorageError
from roll.distributed.scheduler.errors import WorkerError


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
        alt = Path(__file__).resolve().parents[3] / config_path / name
        if alt.exists():
            return alt
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from roll.configs.loader import load_config
        from roll.configs.preflight import check_before_launch
        from roll.distributed.scheduler.placement import format_plan, plan_placement
        from roll.planner.report import memory_report

        config = load_config(config_file(args.config_path, args.config_name), args.overrides)
        check_before_launch(config)  # files, tags, reward options: for --dry_run and a launch alike
        plan = plan_placement(config)
        memory = memory_report(config, plan)  # predicted peaks; ConfigError with memory_check: error
        if args.dry_run:
            kind = "CPU slot" if config.device == "cpu" else "GPU"
            print(format_plan(plan, device_kind=kind))
            print(memory.format())
            return 0
        for warning in memory.warnings:
            print(f"WARNING: {warning}", file=sys.stderr)
        from roll.pipeline.rlvr.pipeline import run_pipeline

        run_pipeline(config)
        return 0
    except ConfigError as exc:
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    except (StorageError, RewardError) as exc:  # CheckpointError is a StorageError
        logging.getLogger("roll").debug("%s", exc, exc_info=True)
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 3 if isinstance(exc, StorageError) else 4
    except WorkerError as exc:
        # One line names the role, rank and the original exception; the worker's traceback goes
        # to the run's log, where it helps without burying the message.
        logging.getLogger("roll").debug("worker traceback:\n%s", exc.remote_traceback)
        print(f"WorkerError: {exc}", file=sys.stderr)
        return 1
