"""The strategy interface: how a worker drives one model backend.

A strategy owns the model of one worker (one rank of a role) on its device. Strategies are flat
classes; these Protocols say what the workers call, and they are checked: each registry row
(``registry.py``) names the Protocols its class implements, and loading the class checks every one
of them against the class's methods (names and parameters, see ``check_protocol``) without making
an instance, so engine classes are checked without the engine installed. A class that has all the
methods of an optional Protocol must declare it, so ``isinstance(strategy, Protocol)`` at run time
gives the answer the row declares.

- ``ModelStrategy``: every strategy. ``InferenceStrategy`` adds ``generate`` (``hf_infer``,
  ``megatron_infer``, vLLM, SGLang); ``TrainStrategy`` adds training, checkpoints and
  ``iter_hf_weights``.
- Optional: ``ValueModelStrategy`` (critic values), ``HFWeightSource`` (weights by HF name),
  ``FinishesModelUpdate``, and the engines' own bucket paths ``SharedBucketEngine`` (colocated),
  ``BroadcastBucketEngine`` (received in the engine's processes on roll's group) and
  ``DistributedBucketEngine`` (received on a group the engine builds itself, SGLang's).

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

import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from roll.core.batch import Batch
from roll.core.loss import LossFn
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext

if TYPE_CHECKING:
    from roll.configs.role import RoleConfig


@runtime_checkable
class ModelStrategy(Protocol):
    """What every strategy offers."""

    def __init__(self, role_config: RoleConfig, ctx: WorkerContext) -> None: ...

    def initialize(self) -> None:
        """Build the model from ``role_config.model_args.model_name_or_path`` on ``ctx.device``."""

    def dp_layout(self) -> tuple[int, int, bool]:
        """(dp rank, dp size, whether this rank's outputs are collected) of this rank; TP/PP peers
        share a DP rank and one of them outputs."""

    def compute_log_probs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs": [B, R], "entropy": [B, R]} for ``batch["responses"]``."""

    def offload_states(self) -> None:
        """Free device memory (weights to CPU, KV cache dropped) while another role uses the device."""

    def reload_states(self) -> None:
        """Bring back what ``offload_states`` moved."""

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors (model update); the strategy shards them into its own layout."""


@runtime_checkable
class InferenceStrategy(ModelStrategy, Protocol):
    """A strategy that samples (``hf_infer``, ``megatron_infer``, ``vllm``, ``sglang``)."""

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """Sample ``params.n`` responses per prompt row; returns B * n rows in prompt order
        (row i*n + j is sample j of prompt i) with the fields in the table above, the prompt rows'
        non-tensor fields repeated."""


@runtime_checkable
class HFWeightSource(Protocol):
    """A strategy that shows its weights by Hugging Face name (trainers send them; an engine that
    has it can be compared tensor by tensor after a model update)."""

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors of the parameters this rank is responsible for sending (TP shards
        gathered; one sender per PP stage / EP rank); ranks that send nothing yield nothing."""


@runtime_checkable
class TrainStrategy(ModelStrategy, HFWeightSource, Protocol):
    """The training side (``fsdp2_train``, ``megatron_train``)."""

    def train_step(self, micro_batches: list[Batch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step: forward/backward every micro-batch (loss scaled by 1/len), clip
        gradients, step optimizer and LR scheduler. Returns averaged loss metrics plus
        ``grad_norm`` and ``lr``."""

    def save_checkpoint(self, path: str) -> None:
        """Weights, optimizer and scheduler state of this rank under ``path`` (a directory)."""

    def load_checkpoint(self, path: str) -> None: ...

    def save_hf_checkpoint(self, path: str) -> None:
        """Export the full model as a Hugging Face checkpoint (safetensors + config + tokenizer)."""


@runtime_checkable
class ValueModelStrategy(Protocol):
    """A strategy that can hold a value model (``model_args.model_type: value``, the critic)."""

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values [B, R] for ``batch["responses"]``."""


@runtime_checkable
class FinishesModelUpdate(Protocol):
    """A strategy with work to do once a whole model update has loaded (restore a KV cache, bump
    the engine's version)."""

    def finish_model_update(self, version: int) -> None: ...


@runtime_checkable
class SharedBucketEngine(Protocol):
    """An engine that loads a colocated sender's bucket itself (mapped from the sender's buffer)."""

    def load_shared_bucket(
        self, meta: Any, handle: Any, verify: bool = False
    ) -> list[tuple[int, int]] | None:
        """Load the bucket; its per-tensor checksums when ``verify``."""


@runtime_checkable
class BroadcastBucketEngine(Protocol):
    """An engine whose own processes (vLLM's TP workers) receive a sender's broadcast buckets."""

    def model_update_ranks(self) -> int:
        """Ranks this worker adds to a broadcast group."""

    def join_model_update_group(
        self, host: str, port: int, prefix: str, rank_offset: int, world_size: int, backend: str = "nccl"
    ) -> Any: ...

    def receive_bucket(self, group: str, meta: Any, verify: bool = False) -> None:
        """Queue the receive and load of the next bucket broadcast on data group ``group`` (the
        ``prefix`` it joined; one per trainer rank that feeds this engine) without waiting."""

    def take_checksums(self, group: str) -> list[tuple[int, int]]:
        """Wait for the buckets queued on ``group``; their per-tensor checksums, in order."""


@runtime_checkable
class DistributedBucketEngine(Protocol):
    """An engine whose own processes build a group with a remote sender and receive each bucket on
    it (SGLang's ``init_weights_update_group`` / ``update_weights_from_distributed``), loading it
    into their parameters: no checksums come back."""

    def model_update_ranks(self) -> int:
        """Ranks this worker adds to the group."""

    def uses_engine_group(self, colocated: bool) -> bool:
        """Whether a link from a sender (on this worker's device or not) goes through the engine's
        own group; raises where the configured transport cannot serve such a link."""

    def init_weights_update_group(
        self, host: str, port: int, rank_offset: int, world_size: int, group_name: str, backend: str = "nccl"
    ) -> None:
        """Build group ``group_name`` with the sender's store at host:port, as ``rank_offset + tp rank``."""

    def update_weights_from_distributed(self, group_name: str, meta: Any) -> None:
        """Receive the bucket ``meta`` describes on ``group_name`` and load it; returns when loaded."""


# The Protocols a registry row may add to the one its side requires.
OPTIONAL_PROTOCOLS: tuple[type, ...] = (
    InferenceStrategy,
    HFWeightSource,
    ValueModelStrategy,
    FinishesModelUpdate,
    SharedBucketEngine,
    BroadcastBucketEngine,
    DistributedBucketEngine,
)


def protocol_methods(protocol: type) -> dict[str, Any]:
    """The methods ``protocol`` (and the Protocols it extends) declares, by name; ``__init__`` aside."""
    methods: dict[str, Any] = {}
    for base in reversed(protocol.__mro__):
        if base in (object, Protocol) or not getattr(base, "_is_protocol", False):
            continue
        for name, value in vars(base).items():
            if inspect.isfunction(value) and not name.startswith("_"):
                methods[name] = value
    return methods


def check_protocol(cls: type, protocol: type) -> list[str]:
    """What ``cls`` lacks to implement ``protocol``: missing methods, and parameters that differ
    (each of the Protocol's parameters by name and kind, in order; extra ones need a default)."""
    problems = []
    for name, want in protocol_methods(protocol).items():
        have = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(have):
            problems.append(f"{name}() is missing")
            continue
        problem = _signature_problem(inspect.signature(want), inspect.signature(have))
        if problem:
            problems.append(f"{name}(): {problem}")
    return problems


def _signature_problem(want: inspect.Signature, have: inspect.Signature) -> str | None:
    wanted = list(want.parameters.values())[1:]
    got = list(have.parameters.values())[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in got):
        return None
    for i, param in enumerate(wanted):
        if i >= len(got) or (got[i].name, got[i].kind) != (param.name, param.kind):
            return f"parameters {_names(got)} do not start with {_names(wanted)}"
        if param.default is not param.empty and got[i].default is param.empty:
            return f"parameter {param.name!r} needs a default"
    extra = [p.name for p in got[len(wanted) :] if p.default is p.empty]
    return f"extra parameters {extra} need defaults" if extra else None


def _names(params: list[inspect.Parameter]) -> list[str]:
    return [p.name for p in params]
