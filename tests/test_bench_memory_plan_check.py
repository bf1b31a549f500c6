"""benchmarks/memory_plan_check.py reads measured peaks from what the runs wrote and leaves out rows
that cannot disagree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import memory_plan_check as check  # noqa: E402


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_baseline_rows_compare_peak_with_the_recorded_prediction(tmp_path: Path) -> None:
    baseline = write(
        tmp_path / "h100.json",
        {
            "gpu": "H100",
            "runs": {
                "rlvr_megatron_2gpus": {
                    "gpus": 2,
                    "step_s": 1.0,
                    "peak_gib": 20.0,
                    "predicted_peak_gib": 25.0,
                },
                "no_prediction": {"gpus": 1, "peak_gib": 3.0},
            },
        },
    )
    left_out: list[str] = []
    rows = check.baseline_rows(baseline, left_out)
    assert [(r.run, r.predicted_gib, r.measured_gib) for r in rows] == [
        ("rlvr_megatron_2gpus (H100 x 2)", 25.0, 20.0)
    ]
    assert rows[0].error == pytest.approx(0.25)
    assert left_out == [f"{baseline}: runs.no_prediction: no predicted_peak_gib"]
    text = check.table(rows, left_out)
    assert "| 25.0 | 20.0 | +25% ** |" in text and "0 of 1 within 15%" in text


def test_a_file_that_is_not_a_baseline_names_itself(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"x.json: no 'runs' mapping"):
        check.baseline_rows(write(tmp_path / "x.json", {"gpu": "H100"}), [])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit, match=r"bad.json: cannot read it as JSON"):
        check.baseline_rows(tmp_path / "bad.json", [])


def test_train_step_rows_predict_the_named_case(tmp_path: Path) -> None:
    out = write(
        tmp_path / "one.json",
        {
            "rows": [
                {"config": "Qwen2.5-1.5B full recompute", "gpus": 1, "layout": "DP1", "peak_gib": 31.8},
                {"config": "no such case", "gpus": 1, "peak_gib": 1.0},
            ],
            "peak": {"1": 800.0},
        },
    )
    left_out: list[str] = []
    rows = check.train_step_rows(out, left_out)
    assert len(rows) == 1 and rows[0].measured_gib == 31.8
    assert 25 < rows[0].predicted_gib < 40  # the planner's figure for this case (31.6 on 2026-11-24)
    assert "rows[1] (no such case)" in left_out[0]


def test_run_rows_read_metrics_and_leave_the_engine_out(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 1, "memory/actor_train/peak_allocated_gib": 30.0, "memory/device0/peak_used_gib": 80.0},
        {
            "step": 2,
            "memory/actor_train/peak_allocated_gib": 31.0,
            "memory/device1/peak_used_gib": 85.0,
            "memory/actor_infer/peak_allocated_gib": 100.0,
            "memory/reference/peak_allocated_gib": 4.0,
        },
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert check.measured_peaks(metrics)["memory/actor_train/peak_allocated_gib"] == 31.0
    # the engine sized by gpu_memory_utilization, as the config shipped before kv_cache_memory_gb
    fraction = ["gpu=H200", "actor_infer.strategy_args.strategy_config.kv_cache_memory_gb=null"]
    report = check.planned("qwen2.5-1.5B-rlvr_megatron_vllm_2gpus", "qwen2.5-1.5b", None, fraction)
    left_out: list[str] = []
    rows = check.run_rows(metrics, report, "run", left_out)
    measured = {r.measured_as: r.measured_gib for r in rows}
    assert measured["actor_train (alloc)"] == 31.0 and measured["reference (alloc)"] == 4.0
    assert not any("actor_infer" in r.measured_as for r in rows)
    assert any("actor_infer (vllm" in line for line in left_out)
    # This config's device peak is the vLLM stage (the engine's fraction + the others' idle memory).
    assert not any(r.measured_as.endswith("(device)") for r in rows)
    assert any("device 0-1 (its predicted peak is actor_infer's" in line for line in left_out)


def test_an_engine_given_its_kv_cache_in_bytes_is_compared(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    row = {"step": 1, "memory/actor_infer/peak_allocated_gib": 13.8, "memory/device0/peak_used_gib": 54.3}
    metrics.write_text(json.dumps(row) + "\n")
    # as shipped: kv_cache_memory_gb: 8, so the engine is weights + cache + 2 GiB, not a fraction
    report = check.planned("qwen2.5-1.5B-rlvr_megatron_vllm_2gpus", "qwen2.5-1.5b", None, ["gpu=H200"])
    left_out: list[str] = []
    rows = {r.measured_as: r for r in check.run_rows(metrics, report, "run", left_out)}
    assert rows["actor_infer (alloc)"].measured_gib == 13.8
    assert abs(rows["actor_infer (alloc)"].predicted_gib - 12.9) < 0.1
    assert rows["device 0-1 (device)"].measured_gib == 54.3
    assert not any("actor_infer" in line for line in left_out)


def test_nothing_to_compare_is_refused() -> None:
    with pytest.raises(SystemExit):
        check.main([])
