"""How fast this host is at what roll's small stages and launch-bound loops depend on, measured in a
few seconds so the GPU speed guard can tell a slower host from slower code.

    python benchmarks/host_probe.py          # prints the figures as JSON

Figures (lower is faster except ``matmul_tflops``):
- ``python_loop_ms``: a fixed pure-Python loop, single thread (the driver, the schedulers, the
  per-token Python of a KV-cached decode);
- ``torch_small_op_us``: one small CPU tensor op through torch's dispatcher, one thread (stage
  bookkeeping, sampling glue);
- ``cuda_launch_us``: one tiny CUDA kernel, launched back to back and synchronized at the end
  (launch-bound decode loops such as megatron_infer's);
- ``matmul_tflops``: a bf16 8192^3 matmul, the GPU's dense compute (the trainer's stages; also
  ``megatron_train_step.py``'s measured peak).
The CUDA figures are absent without a GPU. ``gpu_speed.py`` keeps them in each baseline run and
prints them beside the run's table.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

# How many times each probe repeats; the best repeat counts (others catch a preemption).
REPEATS = 5


def _best(fn, repeats: int = REPEATS) -> float:
    """The shortest of ``repeats`` timings of ``fn()`` in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def python_loop_ms(n: int = 1_000_000) -> float:
    def loop() -> int:
        total = 0
        for i in range(n):
            total += i & 7
        return total

    return _best(loop) * 1e3


def torch_small_op_us(n: int = 2000) -> float:
    a, b = torch.ones(64), torch.ones(64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def ops() -> None:
            for _ in range(n):
                torch.add(a, b)

        return _best(ops) / n * 1e6
    finally:
        torch.set_num_threads(threads)


def cuda_launch_us(n: int = 2000) -> float:
    x = torch.ones(16, device="cuda")

    def launches() -> None:
        for _ in range(n):
            x.add_(0)
        torch.cuda.synchronize()

    launches()  # warm-up: context, kernels
    return _best(launches) / n * 1e6


def measured_peak_tflops(device: torch.device) -> float:
    """Best of 20 bf16 8192^3 matmuls after 5 warm-ups, in TFLOP/s."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(5):
        a @ b
    best = math.inf
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / best / 1e12


def probe_host() -> dict[str, float]:
    """This host's figures (module docstring), plus its CPU count and load average."""
    out = {
        "cpus": float(os.cpu_count() or 0),
        "load_avg_1m": os.getloadavg()[0],
        "python_loop_ms": python_loop_ms(),
        "torch_small_op_us": torch_small_op_us(),
    }
    if torch.cuda.is_available():
        out["cuda_launch_us"] = cuda_launch_us()
        out["matmul_tflops"] = measured_peak_tflops(torch.device("cuda"))
    return out


# Figure -> how to print it (digits) and whether higher is faster.
FIGURES = {
    "python_loop_ms": (1, False),
    "torch_small_op_us": (2, False),
    "cuda_launch_us": (2, False),
    "matmul_tflops": (0, True),
}


def host_rows(now: dict[str, float] | None, base: dict[str, float] | None) -> list[str]:
    """Markdown rows ``| host: <figure> | now | baseline | slowdown | |``: the slowdown is > 1 where
    this host is slower than the baseline's."""
    now, base = now or {}, base or {}
    rows = []
    for name, (digits, higher_is_faster) in FIGURES.items():
        value, ref = now.get(name), base.get(name)
        if value is None and ref is None:
            continue
        cells = [f"{v:.{digits}f}" if v is not None else "-" for v in (value, ref)]
        slowdown = "-"
        if value and ref:
            slowdown = f"{(ref / value if higher_is_faster else value / ref):.2f}x"
        rows.append(f"| host: {name} | {cells[0]} | {cells[1]} | {slowdown} | |")
    return rows


if __name__ == "__main__":
    print(json.dumps(probe_host(), indent=1))
