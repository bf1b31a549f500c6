"""Per-role configuration: what every role (actor_train, actor_infer, reference, critic, rewards) declares.

Key names follow alibaba/ROLL and the Megatron configuration guide, so their YAML files load with
small edits. Strategy-specific options live in ``strategy_args.strategy_config`` and are checked
against the strategy's own dataclass (see ``roll.configs.strategy_configs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class ModelArgs:
    model_name_or_path: str | None = None
    dtype: str = "bf16"
    # None: causal LM. "value" (alias "trl"): a causal LM body with a scalar value head (critic).
    model_type: str | None = None
    disable_gradient_checkpointing: bool = False
    # "sdpa", "eager", "flash_attention_2"; ROLL's "fa2" is accepted as flash_attention_2.
    attn_implementation: str | None = None
    flash_attn: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {self.dtype!r}")
        if self.model_type not in (None, "value", "trl"):
            raise ValueError(f"model_type: expected null, 'value' or 'trl', got {self.model_type!r}")

    @property
    def is_value_model(self) -> bool:
        return self.model_type in ("value", "trl")


@dataclass
class TrainingArgs:
    learning_rate: float = 1.0e-6
    weight_decay: float = 0.0
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    num_train_epochs: int = 1
    lr_scheduler_type: str = "constant"
    min_lr_ratio: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1.0e-8
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.lr_scheduler_type not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"lr_scheduler_type: expected 'constant', 'linear' or 'cosine', got {self.lr_scheduler_type!r}"
            )
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


@dataclass
class GeneratingArgs:
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    num_beams: int = 1
    num_return_sequences: int = 1
    do_sample: bool = True
    repetition_penalty: float = 1.0
    stop_strings: list[str] | None = None

    def __post_init__(self) -> None:
        if self.num_beams != 1:
            raise ValueError(
                "num_beams: only 1 is supported (RL rollouts sample; beam search is not on-policy)"
            )
        if self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences: must be >= 1, got {self.num_return_sequences}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


@dataclass
class DataArgs:
    template: str | None = None
    file_name: list[str] | None = None
    dataset_dir: str | None = None
    # Field names inside each JSONL row.
    messages: str = "messages"
    prompt: str = "prompt"
    ground_truth: str = "ground_truth"
    tag: str = "tag"
    domain_interleave_probs: dict[str, float] | None = None
    interleave_probs: str | None = None
    preprocessing_num_workers: int = 1
    max_samples: int | None = None


@dataclass
class StrategyArgs:
    strategy_name: str
    # Checked against the strategy's own dataclass by roll.configs.validate, which stores the
    # typed result in ``config`` (e.g. a MegatronConfig).
    strategy_config: dict[str, Any] | None = None
    config: Any = field(default=None, init=False, repr=False, compare=False)


@dataclass
class RoleConfig:
    """One role: which model, which strategy, on which devices."""

    model_args: ModelArgs = field(default_factory=ModelArgs)
    training_args: TrainingArgs = field(default_factory=TrainingArgs)
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    data_args: DataArgs = field(default_factory=DataArgs)
    strategy_args: StrategyArgs | None = None
    device_mapping: list[int] | None = None
    infer_batch_size: int = 1
    # For roles without devices (CPU-only rewards): how many workers to start.
    world_size: int | None = None
    # Extra environment variables for this role's workers.
    system_envs: dict[str, str] = field(default_factory=dict)


@dataclass
class RewardConfig(RoleConfig):
    """A reward role. ``reward_fn`` names a function in roll.pipeline.rlvr.rewards' registry."""

    reward_fn: str = "math_rule"
    # Prompts whose tag is in this list are scored by this role (empty: every tag not claimed elsewhere).
    tag_included: list[str] = field(default_factory=list)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    # Time limit per sample for rule rewards; a sample over it scores 0 and is counted.
    timeout_s: float = 5.0
    # A sample whose function raises or gives no finite number scores 0 and counts as an error
    # (reward/errors); more than this fraction of a call's samples failing ends the run with a
    # RewardError. 1.0 never stops. See docs/faults.md.
    max_error_fraction: float = 0.5
    judge_prompt: str | None = None
