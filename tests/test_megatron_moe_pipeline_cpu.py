"""End to end on CPU: the 4-GPU Qwen3-30B-A3B-shaped examples (colocated TP=2 x EP=2 + SP with the
all-to-all dispatcher and grouped experts; disaggregated EP=2 -> EP=2) for 2 steps through Ray, on a
Qwen3-MoE model at test size, with the Megatron strategies on gloo through the test-only shims.

This is the scale run's code path (MoE training with EP, expert-parallel generation in lockstep,
the model update from EP shards into an EP engine, the per-step perf and memory metrics) proven on
CPU before a GPU runs it; the same YAML files run on GPUs with only the checkpoint swapped.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import shrunk_example, write_config

from roll.configs.loader import load_config
from roll.models.random_checkpoint import write_random_checkpoint
from roll.pipeline.rlvr.pipeline import run_pipeline
from roll.utils.tracking import read_metrics


def small_config(tmp: Path, example: Path, name: str, model: Path) -> Path:
    # 16 sequences = 2 per micro-batch x 4 micro-batches x DP 2 (both layouts).
    raw = shrunk_example(name, tmp, example, model, 2, 4, prompt_length=48, response_length=12)
    raw["rewards"]["math_rule"]["world_size"] = 1
    return write_config(raw, tmp / f"{name}_cpu.yaml")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["qwen3-30B-A3B-rlvr_megatron_4gpus", "qwen3-30B-A3B-rlvr_megatron_4gpus_disagg"]
)
def test_moe_pipeline_two_steps(tmp_path, shimmed_ray, example, name):
    model = write_random_checkpoint(
        "tiny-qwen3-moe", tmp_path / "model", tokenizer_dir=example / "sft_model", dtype=torch.float32
    )
    config = load_config(small_config(tmp_path, example, name, model))
    run_dir = run_pipeline(config)

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "rollout/logprob_mismatch"):
            assert math.isfinite(row[key]), key
        # Trainer and engine agree after the update (fp32): far below 1e-4.
        assert row["model_update/probe_logprob_diff"] < 1e-4
        assert row["model_update/version_infer"] == row["step"]
        assert row["perf/tokens_per_s_per_device"] > 0
        assert row["memory/actor_train/peak_rss_gib"] > 0
    assert list((run_dir / "hf_model").glob("*.safetensors"))  # the final policy, exported
