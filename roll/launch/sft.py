"""Command line of ``examples/start_sft_pipeline.py``.

    python examples/start_sft_pipeline.py --config_name sft_config [--config_path DIR] [--dry_run] [key.sub=value ...]

``--dry_run`` checks the keys, strategies and placement and prints the plan without looking for
the model or data files (so a cluster's config plans anywhere). Exit codes as for the RLVR launcher: 2 for a ``ConfigError`` (one line naming the key or file),
3 for a checkpoint or run file that cannot be trusted or written, 1 for a failed worker.
"""

from __future__ import annotations

import logging
import sys

from roll.configs.errors import ConfigError
from roll.core.errors import StorageError
from roll.distributed.scheduler.errors import WorkerError
from roll.launch.rlvr import config_file, parse_args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from roll.configs.sft_config import load_sft_config
        from roll.distributed.scheduler.placement import format_plan
        from roll.launch.checks import check_sft_config

        config = load_sft_config(config_file(args.config_path, args.config_name), args.overrides)
        plan = check_sft_config(config, files=not args.dry_run)
        if args.dry_run:
            kind = "CPU slot" if config.device == "cpu" else "GPU"
            print(format_plan(plan, device_kind=kind))
            return 0
        from roll.pipeline.sft.pipeline import run_sft_pipeline

        run_sft_pipeline(config)
        return 0
    except ConfigError as exc:
        print(f"ConfigError: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:
        logging.getLogger("roll").debug("%s", exc, exc_info=True)
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 3
    except WorkerError as exc:
        logging.getLogger("roll").debug("worker traceback:\n%s", exc.remote_traceback)
        print(f"WorkerError: {exc}", file=sys.stderr)
        return 1
