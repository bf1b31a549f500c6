"""Top-level RLVR run configuration: one YAML file maps onto ``RLVRConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roll.configs.rl_options import DynamicSamplingConfig, OffPolicyCorrectionConfig, OverlongConfig
from roll.configs.role import DataArgs, GeneratingArgs, RewardConfig, RoleConfig
from roll.configs.timeouts import WorkerTimeoutsConfig

ADV_ESTIMATORS = ("grpo", "reinforce", "reinforce_plus_plus", "gae")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean")
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


@dataclass
class ValidationConfig:
    data_args: DataArgs = field(default_factory=DataArgs)
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    # 0 means: use the top-level eval_steps.
    eval_steps: int = 0
    val_batch_size: int | None = None


@dataclass
class CheckpointConfig:
    type: str = "file_system"
    output_dir: str | None = None
    # Keep at most this many step checkpoints (oldest removed first); None keeps all.
    max_to_keep: int | None = None


@dataclass
class RLVRConfig:
    """Every key of an RLVR YAML file. Unknown keys are errors (see roll.configs.loader)."""

    actor_train: RoleConfig
    actor_infer: RoleConfig
    reference: RoleConfig | None = None
    critic: RoleConfig | None = None
    rewards: dict[str, RewardConfig] = field(default_factory=dict)
    validation: ValidationConfig | None = None

    exp_name: str = "rlvr"
    seed: int = 42
    output_dir: str = "./output"
    logging_dir: str | None = None
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    track_with: str = "tensorboard"
    tracker_kwargs: dict[str, Any] = field(default_factory=dict)
    system_envs: dict[str, str] = field(default_factory=dict)

    # Placement: device ids are global; node = id // num_gpus_per_node.
    num_gpus_per_node: int = 8
    num_nodes: int | None = None
    # "auto" uses CUDA when it is available, else every device id is a CPU slot.
    device: str = "auto"

    pretrain: str | None = None
    reward_pretrain: str | None = None

    max_steps: int = 100
    save_steps: int = 0
    logging_steps: int = 1
    eval_steps: int = 0
    resume_from_checkpoint: str | bool = False

    rollout_batch_size: int = 64
    prompt_length: int = 1024
    response_length: int = 1024
    num_return_sequences_in_group: int = 1

    # Algorithm.
    adv_estimator: str = "grpo"
    ppo_epochs: int = 1
    gamma: float = 1.0
    lambd: float = 1.0
    pg_clip: float = 0.2
    pg_clip_low: float | None = None
    pg_clip_high: float | None = None
    dual_clip_loss: bool = False
    dual_clip_c: float = 3.0
    value_clip: float | None = 0.5
    reward_clip: float | None = None
    advantage_clip: float | None = None
    whiten_advantages: bool = False
    whiten_rewards: bool = False
    norm_adv_by_std_in_grpo: bool = True
    init_kl_coef: float = 0.0
    kl_penalty: str = "kl"
    add_token_level_kl: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_loss_coef: float = 0.0
    loss_agg_mode: str = "token-mean"
    # alibaba/ROLL's per-sample options, same names and meanings (docs/migrating_from_roll.md;
    # roll.pipeline.rlvr.algorithms.sample_options).
    norm_mean_type: str | None = None
    norm_std_type: str | None = None
    max_len_mask: bool = False
    difficulty_mask: bool = False
    difficulty_low_threshold: float = 0.0
    difficulty_high_threshold: float = 1.0
    error_max_len_clip: bool = False
    error_max_len_threshold: int = 9999999999
    length_loss_weight: bool = False
    # DAPO sampling and train/inference mismatch correction (roll/configs/rl_options.py).
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    off_policy_correction: OffPolicyCorrectionConfig = field(default_factory=OffPolicyCorrectionConfig)
    # 1: generate step k+1 while step k trains (staleness bound 1; disaggregated actor_infer only).
    # 0: synchronous. See roll/pipeline/rlvr/rollout_source.py.
    async_generation_ratio: int = 0

    # Model update (trainer -> inference engines).
    model_update_frequency: int = 1
    model_update_buffer_size_mb: int = 512
    # Mean |logp_engine - logp_trainer| on a fixed probe batch (model_update/probe_logprob_diff)
    # above this bound fails the run; None: a warning above the dtype's threshold only
    # (roll/distributed/model_update/probe.py).
    model_update_probe_tolerance: float | None = None
    model_update_probe_size: int = 2

    # How long the driver waits for one worker call, by stage (roll/configs/timeouts.py).
    worker_timeouts: WorkerTimeoutsConfig = field(default_factory=WorkerTimeoutsConfig)

    def __post_init__(self) -> None:
        checks = {
            "adv_estimator": (self.adv_estimator, ADV_ESTIMATORS),
            "loss_agg_mode": (self.loss_agg_mode, LOSS_AGG_MODES),
            "kl_penalty": (self.kl_penalty, KL_PENALTIES),
            "kl_loss_type": (self.kl_loss_type, KL_PENALTIES),
            "device": (self.device, ("auto", "cpu", "cuda")),
            "track_with": (self.track_with, ("tensorboard", "wandb", "none")),
        }
        for key, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"{key}: expected one of {list(allowed)}, got {value!r}")
        for key in ("norm_mean_type", "norm_std_type"):
            if getattr(self, key) not in (None, "batch", "group"):
                raise ValueError(
                    f"{key}: expected null, 'batch' or 'group' (ROLL's 'running' is not supported), "
                    f"got {getattr(self, key)!r}"
                )
        if self.difficulty_mask and not self.difficulty_low_threshold < self.difficulty_high_threshold:
            raise ValueError(
                f"difficulty_low_threshold: must be below difficulty_high_threshold "
                f"({self.difficulty_low_threshold} >= {self.difficulty_high_threshold})"
            )
        if self.async_generation_ratio not in (0, 1):
            raise ValueError(
                f"async_generation_ratio: 0 (synchronous) or 1 (one step ahead), got {self.async_generation_ratio}"
            )
        tolerance = self.model_update_probe_tolerance
        if tolerance is not None and not 0 < tolerance < float("inf"):
            raise ValueError(
                f"model_update_probe_tolerance: must be a positive number (or null: warn only), got {tolerance}"
            )
        for key in ("rollout_batch_size", "num_return_sequences_in_group", "ppo_epochs", "num_gpus_per_node"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")

    def roles(self) -> dict[str, RoleConfig]:
        """Every configured role by its key path (rewards as 'rewards.<name>')."""
        out: dict[str, RoleConfig] = {"actor_train": self.actor_train, "actor_infer": self.actor_infer}
        if self.reference is not None:
            out["reference"] = self.reference
        if self.critic is not None:
            out["critic"] = self.critic
        for name, reward in self.rewards.items():
            out[f"rewards.{name}"] = reward
        return out
