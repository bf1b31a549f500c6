"""The pre-launch check step: everything knowable about a run before any worker starts, in one place.

The loader (roll.configs) parses and types; this step asks each registry and algorithm table about
the typed config, plans the placement, and looks at the files it names. The launchers call it for
``--dry_run`` and a real launch alike, and so should any program that runs a pipeline:

    config = load_config(path, overrides)      # keys, types, ranges, inline names (roll.configs)
    check_before_launch(config)                # everything below, before run_pipeline(config)

Order, each stage raising one ``ConfigError`` naming the key:

1. named values against the tables that implement them (roll.launch.named_values);
2. every role against the strategy registry, its strategy options and engine (roll.launch.roles);
3. the placement plan and the rules across keys (roll.launch.rules);
4. with ``files``: the model directories, prompt files, tag routes, reward options, the
   checkpoint to resume from and the rollout dump to write or replay (roll.launch.files).
"""

from __future__ import annotations

from pathlib import Path

from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.sft_config import SFTPipelineConfig
from roll.distributed.scheduler.placement import PlacementPlan, plan_placement
from roll.launch.files import check_files
from roll.launch.named_values import check_named_values
from roll.launch.roles import check_role
from roll.launch.rules import check_devices_exist, check_run_rules, check_tracker
from roll.models.model_dir import check_model_dir
from roll.pipeline.rewards.registry import get_reward_spec


def check_before_launch(config: RLVRConfig, files: bool = True) -> PlacementPlan:
    """Check an RLVR config (``files=False``: not what it points at); returns the placement plan."""
    check_named_values(config)
    for name, role in config.roles().items():
        check_role(name, role, config)
    plan = plan_placement(config)
    check_run_rules(config, plan)
    if files:
        check_files(config)
    return plan


def check_sft_config(config: SFTPipelineConfig, files: bool = True) -> PlacementPlan:
    """Check an SFT config: its role and strategy, placement, the tracker and (``files``) the data
    files and model directory; returns the placement plan."""
    check_named_values(config)
    check_role("actor_train", config.actor_train, config)
    plan = plan_placement(config)
    check_devices_exist(config, plan)
    check_tracker(config)
    if not config.data.train_files:
        raise ConfigError("data.train_files", "is required: JSONL files of chat rows")
    if config.generation_eval is not None:
        get_reward_spec(config.generation_eval.reward_fn, "generation_eval.reward_fn")
    if files:
        _check_sft_files(config)
    return plan


def _check_sft_files(config: SFTPipelineConfig) -> None:
    for key in ("train_files", "val_files"):
        for i, name in enumerate(getattr(config.data, key)):
            if not Path(name).is_file():
                raise ConfigError(f"data.{key}.{i}", f"{name}: no such file")
    gen = config.generation_eval
    if gen is not None and (not gen.file_name or not Path(gen.file_name).is_file()):
        raise ConfigError("generation_eval.file_name", f"{gen.file_name}: no such file")
    check_model_dir(
        config.actor_train.model_args.model_name_or_path, "actor_train.model_args.model_name_or_path"
    )
