"""Programs per second through the code sandbox backends, at a few concurrency levels.

    python benchmarks/sandbox_throughput.py                       # 200 programs, concurrency 1 and 2
    python benchmarks/sandbox_throughput.py --programs 500 --concurrency 1,2,4 --backends bubblewrap

Each program is a typical stdin/stdout solution (reads a number, prints a small computation), run
as the code_sandbox reward runs one test case. ``unsafe_local`` is the path roll had before
2026-11-27 (a subprocess with rlimits and an audit hook); ``bubblewrap`` is the isolated one
(fresh user/mount/pid/network namespaces, seccomp, rlimits, per program). Concurrency is the
number of programs in flight from one scoring process (threads, each waiting on a subprocess).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from roll.pipeline.rewards.sandbox import Limits, SandboxConfig, get_sandbox  # noqa: E402

PROGRAM = "n = int(input())\nprint(sum(i * i for i in range(n)) % 1000003)\n"


def throughput(backend: str, programs: int, concurrency: int) -> tuple[float, float]:
    """(programs/s, median seconds per program); every program must pass."""
    sandbox = get_sandbox(SandboxConfig(backend=backend))
    expected = str(sum(i * i for i in range(1000)) % 1000003) + "\n"

    def one(_: int) -> float:
        result = sandbox.run(PROGRAM, "1000", Limits(time_limit_s=10.0))
        if not result.ok or result.stdout != expected:
            raise RuntimeError(f"{backend}: a program failed: {result}")
        return result.seconds

    sandbox.run(PROGRAM, "1000", Limits())  # warm-up: imports, the seccomp filter, page cache
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        seconds = sorted(pool.map(one, range(programs)))
    return programs / (time.monotonic() - start), seconds[len(seconds) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--concurrency", default="1,2", help="comma-separated levels")
    parser.add_argument("--backends", default="unsafe_local,bubblewrap", help="comma-separated")
    args = parser.parse_args()
    print(f"{args.programs} programs, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"{'backend':<14} {'concurrency':>11} {'programs/s':>11} {'median ms':>10}")
    for backend in args.backends.split(","):
        for level in (int(c) for c in args.concurrency.split(",")):
            rate, median = throughput(backend, args.programs, level)
            print(f"{backend:<14} {level:>11} {rate:>11.1f} {median * 1000:>10.0f}")


if __name__ == "__main__":
    main()
