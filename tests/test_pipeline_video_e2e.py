"""End to end on CPU with videos: 2 RLVR steps of a tiny Qwen2.5-VL through Ray on ROLL's Video-R1
rows (``row_layout: video_r1``, tiny generated videos: 4 sampled frames of 56 x 56), fsdp2_train on
2 gloo ranks, hf_infer rollouts and reference, the ``video_r1`` reward routed by the rows'
``modality_type`` tag, validation at step 2."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import ray

pytest.importorskip("av")  # PyAV decodes the videos (the [vision] extra)

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline_e2e import load  # noqa: E402
from tiny_vl import VIDEO_ARGS, build_tiny_vl_dir, video_r1_rows  # noqa: E402

from roll.pipeline.rlvr.pipeline import run_pipeline  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow


def config(tmp: Path, model: Path) -> dict:
    rows = video_r1_rows(tmp / "videos", 4)
    train, val = tmp / "train.json", tmp / "val.json"
    train.write_text(json.dumps(rows))  # a JSON list, as Video-R1's files
    val.write_text(json.dumps(rows[:1]))
    data = {"row_layout": "video_r1", **VIDEO_ARGS}
    role = {"model_name_or_path": str(model), "dtype": "fp32"}
    return {
        "exp_name": "video",
        "seed": 3,
        "device": "cpu",
        "num_gpus_per_node": 2,
        "output_dir": str(tmp / "out"),
        "track_with": "none",
        "max_steps": 2,
        "save_steps": 0,
        "eval_steps": 2,
        "rollout_batch_size": 2,
        "num_return_sequences_in_group": 2,
        "prompt_length": 600,  # the tiny tokenizer spends ~530 tokens on Video-R1's template
        "response_length": 6,
        "adv_estimator": "grpo",
        "model_update_probe_size": 2,
        "validation": {
            "data_args": {**data, "file_name": [str(val)]},
            "generating_args": {"max_new_tokens": 6, "temperature": 0.0, "num_return_sequences": 1},
        },
        "actor_train": {
            "model_args": {**role, "disable_gradient_checkpointing": True},
            "training_args": {
                "learning_rate": 1.0e-3,
                "per_device_train_batch_size": 1,
                "gradient_accumulation_steps": 2,
            },
            "data_args": {**data, "file_name": [str(train)]},
            "strategy_args": {"strategy_name": "fsdp2_train"},
            "device_mapping": "0-1",
        },
        "actor_infer": {
            "model_args": role,
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
            "model_args": role,
            "strategy_args": {"strategy_name": "hf_infer"},
            "device_mapping": "0-1",
            "infer_batch_size": 2,
        },
        "rewards": {"videor1": {"reward_fn": "video_r1", "tag_included": ["video"], "world_size": 1}},
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("video_e2e")
    yield tmp, build_tiny_vl_dir(tmp / "model", seed=0, std=0.05)
    if ray.is_initialized():
        ray.shutdown()


def test_video_run_trains_and_scores_the_video_rows(setup):
    tmp, model = setup
    rows = read_metrics(run_pipeline(load(tmp, "video", config(tmp, model))) / "metrics.jsonl")
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for row in steps:
        assert math.isfinite(row["actor/loss"]) and math.isfinite(row["actor/grad_norm"])
        # hf_infer got the trainer's weights and both read the videos alike: the trainer's old
        # log-probs of the sampled responses equal hf_infer's sampling log-probs
        assert row["model_update/probe_logprob_diff"] < 1e-4
        assert row["rollout/logprob_mismatch"] < 1e-4
    assert "val/score/mean/video" in rows[-1]
