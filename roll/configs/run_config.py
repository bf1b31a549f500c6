"""The keys every run has, RLVR or SFT: where it writes, how long it runs, where it runs.

``RLVRConfig`` (roll/configs/pipeline_config.py) and ``SFTPipelineConfig`` (roll/configs/sft_config.py)
extend ``RunConfig``; the code both pipelines share (checkpoints, output_dir, the tracker, placement)
reads these fields only::

    @dataclass(kw_only=True)
    class SFTPipelineConfig(RunConfig):
        exp_name: str = "sft"            # each pipeline names its runs
        data: SFTDataConfig = field(default_factory=SFTDataConfig)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roll.configs.ranges import bounded, one_of
from roll.configs.role import RoleConfig
from roll.configs.timeouts import WorkerTimeoutsConfig

# Named values come from the tables that implement them (see roll.configs.ranges).
TRACKERS = "roll.utils.tracking:TRACKERS"
DEVICES = "roll.distributed.scheduler.ray_start:DEVICES"
# numpy's generators take seeds in [0, 2**32).
MAX_SEED = 2**32 - 1


@dataclass
class CheckpointConfig:
    # Checkpoints go to this file system path (shared by the nodes for multi-node runs); None:
    # <output_dir>/checkpoints.
    output_dir: str | None = None
    # Keep at most this many step checkpoints (oldest removed first); None keeps all.
    max_to_keep: int | None = bounded(None, ge=1)


# ``resume_from_checkpoint`` values that mean a fresh run (YAML false, or the words from a CLI override).
RESUME_OFF = (False, None, "", "false", "False")


def resume_requested(value: str | bool | None) -> bool:
    """Whether a ``resume_from_checkpoint`` value asks for a resume (true, "latest" or a path)."""
    return value not in RESUME_OFF


@dataclass
class RunConfig:
    """The run-level keys of every pipeline's YAML file, and the one role every run trains."""

    actor_train: RoleConfig

    # Each pipeline's config gives its own default (rlvr, sft).
    exp_name: str = "run"
    seed: int = bounded(42, ge=0, le=MAX_SEED)
    output_dir: str = "./output"
    # A fresh run into an output_dir that already holds a run (metrics.jsonl, hf_model/, step
    # checkpoints) is refused unless this is true: it then deletes them (see docs/faults.md).
    overwrite_output_dir: bool = False
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    track_with: str = one_of("tensorboard", table=TRACKERS)
    tracker_kwargs: dict[str, Any] = field(default_factory=dict)
    system_envs: dict[str, str] = field(default_factory=dict)

    # Placement: device ids are global; node = id // num_gpus_per_node.
    num_gpus_per_node: int = bounded(8, ge=1)
    num_nodes: int | None = bounded(None, ge=1)
    # "auto" uses CUDA when it is available, else every device id is a CPU slot.
    device: str = one_of("auto", table=DEVICES)

    # The model of every role whose model_args.model_name_or_path is unset (an RLVR critic takes
    # reward_pretrain).
    pretrain: str | None = None

    max_steps: int = bounded(100, ge=1)
    # 0: never save / never validate.
    save_steps: int = bounded(0, ge=0)
    logging_steps: int = bounded(1, ge=1)
    eval_steps: int = bounded(0, ge=0)
    resume_from_checkpoint: str | bool = False

    # How long the driver waits for one worker call, by stage (roll/configs/timeouts.py).
    worker_timeouts: WorkerTimeoutsConfig = field(default_factory=WorkerTimeoutsConfig)

    def roles(self) -> dict[str, RoleConfig]:
        """Every configured role by its key path."""
        return {"actor_train": self.actor_train}
