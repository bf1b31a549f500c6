"""The strategy interface: how a worker drives one model backend.

A strategy owns the model of one worker (one rank of a role) on its device. It has an inference
side (every strategy) and, for ``*_train`` strategies, a training side. Strategies are flat classes;
these Protocols only document the methods the workers call.

Batch layout (shared by every strategy, see ``roll.core.batch.Batch``):

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

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from roll.core.batch import Batch
from roll.core.loss import LossFn
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext

if TYPE_CHECKING:
    from roll.configs.role import RoleConfig


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
