"""Storage and reward faults through a real (tiny, CPU) run: failing reward samples counted in
metrics.jsonl across the Ray reward workers, then a re-run over that output_dir and a resume from
a corrupted checkpoint, both refused before any model loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline_e2e import config_dict, load, write_data  # noqa: E402
from tiny_models import build_tiny_model_dir  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.core.errors import CheckpointError  # noqa: E402
from roll.pipeline.rlvr.pipeline import run_pipeline  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow


def test_reward_errors_are_counted_and_the_run_dir_is_protected(tmp_path):
    model = build_tiny_model_dir(tmp_path / "model", seed=0)
    write_data(tmp_path / "train.jsonl", 4)
    out = tmp_path / "run"
    # ifeval reads its ground truth as JSON instructions; "17" is not, so every sample raises
    # TypeError. max_error_fraction 1.0 keeps the run going so the counts can be read.
    rewards = {"ifx": {"reward_fn": "ifeval", "world_size": 1, "max_error_fraction": 1.0}}
    cfg = config_dict(
        tmp_path, model, out, max_steps=1, save_steps=1, eval_steps=0, validation=None, rewards=rewards
    )
    del cfg["reference"]
    cfg.update(use_kl_loss=False)
    try:
        run_pipeline(load(tmp_path, "faulty", cfg))
        (row,) = read_metrics(out / "metrics.jsonl")
        assert row["reward/errors"] == row["reward/ifx/errors"] == 4.0
        assert row["reward/timeouts"] == 0.0 and row["critic/score/mean"] == 0.0

        with pytest.raises(ConfigError, match=rf"^output_dir: {out} already holds a run"):
            run_pipeline(load(tmp_path, "again", cfg))

        weights = sorted((out / "checkpoints" / "step_1" / "actor_train").glob("*.distcp"))[0]
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))
        resumed = dict(cfg, resume_from_checkpoint=str(out / "checkpoints" / "step_1"), max_steps=2)
        with pytest.raises(CheckpointError, match=rf"^{weights}: sha256 differs"):
            run_pipeline(load(tmp_path, "resume", resumed))
    finally:
        if ray.is_initialized():
            ray.shutdown()
