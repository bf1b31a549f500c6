"""Top-level RLVR run configuration: one YAML file maps onto ``RLVRConfig``; the keys every run
has (output_dir, seed, max_steps, placement, ...) come from ``RunConfig`` (roll/configs/run_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.ranges import bounded, one_of
from roll.configs.rl_options import (
    DynamicSamplingConfig,
    OffPolicyCorrectionConfig,
    OverlongConfig,
    PolicyLossConfig,
)
from roll.configs.role import DataArgs, GeneratingArgs, RewardConfig, RoleConfig
from roll.configs.rollout_dump import RolloutDumpConfig
from roll.configs.run_config import RunConfig

# Named values come from the tables that implement them (see roll.configs.ranges).
_ALGO = "roll.pipeline.rlvr.algorithms"
ADV_ESTIMATORS = f"{_ALGO}.advantages:ADV_ESTIMATORS"
LOSS_AGG_MODES = f"{_ALGO}.masked:AGG_MODES"
POLICY_LOSSES = f"{_ALGO}.policy_losses:POLICY_LOSSES"
KL_ESTIMATORS = f"{_ALGO}.kl:KL_ESTIMATORS"
KL_REFUSED = f"{_ALGO}.kl:KL_REFUSED"
NORM_TYPES = f"{_ALGO}.sample_options:NORM_TYPES"
NORM_REFUSED = f"{_ALGO}.sample_options:NORM_REFUSED"
MEMORY_CHECKS = "roll.planner.report:MEMORY_CHECKS"


@dataclass
class ValidationConfig:
    data_args: DataArgs = field(default_factory=DataArgs)
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    # 0 means: use the top-level eval_steps.
    eval_steps: int = bounded(0, ge=0)
    val_batch_size: int | None = bounded(None, ge=1)


@dataclass(kw_only=True)
class RLVRConfig(RunConfig):
    """Every key of an RLVR YAML file: ``RunConfig``'s and these. Unknown keys are errors (see
    roll.configs.loader)."""

    actor_infer: RoleConfig
    reference: RoleConfig | None = None
    critic: RoleConfig | None = None
    rewards: dict[str, RewardConfig] = field(default_factory=dict)
    # The reward role that scores rows whose tag no role's tag_included lists (ROLL files get
    # math_rule, where alibaba/ROLL sends such rows); a role with an empty tag_included does the same.
    default_reward: str | None = None
    validation: ValidationConfig | None = None

    # RunConfig's key, with this pipeline's default.
    exp_name: str = "rlvr"
    # Memory plan (roll/planner, docs/memory_planner.md): the device size predicted peaks are checked
    # against (a known GPU, or GiB; at launch the detected device otherwise), and what a device
    # predicted not to fit does: warn, error (a ConfigError before anything starts), or off.
    gpu: str | None = one_of(None, table="roll.planner.devices:KNOWN_GPUS")
    device_memory_gib: float | None = bounded(None, gt=0)
    memory_check: str = one_of("warn", table=MEMORY_CHECKS)

    # The critic's model when its model_args.model_name_or_path is unset (``pretrain``: the others').
    reward_pretrain: str | None = None

    rollout_batch_size: int = bounded(64, ge=1)
    prompt_length: int = bounded(1024, ge=1)
    response_length: int = bounded(1024, ge=1)
    num_return_sequences_in_group: int = bounded(1, ge=1)

    # Algorithm.
    adv_estimator: str = one_of("grpo", table=ADV_ESTIMATORS)
    ppo_epochs: int = bounded(1, ge=1)
    # Where the PPO ratio's old log-probs come from. "auto": from the training forward itself
    # (detached), with no pass of their own, where that gives exactly the same values: one PPO epoch
    # whose step is one optimizer step, a strategy that returns them (fsdp2_train), and nothing that
    # reads them before training (add_token_level_kl, overlong.filter); else a separate forward.
    # "always": the separate forward every step (roll.pipeline.rlvr.stages.old_log_probs_from_train).
    recompute_old_log_probs: str = one_of("auto", "auto", "always")
    gamma: float = bounded(1.0, ge=0, le=1)
    lambd: float = bounded(1.0, ge=0, le=1)
    # The policy loss (alibaba/ROLL's pg_variant names, docs/policy_losses.md); its options in policy_loss.
    pg_variant: str = one_of("ppo", table=POLICY_LOSSES)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    pg_clip: float = bounded(0.2, ge=0)
    pg_clip_low: float | None = bounded(None, ge=0)
    pg_clip_high: float | None = bounded(None, ge=0)
    dual_clip_loss: bool = False
    dual_clip_c: float = bounded(3.0, gt=1, note="the dual clip bounds the loss at c x advantage")
    value_clip: float | None = bounded(0.5, gt=0)
    reward_clip: float | None = bounded(None, gt=0)
    advantage_clip: float | None = bounded(None, gt=0)
    whiten_advantages: bool = False
    whiten_rewards: bool = False
    norm_adv_by_std_in_grpo: bool = True
    init_kl_coef: float = bounded(0.0, ge=0)
    kl_penalty: str = one_of("kl", table=KL_ESTIMATORS, refused=KL_REFUSED)
    add_token_level_kl: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = bounded(0.0, ge=0)
    kl_loss_type: str = one_of("low_var_kl", table=KL_ESTIMATORS, refused=KL_REFUSED)
    # Negative values push entropy down; any finite value is accepted.
    entropy_loss_coef: float = bounded(0.0)
    loss_agg_mode: str = one_of("token-mean", table=LOSS_AGG_MODES)
    # alibaba/ROLL's per-sample options, same names and meanings (docs/migrating_from_roll.md;
    # roll.pipeline.rlvr.algorithms.sample_options).
    norm_mean_type: str | None = one_of(None, table=NORM_TYPES, refused=NORM_REFUSED)
    norm_std_type: str | None = one_of(None, table=NORM_TYPES, refused=NORM_REFUSED)
    max_len_mask: bool = False
    difficulty_mask: bool = False
    difficulty_low_threshold: float = bounded(0.0)
    difficulty_high_threshold: float = bounded(1.0)
    error_max_len_clip: bool = False
    error_max_len_threshold: int = bounded(9999999999, ge=0)
    length_loss_weight: bool = False
    # DAPO sampling and train/inference mismatch correction (roll/configs/rl_options.py).
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    off_policy_correction: OffPolicyCorrectionConfig = field(default_factory=OffPolicyCorrectionConfig)
    # 1: generate step k+1 while step k trains (staleness bound 1; disaggregated actor_infer only).
    # 0: synchronous. See roll/pipeline/rlvr/rollout_source.py.
    async_generation_ratio: int = bounded(0, ge=0, le=1, note="0: synchronous, 1: one step ahead")
    # Write every step's rollouts to rollout_dump.dir (mode: dump), or train on the ones there
    # instead of generating (mode: replay); roll/configs/rollout_dump.py, docs/dapo_off_policy_async.md.
    rollout_dump: RolloutDumpConfig = field(default_factory=RolloutDumpConfig)

    # Model update (trainer -> inference engines).
    model_update_frequency: int = bounded(1, ge=1)
    model_update_buffer_size_mb: int = bounded(512, ge=1)
    # Mean |logp_engine - logp_trainer| on a fixed probe batch (model_update/probe_logprob_diff)
    # above this bound fails the run; None: a warning above the dtype's threshold only
    # (roll/distributed/model_update/probe.py).
    model_update_probe_tolerance: float | None = bounded(None, gt=0)
    # 0: no probe.
    model_update_probe_size: int = bounded(2, ge=0)

    def __post_init__(self) -> None:
        if self.default_reward is not None and self.default_reward not in self.rewards:
            raise ValueError(
                f"default_reward: {self.default_reward!r} is not a reward role; roles: {sorted(self.rewards)}"
            )
        if self.difficulty_mask and not self.difficulty_low_threshold < self.difficulty_high_threshold:
            raise ValueError(
                f"difficulty_low_threshold: must be below difficulty_high_threshold "
                f"({self.difficulty_low_threshold} >= {self.difficulty_high_threshold})"
            )

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
