"""Per-role configuration: what every role (actor_train, actor_infer, reference, critic, rewards) declares.

Key names follow alibaba/ROLL and the Megatron configuration guide, so their YAML files load with
small edits. Strategy-specific options live in ``strategy_args.strategy_config`` and are built as
the options class of the strategy's row (see ``roll.configs.strategies``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from roll.configs.ranges import bounded, one_of
from roll.configs.strategies import get_strategy_spec
from roll.core.sampling import SamplingParams

# Named values come from the tables that implement them (see roll.configs.ranges).
DTYPES = "roll.models.model_options:DTYPES"
ATTN_IMPLEMENTATIONS = "roll.models.model_options:ATTN_IMPLEMENTATIONS"
MODEL_TYPES = "roll.models.model_options:MODEL_TYPES"
LR_SCHEDULES = "roll.utils.lr_schedule:DECAYS"


# ``lora_target`` value meaning every nn.Linear of the decoder layers (never the LM head).
LORA_ALL_LINEAR = "all-linear"


@dataclass
class ModelArgs:
    model_name_or_path: str | None = None
    dtype: str = one_of("bf16", table=DTYPES)
    # None: causal LM. "value" (alias "trl"): a causal LM body with a scalar value head (critic).
    model_type: str | None = one_of(None, table=MODEL_TYPES)
    disable_gradient_checkpointing: bool = False
    # "sdpa", "eager", "flash_attention_2"; ROLL's "fa2" is accepted as flash_attention_2.
    attn_implementation: str | None = one_of(None, table=ATTN_IMPLEMENTATIONS)
    flash_attn: str | None = one_of(None, table=ATTN_IMPLEMENTATIONS)
    trust_remote_code: bool = False
    # LoRA (fsdp2_train: roll.models.lora; megatron_train: roll.models.megatron.lora): module-name
    # suffixes of the decoder layers' linear modules to adapt ("q_proj,v_proj" or a list;
    # "all-linear": every one), the adapters' rank (None: train every parameter), alpha (None: the
    # rank, i.e. scale 1) and input dropout.
    lora_target: list[str] | None = None
    lora_rank: int | None = bounded(None, ge=1)
    lora_alpha: float | None = bounded(None, gt=0)
    lora_dropout: float = bounded(0.0, ge=0, lt=1)
    # Parameters whose module names start with one of these prefixes are frozen on a trainer role
    # ("model.visual": a vision-language model's vision tower, as in alibaba/ROLL); a comma string
    # or a list.
    freeze_module_prefix: list[str] | None = None

    def __post_init__(self) -> None:
        if self.freeze_module_prefix is not None:
            self.freeze_module_prefix = [
                p.strip() for item in self.freeze_module_prefix for p in item.split(",") if p.strip()
            ]
        if self.lora_target is not None:  # ROLL writes one comma-separated string
            self.lora_target = [t.strip() for item in self.lora_target for t in item.split(",") if t.strip()]
        if self.lora_rank is None:
            for key in ("lora_target", "lora_alpha"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"{key}: is set but lora_rank is not; set lora_rank (e.g. 8) or remove it"
                    )
            if self.lora_dropout:
                raise ValueError(
                    "lora_dropout: is set but lora_rank is not; set lora_rank (e.g. 8) or remove it"
                )
        elif not self.lora_target:
            raise ValueError(
                "lora_target: is required with lora_rank: module-name suffixes such as q_proj,v_proj, or all-linear"
            )

    @property
    def is_value_model(self) -> bool:
        return self.model_type is not None  # every named type is a value model (MODEL_TYPES)

    @property
    def uses_lora(self) -> bool:
        return self.lora_rank is not None

    def lora_keys_set(self) -> list[str]:
        """The lora_* keys given a value (not their defaults)."""
        return [f.name for f in fields(self) if f.name in LORA_KEYS and getattr(self, f.name) != f.default]


# ModelArgs' LoRA fields (what a ROLL file may carry on any role).
LORA_KEYS = tuple(f.name for f in fields(ModelArgs) if f.name.startswith("lora_"))


@dataclass
class TrainingArgs:
    learning_rate: float = bounded(1.0e-6, ge=0)
    weight_decay: float = bounded(0.0, ge=0)
    per_device_train_batch_size: int = bounded(1, ge=1)
    gradient_accumulation_steps: int = bounded(1, ge=1)
    warmup_steps: int = bounded(0, ge=0)
    warmup_ratio: float = bounded(0.0, ge=0, le=1)
    lr_scheduler_type: str = one_of("constant", table=LR_SCHEDULES)
    min_lr_ratio: float = bounded(0.0, ge=0, le=1)
    adam_beta1: float = bounded(0.9, ge=0, lt=1)
    adam_beta2: float = bounded(0.999, ge=0, lt=1)
    adam_epsilon: float = bounded(1.0e-8, gt=0)
    # 0: no gradient clipping.
    max_grad_norm: float = bounded(1.0, ge=0)


@dataclass
class GeneratingArgs:
    max_new_tokens: int = bounded(512, ge=1)
    min_new_tokens: int = bounded(0, ge=0)
    temperature: float = bounded(1.0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    # -1: no top-k filtering.
    top_k: int = bounded(-1, ge=-1)
    num_beams: int = bounded(1, ge=1, le=1, note="RL rollouts sample; beam search is not on-policy")
    num_return_sequences: int = bounded(1, ge=1)
    do_sample: bool = True
    repetition_penalty: float = bounded(1.0, gt=0)
    stop_strings: list[str] | None = None
    # Each sampled token's log-prob from the engine (``infer_logprobs``): off_policy_correction
    # needs it and rollout/logprob_mismatch reads it. false spares the engine a full-vocabulary
    # log-softmax and a Python log-prob record per token (docs/benchmarks.md "Rollout").
    logprobs: bool = True

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The engine-neutral sampling parameters these arguments describe (greedy when
        ``do_sample`` is off or the temperature is 0); ``overrides`` set fields after that."""
        greedy = not self.do_sample or self.temperature == 0
        params = SamplingParams(
            n=self.num_return_sequences,
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            temperature=0.0 if greedy else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            stop=list(self.stop_strings) if self.stop_strings else None,
            logprobs=self.logprobs,
        )
        for key, value in overrides.items():
            setattr(params, key, value)
        return params


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
    # A vision-language row's images (alibaba/ROLL's layout: a list of image bytes, paths, or
    # {"bytes", "path"} records; roll.pipeline.rlvr.data.vision).
    images: str = "images"
    # The image processor's pixel bounds for this file's images (alibaba/ROLL's keys); None: the
    # model's preprocessor_config.json (ROLL's defaults: 4 * 28 * 28 and 4096 * 4096).
    image_min_pixels: int | None = bounded(None, ge=1)
    image_max_pixels: int | None = bounded(None, ge=1)
    # A row's videos (a path or a list of paths; roll.pipeline.rlvr.data.video) and how their
    # frames are sampled (alibaba/ROLL's keys; None: Qwen's qwen_vl_utils defaults).
    video: str = "video"
    video_fps: float | None = bounded(None, gt=0)
    video_max_frames: int | None = bounded(None, ge=2)
    video_min_pixels: int | None = bounded(None, ge=1)
    video_max_pixels: int | None = bounded(None, ge=1)
    video_total_pixels: int | None = bounded(None, ge=1)
    video_folder: str | None = None  # where relative video paths are looked up first
    # A row's audio files (a name or a list; roll.pipeline.rlvr.data.audio), looked up under
    # audio_folder first (alibaba/ROLL's key), for a model with an audio tower (Qwen3-Omni).
    audios: str = "audios"
    audio_folder: str | None = None
    # "video_r1": rows in Video-R1's layout (problem, problem_type, solution, video), which ROLL's
    # custom_data_kwargs_func video_r1_get_data_kwargs reads; "audio_test": ROLL's audio rows (a
    # question, audios, reward_model.ground_truth), which its audio_test_get_data_kwargs reads.
    row_layout: str = one_of("default", "default", "video_r1", "audio_test")
    domain_interleave_probs: dict[str, float] | None = bounded(None, ge=0)
    max_samples: int | None = bounded(None, ge=1)


