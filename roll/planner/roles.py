"""Predicted peak device memory of one rank of each role, from its strategy options and the run's
batch sizes (formulas in roll.planner.memory).

    role = role_memory("actor_train", config.actor_train, config, plan.roles["actor_train"], shape,
                       capacity=80 * GIB, colocated=True)
    role.peak, role.idle, role.knob_for(role.largest())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RoleConfig, strategy_options
from roll.configs.strategies import get_strategy_spec
from roll.distributed.scheduler.placement import RolePlan
from roll.planner import memory as mem
from roll.planner.model_shape import ModelShape

GIB = mem.GIB
# Memory of one GPU process outside its allocator's tensors: the CUDA context, cuBLAS workspaces
# and NCCL communicators' buffers. A megatron process opens many process groups (TP, DP, EP, PP, CP
# and their products); rlvr_megatron_2gpus with a 128-wide 3-layer model peaked at 21.2 GiB per GPU
# with three megatron processes on each (docs/memory_planner.md).
CONTEXT_BYTES = GIB // 2
MEGATRON_CONTEXT_BYTES = 7 * GIB
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
STRATEGY = "strategy_args.strategy_config"


@dataclass(frozen=True)
class RoleMemory:
    """One rank of a role: its peak while it runs (``parts`` + ``context``), what stays on the
    device while a colocated role runs (``idle``), and the key to turn per part."""

    role: str
    strategy: str
    parts: dict[str, int]
    idle: int
    context: int = CONTEXT_BYTES
    knobs: dict[str, str] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        return sum(self.parts.values()) + self.context

    def largest(self) -> str:
        return max(self.parts, key=self.parts.__getitem__)

    def knob_for(self, part: str) -> str:
        return f"{self.role}.{self.knobs.get(part, 'device_mapping')}"


@dataclass(frozen=True)
class Workload:
    """Tokens and rows one rank of a role handles at once."""

    seq: int  # prompt + response positions
    prompt: int
    train_tokens: int  # per micro-batch
    forward_tokens: int  # per log-prob forward call
    gen_rows: int  # sequences generating at once


def workload(config: RLVRConfig, role: RoleConfig, dp: int, options: Any = None) -> Workload:
    """Sizes from the run's batch settings; a strategy's token budgets (``max_tokens_per_microbatch``,
    ``infer_max_tokens_per_microbatch`` of packing strategies) bound a micro-batch's tokens instead."""
    seq = config.prompt_length + config.response_length
    n = max(role.generating_args.num_return_sequences, 1)
    prompts = -(-config.rollout_batch_size // max(dp, 1))
    samples = -(-config.rollout_batch_size * config.num_return_sequences_in_group // max(dp, 1))
    train_budget = getattr(options, "max_tokens_per_microbatch", None)
    forward_budget = getattr(options, "infer_max_tokens_per_microbatch", None)
    return Workload(
        seq=seq,
        prompt=config.prompt_length,
        train_tokens=train_budget or role.training_args.per_device_train_batch_size * seq,
        forward_tokens=forward_budget or min(role.infer_batch_size, samples) * seq,
        gen_rows=min(role.infer_batch_size, prompts) * n,
    )


@dataclass(frozen=True)
class RoleInputs:
    """What a strategy's formula reads: the role, its typed strategy config, the run, the sizes."""

    name: str
    role: RoleConfig
    cfg: Any  # the strategy's typed config (MegatronConfig, VLLMConfig, ...); None for default hf_infer
    config: RLVRConfig
    plan: RolePlan
    shape: ModelShape
    work: Workload
    dtype: int  # bytes per weight
    capacity: int | None  # device bytes, when known


# parts (bytes by column), idle bytes, key per part
Prediction = tuple[dict[str, int], int, dict[str, str]]


def role_memory(
    name: str,
    role: RoleConfig,
    config: RLVRConfig,
    plan: RolePlan,
    shape: ModelShape,
    capacity: int | None,
    colocated: bool,
) -> RoleMemory:
    """The prediction for one rank of ``name``, by the memory model its strategy's row names."""
    args = role.strategy_args
    strategy = args.strategy_name if args else "hf_infer"
    cfg = strategy_options(role)
    work = workload(config, role, plan.parallel.dp, cfg)
    dtype = DTYPE_BYTES.get(role.model_args.dtype, 2)
    inputs = RoleInputs(name, role, cfg, config, plan, shape, work, dtype, capacity)
    model = MEMORY_MODELS[get_strategy_spec(strategy).memory_model]
    parts, idle, knobs = model.predict(inputs)
    if not colocated:
        idle = sum(parts.values())
    return RoleMemory(name, strategy, parts, idle, model.context_bytes(plan.world_size), knobs)


def _megatron_split(cfg: Any, layers: int, tp_only: bool = False) -> mem.Split:
    tp = cfg.tensor_model_parallel_size
    return mem.Split(
        stage_layers=tuple(sum(rank) for rank in cfg.pipeline_rank_layers(layers)),
        tp=tp,
        pp=cfg.pipeline_model_parallel_size,
        ep=cfg.expert_model_parallel_size,
        etp=cfg.expert_tensor_parallel_size or tp,
        cp=cfg.context_parallel_size,
        sequence_parallel=cfg.sequence_parallel and not tp_only,
        vocab_multiple=cfg.make_vocab_size_divisible_by,
    )


def _train_batch_knob(cfg: Any) -> str:
    """The key that sizes a train micro-batch: the token budget where one is set."""
    if cfg.max_tokens_per_microbatch is not None:
        return f"{STRATEGY}.max_tokens_per_microbatch"
    return "training_args.per_device_train_batch_size"


def _megatron_train(x: RoleInputs) -> Prediction:
    cfg, shape, split = x.cfg, x.shape, _megatron_split(x.cfg, x.shape.layers)
    recompute = cfg.recompute_granularity == "full"
    args = x.role.model_args
    lora = shape.megatron_lora_params(args.lora_target, args.lora_rank, split.tp) if args.uses_lora else 0
    parts = mem.megatron_train(
        shape,
        split,
        x.plan.parallel.dp,
        x.dtype,
        x.work.train_tokens,
        recompute,
        cfg.use_distributed_optimizer,
        lora // split.pp,
    )
    value_head = x.role.model_args.is_value_model
    if value_head:
        parts["logits"] = 0
    # The old-log-prob (or value) pass holds the same state and one forward's temporaries.
    tokens = x.work.forward_tokens
    forward = {
        "activations": mem.forward_bytes(shape, tokens, split),
        "logits": 0 if value_head else mem.logit_bytes(shape, tokens, split),
    }
    if sum(forward.values()) > parts["activations"] + parts["logits"]:
        parts |= forward
    kept = (
        ("params", cfg.offload_params),
        ("grads", cfg.offload_grads),
        ("optimizer", cfg.offload_optimizer),
    )
    idle = sum(parts[part] for part, offloaded in kept if not offloaded)
    grow = f"{STRATEGY}.tensor_model_parallel_size (more devices in device_mapping)"
    batch = _train_batch_knob(cfg)
    knobs = {
        "params": grow,
        "grads": grow,
        "optimizer": grow if cfg.use_distributed_optimizer else f"{STRATEGY}.use_distributed_optimizer",
        "activations": batch if recompute else f"{STRATEGY}.recompute_granularity",
        "logits": batch,
        "idle": f"{STRATEGY}.offload_params",
    }
    return parts, idle, knobs


def _fsdp2_train(x: RoleInputs) -> Prediction:
    cfg, shape = x.cfg, x.shape
    recompute = not x.role.model_args.disable_gradient_checkpointing
    # HSDP: the state divides by the ranks of one shard group (fsdp_size), not the world size.
    shard_ranks = cfg.shard_size(x.plan.world_size)
    sharded = cfg.sharding == "full_shard" and cfg.fsdp_size != 1
    args = x.role.model_args
    lora = shape.lora_params(args.lora_target, args.lora_rank) if args.uses_lora else 0
    parts = mem.fsdp2_train(
        shape,
        shard_ranks,
        x.dtype,
        x.work.train_tokens,
        recompute,
        sharded,
        cfg.mixed_precision,
        lora,
        ulysses=cfg.ulysses_size,
        ep=cfg.ep_size,
        expert_shards=cfg.expert_fsdp_size(x.plan.world_size) * cfg.ep_size,
    )
    if cfg.cpu_offload:  # shards live in host memory; two gathered layers on the device
        parts |= {"grads": 0, "optimizer": 0}
        parts["params"] = 2 * shape.layer_dense_params() // max(shape.layers, 1) * x.dtype
    batch = _train_batch_knob(cfg)
    knobs = {
        "optimizer": f"{STRATEGY}.cpu_offload",
        "activations": batch if recompute else "model_args.disable_gradient_checkpointing",
        "logits": batch,
    }
    if cfg.fsdp_size is not None:  # larger shard groups (or null: all ranks) hold less per rank
        knobs |= {"params": f"{STRATEGY}.fsdp_size", "grads": f"{STRATEGY}.fsdp_size"}
    return parts, 0, knobs


def _inference(x: RoleInputs, split: mem.Split, kv_copies: int) -> dict[str, int]:
    """Weights plus the larger transient of the role's work: generation for actor_infer (the old
    log-probs come from actor_train), one log-prob forward for the others."""
    dense, expert = mem.rank_params(x.shape, split)
    parts = {"params": (dense + expert) * x.dtype}
    work = x.work
    if x.name == "actor_infer":
        parts |= mem.generation_bytes(x.shape, work.gen_rows, work.prompt, work.seq, split, kv_copies)
        # Model update: two buckets in flight and one converted (fused) copy.
        parts["buffers"] = 3 * x.config.model_update_buffer_size_mb << 20
    else:
        tokens = work.forward_tokens
        parts["activations"] = mem.forward_bytes(x.shape, tokens, split)
        parts["logits"] = mem.logit_bytes(x.shape, tokens, split)
    return parts


INFER_KNOBS = {
    "params": f"{STRATEGY}.tensor_model_parallel_size",
    "buffers": "model_update_buffer_size_mb",
    **{part: "infer_batch_size" for part in ("activations", "logits", "kv_cache")},
}


def _megatron_infer(x: RoleInputs) -> Prediction:
    return _inference(x, _megatron_split(x.cfg, x.shape.layers, tp_only=True), kv_copies=1), 0, INFER_KNOBS


def _hf_infer(x: RoleInputs) -> Prediction:
    parts = _inference(x, mem.Split(), kv_copies=2)
    idle = 0 if x.cfg is None or x.cfg.offload_to_cpu else parts["params"]
    return parts, idle, INFER_KNOBS | {"params": "device_mapping", "idle": f"{STRATEGY}.offload_to_cpu"}


def _engine(x: RoleInputs, fraction: float, knob: str, asleep: bool) -> Prediction:
    """vLLM / SGLang reserve ``fraction`` of the device for weights + KV cache at start."""
    if x.capacity is not None:
        engine = int(fraction * x.capacity)
    else:  # unknown device: the weights and the KV cache this batch needs (a lower bound)
        tp = x.cfg.tensor_parallel_size
        engine = _engine_weights(x) + mem.kv_cache_bytes(x.shape, x.work.gen_rows, x.work.seq, tp)
    return _engine_prediction(engine, knob, asleep)


def _engine_weights(x: RoleInputs) -> int:
    """One engine rank's share of the weights (split by its tensor parallelism)."""
    return x.shape.total_params() * x.dtype // x.cfg.tensor_parallel_size


def _engine_prediction(engine: int, knob: str, asleep: bool) -> Prediction:
    """An engine's bytes while it runs, none while it sleeps, both turned by ``knob``."""
    knobs = {"engine": f"{STRATEGY}.{knob}", "idle": f"{STRATEGY}.{knob}"}
    return {"engine": engine}, 0 if asleep else engine, knobs


# Beside its weights and a KV cache given in bytes, a vLLM engine holds its CUDA graphs, the
# activations of its profile run and the sampler's buffers (the GPU guard checks this figure).
VLLM_FIXED_KV_EXTRA_BYTES = 2 << 30


def _vllm(x: RoleInputs) -> Prediction:
    asleep = x.cfg.sleep_level > 0
    if x.cfg.kv_cache_memory_gb is None:
        return _engine(x, x.cfg.gpu_memory_utilization, "gpu_memory_utilization", asleep)
    engine = _engine_weights(x) + int(x.cfg.kv_cache_memory_gb * 2**30) + VLLM_FIXED_KV_EXTRA_BYTES
    return _engine_prediction(engine, "kv_cache_memory_gb", asleep)


def _sglang(x: RoleInputs) -> Prediction:
    return _engine(x, x.cfg.mem_fraction_static, "mem_fraction_static", x.cfg.enable_memory_saver)


@dataclass(frozen=True)
class MemoryModel:
    """How one kind of strategy uses device memory: its formula and the bytes of its process
    outside the allocator's tensors (``group_context`` when the role has more than one rank and
    so opens communicators, if that differs)."""

    predict: Callable[[RoleInputs], Prediction]
    context: int = CONTEXT_BYTES
    group_context: int | None = None

    def context_bytes(self, world_size: int) -> int:
        if world_size > 1 and self.group_context is not None:
            return self.group_context
        return self.context


# ``StrategySpec.memory_model`` (roll.configs.strategies) -> its memory model.
MEMORY_MODELS: dict[str, MemoryModel] = {
    "megatron_train": MemoryModel(_megatron_train, group_context=MEGATRON_CONTEXT_BYTES),
    "megatron_inference": MemoryModel(_megatron_infer, group_context=MEGATRON_CONTEXT_BYTES),
    "fsdp2_train": MemoryModel(_fsdp2_train),
    "hf_inference": MemoryModel(_hf_infer),
    "vllm_engine": MemoryModel(_vllm, context=0),  # gpu_memory_utilization covers vLLM's whole process
    "sglang_engine": MemoryModel(_sglang),
}
