"""The default example's supervised warm start, run through the SFT pipeline.

    hf_dir = warm_start(base_model, out / "sft.jsonl", run_dir, steps=800, seed=0, threads=2)

One fsdp2_train rank on one CPU slot, fp32, 32 conversations a step (each row's ``target`` as the
assistant turn), AdamW at 3e-3 with 30 warmup steps and cosine decay to 10%: the settings the
example's accuracy numbers were measured with. Returns the exported Hugging Face model directory.
"""

from __future__ import annotations

from pathlib import Path

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
from roll.configs.sft_config import SFTDataConfig, SFTPipelineConfig
from roll.pipeline.sft.pipeline import run_sft_pipeline

WARM_START_TRAINING = TrainingArgs(
    learning_rate=3e-3,
    weight_decay=0.01,
    per_device_train_batch_size=32,
    warmup_steps=30,
    lr_scheduler_type="cosine",
    min_lr_ratio=0.1,
    max_grad_norm=1.0,
)


def warm_start_config(
    base: Path,
    sft_file: Path,
    run_dir: Path,
    steps: int,
    seed: int,
    threads: int,
    training: TrainingArgs = WARM_START_TRAINING,
) -> SFTPipelineConfig:
    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=str(base), dtype="fp32", disable_gradient_checkpointing=True),
        training_args=training,
        strategy_args=StrategyArgs("fsdp2_train", {"sharding": "no_shard", "mixed_precision": False}),
        device_mapping=[0],
        system_envs={"OMP_NUM_THREADS": str(threads)},
    )
    return SFTPipelineConfig(
        actor_train=role,
        data=SFTDataConfig(train_files=[str(sft_file)], response_key="target", max_length=512),
        exp_name="warm_start",
        seed=seed,
        output_dir=str(run_dir),
        overwrite_output_dir=True,
        track_with="none",
        num_gpus_per_node=1,
        device="cpu",
        max_steps=steps,
        logging_steps=100,
    )


def warm_start(
    base: Path,
    sft_file: Path,
    run_dir: Path,
    steps: int,
    seed: int,
    threads: int,
    training: TrainingArgs = WARM_START_TRAINING,
) -> Path:
    """Train ``base`` on ``sft_file`` for ``steps`` steps (``training``: the default example's
    settings unless given); the exported model's directory."""
    config = warm_start_config(base, sft_file, run_dir, steps, seed, threads, training)
    return run_sft_pipeline(config) / "hf_model"
