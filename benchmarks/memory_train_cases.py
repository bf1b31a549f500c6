"""Two one-GPU Megatron train-step cases beside benchmarks/megatron_train_step.py's own, measured for
the memory planner's check (docs/memory_planner.md): the MoE case without expert parallelism, and
Qwen2.5-1.5B with full recompute. Run one case per process (``--only``): a later case in the same
process starts with the earlier case's memory partly still allocated.

    python benchmarks/memory_train_cases.py --only MoE --out moe.json
    python benchmarks/memory_train_cases.py --only recompute --out recompute.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import megatron_train_step as bench  # noqa: E402

FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}

CASES = [
    bench.Case("MoE 3.2B (32 experts, top-4), 1 GPU", bench.small_moe, 1, {"moe_grouped_gemm": True}),
    bench.Case("Qwen2.5-1.5B full recompute", bench.qwen25_1p5b, 1, FULL_RECOMPUTE),
]

if __name__ == "__main__":
    bench.CASES[:] = CASES
    bench.main()
