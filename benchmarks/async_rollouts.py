"""Synchronous vs asynchronous generation on one config: runs it twice (``async_generation_ratio``
0 and 1, everything else equal) and prints step time and validation accuracy side by side.

    python benchmarks/async_rollouts.py --config_name rlvr_megatron_vllm_2gpus_disagg max_steps=30 \
        save_steps=0 'off_policy_correction={mode: tis, level: token, cap: 2.0}'
    python benchmarks/async_rollouts.py --config_name rlvr_config_async max_steps=20   # CPU
    python benchmarks/async_rollouts.py --report output/<sync>/metrics.jsonl output/<async>/metrics.jsonl

The first steps are left out of the median step time (``--skip``, default 2: engine warm-up, and an
asynchronous run's first step has nothing to overlap with). Goal of issue 17: async/sync <= 0.65 in
the disaggregated 2-GPU layout when generation and training take similar time, validation equal.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from roll.configs.loader import load_config  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402


def run(config_name: str, ratio: int, overrides: list[str]) -> Path:
    exp = f"{config_name}-{'async' if ratio else 'sync'}"
    # A benchmark run replaces its previous result (the pipeline refuses that unless told to).
    args = [f"async_generation_ratio={ratio}", f"exp_name={exp}", "overwrite_output_dir=true", *overrides]
    cmd = [sys.executable, str(REPO / "examples/start_rlvr_pipeline.py"), "--config_name", config_name, *args]
    subprocess.run(cmd, check=True, cwd=REPO)
    config = load_config(REPO / "examples/config" / f"{config_name}.yaml", args)
    return REPO / config.output_dir / "metrics.jsonl"  # an absolute output_dir stays as is


def summary(rows: list[dict], skip: int) -> dict:
    steps = [r for r in rows if "time/step" in r and r["step"] > skip]
    median = lambda key: statistics.median(r.get(key, 0.0) for r in steps)  # noqa: E731
    return {
        "step": median("time/step"),
        "generate": median("time/generate"),
        "train": median("time/train"),
        "wait": median("time/wait_rollouts"),
        "val": {r["step"]: r["val/score/mean"] for r in rows if "val/score/mean" in r},
        "staleness": max((r.get("rollout/staleness", 0.0) for r in steps), default=0.0),
    }


def table(sync: dict, asyn: dict) -> list[str]:
    lines = [
        "| run | median step s | generate s | train s | wait s | max staleness |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in (("sync", sync), ("async", asyn)):
        cells = f"{s['step']:.2f} | {s['generate']:.2f} | {s['train']:.2f} | {s['wait']:.2f} | {s['staleness']:.0f}"
        lines.append(f"| {name} | {cells} |")
    lines.append(f"\nasync / sync step time: {asyn['step'] / sync['step']:.2f}\n")
    steps = sorted(set(sync["val"]) | set(asyn["val"]))
    lines += ["| step | " + " | ".join(str(s) for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for name, s in (("val sync", sync), ("val async", asyn)):
        lines.append(
            f"| {name} | " + " | ".join(f"{s['val'].get(k, float('nan')):.3f}" for k in steps) + " |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config_name")
    parser.add_argument("--report", nargs=2, metavar=("SYNC_JSONL", "ASYNC_JSONL"))
    parser.add_argument("--skip", type=int, default=2)
    args, overrides = parser.parse_known_args()
    if args.report:
        paths = [Path(p) for p in args.report]
    elif args.config_name:
        paths = [run(args.config_name, ratio, overrides) for ratio in (0, 1)]
    else:
        parser.error("give --config_name or --report")
    sync, asyn = (summary(read_metrics(p), args.skip) for p in paths)
    print("\n".join(table(sync, asyn)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
