"""End to end on CPU with a vision-language model: 2 RLVR steps of a tiny Qwen2.5-VL through Ray,
on prompts with generated images in alibaba/ROLL's row layout. actor_train on fsdp2_train over 2
gloo ranks with the vision tower frozen (``freeze_module_prefix: model.visual``), hf_infer rollouts
and reference, detection, math and format rewards routed by tag and mixed by
``domain_interleave_probs`` keyed by reward role, a validation before and after, and a resume from
the step-2 checkpoint. A second run trains on megatron_train (TP 2 + SP) instead."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import ray
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline_e2e import load  # noqa: E402
from tiny_vl import build_tiny_vl_dir, detection_rows, math_rows  # noqa: E402

from roll.pipeline.rlvr.pipeline import run_pipeline  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow


def caption_rows(image_dir: Path, n: int) -> list[dict]:
    """Rows scored by a format reward that random text passes most of the time, so the groups'
    scores differ and the policy gradient is not zero (a random model scores 0 on boxes and counts)."""
    return [
        {**row, "data_source": "caption", "reward_model": {"ground_truth": "any"}}
        for row in math_rows(image_dir, n, tag="caption")
    ]


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(tmp: Path, model: Path) -> dict:
    images = tmp / "images"
    train = write(
        tmp / "train.jsonl", detection_rows(images, 4) + math_rows(images, 4) + caption_rows(images, 4)
    )
    val = write(tmp / "val.jsonl", detection_rows(images, 1) + math_rows(images, 1))
    data = {"messages": "prompt", "file_name": [train]}
    role = {"model_name_or_path": str(model), "dtype": "fp32"}
    return {
        "exp_name": "vl",
        "seed": 3,
        "device": "cpu",
        "num_gpus_per_node": 2,
        "output_dir": str(tmp / "out"),
        "track_with": "none",
        "max_steps": 2,
        "save_steps": 2,
        "eval_steps": 2,
        "rollout_batch_size": 4,
        "num_return_sequences_in_group": 4,
        "prompt_length": 48,
        "response_length": 6,
        "adv_estimator": "grpo",
        "use_kl_loss": True,
        "kl_loss_coef": 0.01,
        "model_update_probe_size": 2,
        "validation": {
            "data_args": {"messages": "prompt", "file_name": [val]},
            "generating_args": {"max_new_tokens": 6, "temperature": 0.0, "num_return_sequences": 1},
        },
        "actor_train": {
            "model_args": {
                **role,
                "disable_gradient_checkpointing": True,
                "freeze_module_prefix": "model.visual",
            },
            "training_args": {
                "learning_rate": 1.0e-3,
                "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 4,
            },
            "data_args": {
                **data,
                "domain_interleave_probs": {"fmt": 0.5, "math": 0.25, "cv_detection": 0.25},
            },
            "strategy_args": {"strategy_name": "fsdp2_train"},
            "device_mapping": "0-1",
        },
        "actor_infer": {
            "model_args": role,
            "generating_args": {
                "max_new_tokens": "${response_length}",
                "num_return_sequences": 4,
                "temperature": 1.0,
            },
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": "0-1",
            "infer_batch_size": 2,
        },
        "reference": {
            "model_args": role,
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": "0-1",
            "infer_batch_size": 2,
        },
        "rewards": {
            "math": {"reward_fn": "math_rule", "tag_included": ["mm_math"], "world_size": 1},
            "cv_detection": {"reward_fn": "detection", "tag_included": ["v3det_train"], "world_size": 1},
            "fmt": {
                "reward_fn": "format",
                "reward_kwargs": {"pattern": ".*[aeiou].*"},  # about 3 in 5
                "tag_included": ["caption"],
                "world_size": 1,
            },
        },
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vl_e2e")
    yield tmp, build_tiny_vl_dir(tmp / "model", seed=0, std=0.05)
    if ray.is_initialized():
        ray.shutdown()


def weights(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).state_dict()


def test_vl_run_trains_the_language_model_and_keeps_the_vision_tower(setup):
    tmp, model = setup
    run_dir = run_pipeline(load(tmp, "vl", config(tmp, model)))
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert math.isfinite(row["actor/loss"]) and math.isfinite(row["actor/grad_norm"])
        # hf_infer got the trainer's weights: after each update it scores the probe like the trainer,
        # and the trainer's old log-probs of the image rows equal hf_infer's sampling log-probs
        assert row["model_update/probe_logprob_diff"] < 1e-4
        assert row["rollout/logprob_mismatch"] < 1e-4
    assert any(row["actor/grad_norm"] > 0 for row in steps)  # the format rows' groups disagreed
    assert {"val/score/mean/v3det_train", "val/score/mean/mm_math"} <= set(rows[-1])
    assert (run_dir / "hf_model" / "preprocessor_config.json").is_file()  # the export runs as it is
    before, after = weights(model), weights(run_dir / "hf_model")
    vision = [k for k in before if k.startswith("model.visual.")]
    language = [k for k in before if k.startswith("model.language_model.layers.")]
    assert vision and language
    assert all(torch.equal(before[k], after[k]) for k in vision)
    assert sum(not torch.equal(before[k], after[k]) for k in language) > len(language) // 2
    # A resume loads the sharded checkpoint of the partly frozen model and goes on (step 3).
    resumed = config(tmp, model) | {"max_steps": 3, "eval_steps": 0, "resume_from_checkpoint": True}
    rows = read_metrics(run_pipeline(load(tmp, "vl_resumed", resumed)) / "metrics.jsonl")
    assert rows[-1]["step"] == 3 and math.isfinite(rows[-1]["actor/loss"])


def test_vl_run_on_megatron_train(setup, shimmed_ray):
    """The same run with actor_train on megatron_train (TP 2 + SP, the tower frozen; about 35 s):
    hf_infer gets its weights under the module names, the tower stays, the language model trains."""
    tmp, model = setup
    raw = config(tmp, model) | {"eval_steps": 0, "save_steps": 0, "output_dir": str(tmp / "out_megatron")}
    megatron = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    raw["actor_train"]["strategy_args"] = {"strategy_name": "megatron_train", "strategy_config": megatron}
    run_dir = run_pipeline(load(tmp, "vl_megatron", raw))
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert math.isfinite(row["actor/loss"]) and math.isfinite(row["actor/grad_norm"])
        # hf_infer holds the trainer's weights and scores the vision tokens out as the trainer does
        # (the probe is text), and both run image rows at transformers' 3-D rope positions.
        assert row["model_update/probe_logprob_diff"] < 1e-4
        assert row["rollout/logprob_mismatch"] < 1e-4  # was ~0.02 with hf_infer at 1-D positions
    before, after = weights(model), weights(run_dir / "hf_model")
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("model.visual."))
    language = [k for k in before if k.startswith("model.language_model.layers.")]
    assert sum(not torch.equal(before[k], after[k]) for k in language) > len(language) // 2