@dataclass
class StrategyArgs:
    """Which strategy runs the role, and its options.

    ``strategy_config`` may be given as a mapping (YAML, or a role built in code) or None; it is
    built strictly here into the options class of the strategy's row (``roll.configs.strategies``),
    so once constructed it is always that object, e.g. a ``MegatronConfig``:

    >>> StrategyArgs("fsdp2_train", {"sharding": "no_shard"}).strategy_config.sharding
    'no_shard'

    An unknown name or key is a ConfigError naming ``strategy_name`` or ``strategy_config.<key>``
    (the loader puts the role's path in front).
    """

    strategy_name: str
    # Annotated Any so the loader hands the mapping through; the options object after __post_init__.
    strategy_config: Any = None

    def __post_init__(self) -> None:
        spec = get_strategy_spec(self.strategy_name, "strategy_name")
        self.strategy_config = spec.build_options(self.strategy_config)


@dataclass
class RoleConfig:
    """One role: which model, which strategy, on which devices."""

    model_args: ModelArgs = field(default_factory=ModelArgs)
    training_args: TrainingArgs = field(default_factory=TrainingArgs)
    generating_args: GeneratingArgs = field(default_factory=GeneratingArgs)
    data_args: DataArgs = field(default_factory=DataArgs)
    strategy_args: StrategyArgs | None = None
    device_mapping: list[int] | None = bounded(None, ge=0)
    infer_batch_size: int = bounded(1, ge=1)
    # For roles without devices (CPU-only rewards): how many workers to start.
    world_size: int | None = bounded(None, ge=1)
    # Extra environment variables for this role's workers.
    system_envs: dict[str, str] = field(default_factory=dict)


def strategy_options(role: RoleConfig) -> Any:
    """The role's typed strategy options (``strategy_args.strategy_config``), or None for a role
    without a strategy (a rule reward)."""
    return role.strategy_args.strategy_config if role.strategy_args is not None else None


# ``RewardConfig.max_abs_reward``'s default, also the bound of rule rewards scored outside a run.
DEFAULT_MAX_ABS_REWARD = 1.0e6


@dataclass
class RewardConfig(RoleConfig):
    """A reward role. ``reward_fn`` names a function in roll.pipeline.rewards' registry."""

    reward_fn: str = "math_rule"
    # Prompts whose tag is in this list are scored by this role (empty: every tag not claimed elsewhere).
    tag_included: list[str] = field(default_factory=list)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    # Time limit per sample for rule rewards; a sample over it scores 0 and is a failure (reward/timeouts).
    timeout_s: float = bounded(5.0, gt=0)
    # A sample whose function raises, times out or gives no finite number (or one beyond
    # max_abs_reward) scores 0 and is a failure (reward/failures); more than this fraction of a
    # call's samples failing ends the run with a RewardError, and the call stops scoring as soon as
    # that is certain. 1.0 never stops. See docs/faults.md.
    max_error_fraction: float = bounded(0.01, ge=0, le=1)
    # A score larger than this in magnitude is a failure like NaN (a reward of 1e30 is a bug).
    max_abs_reward: float = bounded(DEFAULT_MAX_ABS_REWARD, gt=0)
    judge_prompt: str | None = None
