"""The driver's advantages stage at a run's shape, by torch intra-op thread count, idle and beside
busy processes (the GPU host's workers keep cores busy while the driver computes).

    python benchmarks/driver_threads.py                              # the 1.5B shape: 256 x 512
    python benchmarks/driver_threads.py --rows 512 --length 1024 --threads 1,2,4,8 --busy 0,2

Each cell: ``compute_advantages_stage`` of the config's algorithm (GRPO with a KL loss as in
``qwen2.5-1.5B-rlvr_megatron_vllm_2gpus``) on random tensors of that shape, median and worst of
``--repeats`` calls. ``--busy N`` starts N processes that spin on a core each for the row.
The launcher runs the driver on ``roll.launch.rlvr.DRIVER_TORCH_THREADS`` threads.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from roll.configs.loader import load_config  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.pipeline.rlvr.stages import compute_advantages_stage  # noqa: E402

CONFIG = REPO / "examples/config/qwen2.5-1.5B-rlvr_megatron_vllm_2gpus.yaml"


def rollouts(rows: int, length: int, group: int, generator: torch.Generator) -> Batch:
    """What the stage receives: masks, group ids, scores and the two log-prob tensors."""
    return Batch(
        {
            "response_mask": (torch.rand(rows, length, generator=generator) < 0.9).float(),
            "group_id": torch.arange(rows) // group,
            "scores": torch.rand(rows, generator=generator),
            "ref_log_probs": -10 * torch.rand(rows, length, generator=generator),
            "old_log_probs": -10 * torch.rand(rows, length, generator=generator),
        }
    )


def spin() -> None:
    while True:
        pass


def time_stage(run, rows: int, length: int, group: int, repeats: int) -> tuple[float, float]:
    """(median, worst) seconds of the stage over ``repeats`` fresh batches."""
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for _ in range(repeats):
        batch = rollouts(rows, length, group, generator)
        start = time.perf_counter()
        compute_advantages_stage(run, batch)
        seconds.append(time.perf_counter() - start)
    seconds.sort()
    return seconds[len(seconds) // 2], seconds[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=256, help="responses per step")
    parser.add_argument("--length", type=int, default=512, help="response tokens")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    parser.add_argument("--busy", default="0,2", help="comma-separated counts of spinning processes")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    run = types.SimpleNamespace(config=load_config(CONFIG))
    print(f"{args.rows} x {args.length}, {os.cpu_count()} CPUs, {args.repeats} repeats")
    print(f"{'busy':>4} {'threads':>7} {'median ms':>10} {'worst ms':>9}")
    for busy in (int(b) for b in args.busy.split(",")):
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
        for process in spinners:
            process.start()
        try:
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                median, worst = time_stage(run, args.rows, args.length, args.group, args.repeats)
                print(f"{busy:>4} {threads:>7} {median * 1e3:>10.2f} {worst * 1e3:>9.2f}")
        finally:
            for process in spinners:
                process.terminate()
                process.join()


if __name__ == "__main__":
    main()
