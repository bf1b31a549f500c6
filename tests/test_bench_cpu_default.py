"""benchmarks/cpu_default.py compares wall against wall: the loop's wall time per step, first step
included, validation out, for roll as for TRL."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import cpu_default as bench  # noqa: E402


def step_row(step: int, wall: float, step_s: float, validation: float = 0.0, **extra) -> dict:
    row = {"step": step, "time/step": step_s + validation, "perf/wall_s": wall, "time/generate": step_s}
    if validation:
        row["time/validation"] = validation
    return row | extra


def rows() -> list[dict]:
    # Loop starts at process age 10.0; three steps end at 14.0, 15.5 and 20.0 (the last with 2.0 s
    # of validation). The stage sums (3.0, 1.0, 1.5) leave out 1.0, 0.5 and 1.0 s between stages.
    return [
        step_row(1, 14.0, 3.0, **{"startup/to_first_step_s": 10.0}),
        step_row(2, 15.5, 1.0),
        step_row(3, 20.0, 1.5, validation=2.0),
    ]


def test_loop_wall_counts_the_first_step_and_leaves_validation_out() -> None:
    assert bench.loop_wall_per_step(rows()) == pytest.approx((20.0 - 10.0 - 2.0) / 3)


def test_loop_wall_needs_both_process_ages() -> None:
    no_start = [{k: v for k, v in r.items() if not k.startswith("startup/")} for r in rows()]
    assert bench.loop_wall_per_step(no_start) is None
    no_end = [{k: v for k, v in r.items() if k != "perf/wall_s"} for r in rows()]
    assert bench.loop_wall_per_step(no_end) is None


def test_summary_keeps_the_stage_sum_apart_from_the_loop_wall(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    out = bench.summarize_roll(metrics, wall=30.0)
    assert out["stage_sum"] == pytest.approx((1.0 + 1.5) / 2)  # steps 2.., validation out
    assert out["loop_wall_per_step"] == pytest.approx(8.0 / 3)
    assert out["wall"] == 30.0
    table = bench.table(out, {"loop_wall_per_step": 2.0, "step_timer": 1.9})
    loop = next(line for line in table.splitlines() if line.startswith("| **loop wall"))
    assert loop.endswith("| 2.667 | 2.000 |")
    assert "| stage sum per step (roll, steps 2..), s | 1.250 | - |" in table
