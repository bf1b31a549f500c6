"""The strategy interface: how a worker drives one model backend.

A strategy owns the model of one worker (one rank of a role) on its device. It has an inference
side (every strategy) and, for ``*_train`` strategies, a training side. Strategies are flat classes;
these Protocols only document the methods the workers call.

Batch layout (shared by every strategy, see ``roll.distributed.scheduler.batch.Batch``):

==================  ===========  =====================================================================
field               shape        meaning
==================  ===========  =====================================================================
``prompts``         [B, P]       prompt token ids, LEFT-padded to P (``prompt_mask`` marks real tokens)
``prompt_mask``     [B, P]       1 for prompt tokens, 0 for padding
``responses``       [B, R]       response token ids, RIGHT-padded to R (= response_length)
``response_mask``   [B, R]       1 for generated tokens (EOS included), 0 for padding
``input_ids``       [B, P+R]     prompts then responses
``attention_mask``  [B, P+R]     prompt_mask then response_mask
``position_ids``    [B, P+R]     cumulative sum of attention_mask - 1, clamped at 0
``infer_logprobs``  [B, R]       log-probs the engine sampled with (0 on padding)
``old_log_probs``   [B, R]       log-probs from actor_train before the update; ``ref_log_probs`` from reference
==================  ===========  =====================================================================

Log-probs and entropies are always [B, R]: position t scores ``responses[:, t]`` given everything
before it, i.e. logits at column P + t - 1 of ``input_ids``.

Example (what a worker does)::

    strategy = load_strategy_class("hf_infer")(role_config, ctx)
    strategy.initialize()
    out = strategy.generate(prompts_batch, SamplingParams(n=4, max_new_tokens=32))
    logp = strategy.compute_log_probs(out)["log_probs"]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from roll.distributed.scheduler.batch import Batch

if TYPE_CHECKING:
    from roll.configs.pipeline_config import RLVRConfig
    from roll.configs.role import GeneratingArgs, RoleConfig

# loss_fn(outputs, micro_batch) -> (scalar loss, metrics). ``outputs`` holds "log_probs" and
# "entropy" ([b, R]) for policy models, or "values" ([b, R]) for value models.
LossFn = Callable[[dict[str, torch.Tensor], Batch], "tuple[torch.Tensor, dict[str, float]]"]


@dataclass
class WorkerContext:
    """Where a strategy runs: its role, its rank in the role's process group, and its device."""

    role: str
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    seed: int = 42
    # The whole run's config (prompt_length, response_length, ...); None in unit tests.
    pipeline: RLVRConfig | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class SamplingParams:
    """Engine-neutral sampling parameters; each inference strategy maps them to its engine."""

    n: int = 1
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: bool = True
    seed: int | None = None
    # Generate past EOS (benchmarks that need every response at full length); stop ids still apply.
    ignore_eos: bool = False

    @classmethod
    def from_generating_args(cls, args: GeneratingArgs, **overrides: Any) -> SamplingParams:
        greedy = not args.do_sample or args.temperature == 0
        params = cls(
            n=args.num_return_sequences,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.min_new_tokens,
            temperature=0.0 if greedy else args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            stop=list(args.stop_strings) if args.stop_strings else None,
        )
        for key, value in overrides.items():
            setattr(params, key, value)
        return params


class InferenceStrategy(Protocol):
    """What every strategy offers (``hf_infer``, ``megatron_infer``, ``vllm``, ``sglang``, and the
    inference side of ``*_train``)."""

    def __init__(self, role_config: RoleConfig, ctx: WorkerContext) -> None: ...

    def initialize(self) -> None:
        """Build the model from ``role_config.model_args.model_name_or_path`` on ``ctx.device``."""

    def compute_log_probs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs": [B, R], "entropy": [B, R]} for ``batch["responses"]`` (values models:
        {"values": [B, R]})."""

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample ``params.n`` responses per prompt row; returns B * n rows in prompt order
        (row i*n + j is sample j of prompt i) with the fields in the table above, the prompt rows'
        non-tensor fields repeated."""

    def offload_states(self) -> None:
        """Free device memory (weights to CPU, KV cache dropped) while another role uses the device."""

    def reload_states(self) -> None:
        """Bring back what ``offload_states`` moved."""

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors (model update); the strategy shards them into its own layout."""


class TrainStrategy(InferenceStrategy, Protocol):
    """The training side (``fsdp2_train``, ``megatron_train``)."""

    def train_step(self, micro_batches: list[Batch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step: forward/backward every micro-batch (loss scaled by 1/len), clip
        gradients, step optimizer and LR scheduler. Returns averaged loss metrics plus
        ``grad_norm`` and ``lr``."""

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors of the parameters this rank is responsible for sending (TP shards
        gathered; one sender per PP stage / EP rank); ranks that send nothing yield nothing."""

    def save_checkpoint(self, path: str) -> None:
        """Weights, optimizer and scheduler state of this rank under ``path`` (a directory)."""

    def load_checkpoint(self, path: str) -> None: ...

    def save_hf_checkpoint(self, path: str) -> None:
        """Export the full model as a Hugging Face checkpoint (safetensors + config + tokenizer)."""
