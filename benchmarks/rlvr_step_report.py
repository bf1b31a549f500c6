"""Print an RLVR run's per-step performance table from its metrics.jsonl.

Per step: time per stage, tokens/s/device, generation tokens/s, peak memory per device, the
model-update time and its ratio to bytes / ``--bw_gbps`` (an NCCL broadcast bandwidth measured on
the same machine, e.g. the ``bw`` column of benchmarks/model_update.py), and the train/infer
log-prob mismatch.

    python benchmarks/rlvr_step_report.py output/qwen3-30B-A3B-4l-rlvr-4gpus/<run>/metrics.jsonl --bw_gbps 360
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from roll.utils.tracking import read_metrics  # noqa: E402

STAGES = ("generate", "reward", "reference", "old_log_probs", "train", "model_update", "step")


def step_table(rows: list[dict], bw_gbps: float | None) -> list[str]:
    head = [f"t_{s} s" for s in STAGES] + ["tok/s/dev", "gen tok/s", "peak GiB max", "update s", "update GB"]
    head += ["ratio to bound", "mismatch"]
    lines = ["| step | " + " | ".join(head) + " |", "|" + "---|" * (len(head) + 1)]
    for row in rows:
        if "time/step" not in row:
            continue  # step 0: validation only
        cells = [f"{row.get(f'time/{s}', 0.0):.2f}" for s in STAGES]
        cells.append(f"{row.get('perf/tokens_per_s_per_device', 0.0):,.0f}")
        cells.append(f"{row.get('perf/generate_tokens_per_s', 0.0):,.0f}")
        peak = row.get("memory/peak_used_gib_max")
        cells.append("-" if peak is None else f"{peak:.1f}")
        update_s, nbytes = row.get("model_update/time_s"), row.get("model_update/bytes")
        cells.append("-" if update_s is None else f"{update_s:.3f}")
        cells.append("-" if nbytes is None else f"{nbytes / 1e9:.2f}")
        if bw_gbps and update_s and nbytes:
            cells.append(f"{update_s / (nbytes / (bw_gbps * 1e9)):.2f}")
        else:
            cells.append("-")
        cells.append(f"{row.get('rollout/logprob_mismatch', float('nan')):.4f}")
        lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
    return lines


def memory_table(rows: list[dict]) -> list[str]:
    keys = sorted({k for row in rows for k in row if k.startswith("memory/")})
    if not keys:
        return []
    lines = ["| metric (GiB, max over steps) | value |", "|---|---|"]
    for key in keys:
        values = [row[key] for row in rows if key in row]
        lines.append(f"| {key} | {max(values):.1f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    parser.add_argument("--bw_gbps", type=float, default=None, help="NCCL broadcast GB/s for the bound")
    args = parser.parse_args()
    if not args.metrics.is_file():
        raise SystemExit(f"{args.metrics}: no such metrics file")
    rows = read_metrics(args.metrics)
    print("\n".join(step_table(rows, args.bw_gbps)))
    print()
    print("\n".join(memory_table(rows)))
    losses = [(r["step"], r["actor/pg_loss"], r.get("actor/grad_norm")) for r in rows if "actor/pg_loss" in r]
    print("\nstep, pg_loss, grad_norm:", "; ".join(f"{s}: {loss:.4f}, {g:.3f}" for s, loss, g in losses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
