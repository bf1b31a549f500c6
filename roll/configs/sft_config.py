"""Top-level SFT run configuration: one YAML file maps onto ``SFTPipelineConfig``.

    config = load_sft_config("examples/config/sft_config.yaml", overrides=["max_steps=3"])

One role, ``actor_train`` (``fsdp2_train`` or ``megatron_train``, any ``device_mapping``; device ids
are CPU slots with ``device: cpu``). A step is one optimizer step over
``per_device_train_batch_size x gradient_accumulation_steps x DP`` conversations.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll.configs.ranges import bounded
from roll.configs.run_config import RunConfig


@dataclass
class SFTDataConfig:
    # JSONL files of {"messages": [{"role", "content"}, ...]} rows (see roll.pipeline.sft.chat_data).
    train_files: list[str] = field(default_factory=list)
    # Held-out conversations for the validation loss; empty: no validation loss.
    val_files: list[str] = field(default_factory=list)
    messages_key: str = "messages"
    # A string field appended to each row's messages as the final assistant turn (None: the
    # messages already hold the assistant turns).
    response_key: str | None = None
    # Conversations are cut to this many tokens.
    max_length: int = bounded(1024, ge=2)


@dataclass
class SFTGenerationEval:
    """Optional accuracy of sampled answers, scored by a rule reward (on the driver, HF generate)."""

    # JSONL rows with messages (the prompt) and a ground-truth field.
    file_name: str | None = None
    ground_truth: str = "ground_truth"
    reward_fn: str = "math_rule"
    max_new_tokens: int = bounded(256, ge=1)
    temperature: float = bounded(0.0, ge=0)
    max_samples: int | None = bounded(None, ge=1)


@dataclass(kw_only=True)
class SFTPipelineConfig(RunConfig):
    """Every key of an SFT YAML file: ``RunConfig``'s and these. Unknown keys are errors (see
    roll.configs.loader)."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    generation_eval: SFTGenerationEval | None = None

    # RunConfig's key, with this pipeline's default.
    exp_name: str = "sft"

    # What helpers written for an RLVR config read off it: no critic, one sample per prompt. The
    # LR schedule's length is max_steps (the SFT run hands it to the worker).
    critic = None
    ppo_epochs = 1
    num_return_sequences_in_group = 1
    rollout_batch_size = 0


def load_sft_config(path: str | Path, overrides: list[str] | None = None) -> SFTPipelineConfig:
    """Read, override, interpolate and build an SFT config file (keys, types, ranges). The checks
    that need the strategy registry, placement or the files run before launch
    (roll.launch.checks.check_sft_config)."""
    from roll.configs.loader import (
        IGNORED_TOP_LEVEL,
        apply_overrides,
        build_dataclass,
        interpolate,
        read_yaml,
    )

    raw = read_yaml(path)
    for key in IGNORED_TOP_LEVEL:
        if raw.pop(key, None) is not None:
            print(
                f"roll: ignoring the '{key}' block of {path} (Hydra settings are not used)", file=sys.stderr
            )
    data = interpolate(apply_overrides(raw, overrides or []))
    fill_model_path(data)
    return build_dataclass(SFTPipelineConfig, data)


def fill_model_path(data: dict[str, Any]) -> None:
    """``pretrain`` is the model of ``actor_train`` unless its model_name_or_path is set."""
    role = data.get("actor_train")
    if data.get("pretrain") is None or not isinstance(role, dict):
        return
    model_args = role.get("model_args") or {}
    role["model_args"] = model_args
    if model_args.get("model_name_or_path") is None:
        model_args["model_name_or_path"] = data["pretrain"]
