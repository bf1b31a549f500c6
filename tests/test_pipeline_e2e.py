"""End to end on CPU: a few RLVR steps through Ray, every stage, checkpoints, and a resume that
continues bit-identically."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import ray
import yaml
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_tiny_model_dir  # noqa: E402

from roll.configs.loader import load_config  # noqa: E402
from roll.pipeline.rlvr.pipeline import run_pipeline  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow

STAGES = ("generate", "reward", "reference", "old_log_probs", "values", "advantages", "train", "model_update")


def write_data(path: Path, n: int, offset: int = 0) -> None:
    rows = []
    for i in range(n):
        a, b = 10 + i + offset, 7 + 2 * i
        rows.append({"prompt": f"{a}+{b}=", "ground_truth": str(a + b), "tag": "arith"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def config_dict(tmp: Path, model: Path, out: Path, **overrides) -> dict:
    cfg = {
        "exp_name": "e2e",
        "seed": 3,
        "device": "cpu",
        "num_gpus_per_node": 2,
        "output_dir": str(out),
        "track_with": "none",
        "pretrain": str(model),
        "max_steps": 3,
        "save_steps": 1,
        "eval_steps": 2,
        "rollout_batch_size": 2,
        "num_return_sequences_in_group": 2,
        "prompt_length": 24,
        "response_length": 6,
        "adv_estimator": "grpo",
        "use_kl_loss": True,
        "kl_loss_coef": 0.01,
        "model_update_probe_size": 2,
        "model_update_probe_tolerance": 1.0e-4,
        "validation": {
            "data_args": {"file_name": [str(tmp / "val.jsonl")], "template": "plain"},
            "generating_args": {"max_new_tokens": 6, "temperature": 0.0, "num_return_sequences": 1},
        },
        "actor_train": {
            "model_args": {
                "model_name_or_path": "${pretrain}",
                "dtype": "fp32",
                "disable_gradient_checkpointing": True,
            },
            "training_args": {
                "learning_rate": 1.0e-3,
                "per_device_train_batch_size": 1,
                "gradient_accumulation_steps": 2,
            },
            "data_args": {"file_name": [str(tmp / "train.jsonl")], "template": "plain"},
            "strategy_args": {"strategy_name": "fsdp2_train"},
            "device_mapping": "0-1",
        },
        "actor_infer": {
            "model_args": {"model_name_or_path": "${pretrain}", "dtype": "fp32"},
            "generating_args": {
                "max_new_tokens": "${response_length}",
                "num_return_sequences": 2,
                "temperature": 1.0,
            },
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": "0-1",
            "infer_batch_size": 2,
        },
        "reference": {
            "model_args": {"model_name_or_path": "${pretrain}", "dtype": "fp32"},
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": "0-1",
            "infer_batch_size": 2,
        },
        # A format reward that random text passes about 4 times in 5, so groups disagree and the
        # policy gradient is not zero (math_rule would score a random tiny model 0 everywhere).
        "rewards": {
            "fmt": {"reward_fn": "format", "reward_kwargs": {"pattern": ".*[0-9a-zA-Z].*"}, "world_size": 1}
        },
    }
    cfg.update(overrides)
    return cfg


def load(tmp: Path, name: str, cfg: dict):
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def pipeline_dir(tmp_path_factory, name: str):
    """A module's run directory: a tiny model, 8 training and 3 validation prompts (yields
    ``(dir, model)``; Ray, if a test started it, is shut down after the module)."""
    tmp = tmp_path_factory.mktemp(name)
    model = build_tiny_model_dir(tmp / "model", seed=0)
    write_data(tmp / "train.jsonl", 8)
    write_data(tmp / "val.jsonl", 3, offset=50)
    yield tmp, model
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from pipeline_dir(tmp_path_factory, "e2e")


def comparable(row: dict) -> dict:
    """Metrics that must match between runs: everything but wall-clock times, rates and memory."""
    varying = (
        "time/",
        "memory/",
        "perf/tokens_per_s",
        "perf/train_tokens_per_s",
        "perf/generate_tokens_per_s",
    )
    return {k: v for k, v in row.items() if not (k.startswith(varying) or k.endswith("_s") or "gbps" in k)}


def test_pipeline_runs_every_stage_checkpoints_and_resumes(setup):
    tmp, model = setup
    full = run_pipeline(load(tmp, "full", config_dict(tmp, model, tmp / "full")))

    rows = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "val/score/mean" in rows[0] and "val/score/mean" in rows[2] and "val/score/mean" in rows[3]
    for row in rows[1:]:
        for stage in STAGES:
            assert f"time/{stage}" in row, stage
        for key in (
            "critic/score/mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "response_length/mean",
            "rollout/logprob_mismatch",
            "actor/kl_loss",
            "model_update/probe_logprob_diff",
            "perf/tokens_per_s_per_device",
            "perf/generate_tokens_per_s",
            "memory/actor_train/peak_rss_gib",
            "memory/actor_infer/peak_rss_gib",
        ):
            assert key in row and math.isfinite(row[key]), key
        # Prompt + response tokens of the step's batch.
        assert row["perf/tokens"] > row["perf/response_tokens"] > 0
        assert row["model_update/probe_logprob_diff"] < 1e-4
    for step in (1, 2, 3):
        assert (full / "checkpoints" / f"step_{step}" / "pipeline_state.json").exists()
        assert (full / "checkpoints" / f"step_{step}" / "actor_train").is_dir()
    assert any(r["actor/grad_norm"] > 0 for r in rows[1:])  # the policy was actually updated
    assert any(0 < r["critic/score/mean"] < 1 for r in rows[1:])
    assert (full / "curves.png").stat().st_size > 0
    AutoModelForCausalLM.from_pretrained(full / "hf_model")  # the final policy loads as is

    resumed_cfg = config_dict(
        tmp, model, tmp / "resumed", resume_from_checkpoint=str(full / "checkpoints" / "step_2")
    )
    resumed = run_pipeline(load(tmp, "resumed", resumed_cfg))
    again = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in again] == [3]
    assert comparable(again[0]) == comparable(rows[3])
