"""benchmarks/megatron_train_step.py's MFU arithmetic: against the datasheet peak and the measured one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import megatron_train_step as bench  # noqa: E402


def tiny_config() -> transformers.Qwen2Config:
    return transformers.Qwen2Config(
        vocab_size=100,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def test_flops_per_token_by_hand() -> None:
    # head_dim 4: q 8, kv 4; attention 8*8 + 2*8*4 + 8*8 = 192; MLP 3*8*16 = 384; head 8*100.
    matmul = 2 * (192 + 384) + 800
    attention = 2 * 2 * bench.SEQ * 8
    assert bench.flops_per_token(tiny_config()) == 3 * (2 * matmul + attention)


def test_mfu_divides_by_seconds_gpus_and_peak() -> None:
    # 989 TFLOP in 0.5 s on 2 GPUs of 989 TFLOP/s: 1 / (0.5 * 2) = 100%.
    assert bench.mfu(989.0, 500.0, 2, 989.0) == pytest.approx(1.0)
    assert bench.mfu(100.0, 1000.0, 1, 400.0) == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("NVIDIA A10G", None)],
)
def test_datasheet_peak_by_device_name(name: str, peak: float | None) -> None:
    assert bench.datasheet_peak_tflops(name) == peak


def row(**extra) -> dict:
    return {
        "config": "tiny",
        "gpus": 1,
        "layout": "DP1",
        "layers": 16,
        "seq": 4096,
        "tokens_per_s": 1000.0,
        "step_ms": 1000.0,
        "peak_gib": 1.0,
        "model_tflop": 494.5,
        "note": "",
        "peak_tflops": 824.2,
        **extra,
    }


def test_table_prints_both_mfus_and_the_layers() -> None:
    text = bench.table([row(gpu_name="NVIDIA H200")])
    header, _, cells = text.splitlines()[:3]
    values = dict(
        zip(
            [h.strip() for h in header.strip("|").split("|")],
            [c.strip() for c in cells.strip("|").split("|")],
        )
    )
    assert values["MFU (datasheet)"] == "50.0%"  # 494.5 / 989
    assert values["MFU (measured peak)"] == "60.0%"  # 494.5 / 824.2
    assert values["layers"] == "16"
    assert values["datasheet TFLOP/s"] == "989"


def test_table_of_an_unknown_device_leaves_the_datasheet_mfu_out_unless_given() -> None:
    unknown = bench.table([row(gpu_name="NVIDIA A10G")]).splitlines()[2]
    assert "| - |" in unknown and "60.0%" in unknown
    given = bench.table([row()], datasheet_tflops=494.5).splitlines()[2]
    assert "100.0%" in given
