"""Predicted peak device memory of one rank of each role, from its strategy options and the run's
batch sizes (formulas in roll.planner.memory).

    role = role_memory("actor_train", config.actor_train, config, plan.roles["actor_train"], shape,
                       capacity=80 * GIB, colocated=True)
    role.peak, role.idle, role.knob_for(role.largest())
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RoleConfig
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
    forward_rows: int  # per log-prob forward call
    gen_rows: int  # sequences generating at once


def workload(config: RLVRConfig, role: RoleConfig, dp: int) -> Workload:
    seq = config.prompt_length + config.response_length
    n = max(role.generating_args.num_return_sequences, 1)
    prompts = -(-config.rollout_batch_size // max(dp, 1))
    samples = -(-config.rollout_batch_size * config.num_return_sequences_in_group // max(dp, 1))
    return Workload(
        seq=seq,
        prompt=config.prompt_length,
        train_tokens=role.training_args.per_device_train_batch_size * seq,
        forward_rows=min(role.infer_batch_size, samples),
        gen_rows=min(role.infer_batch_size, prompts) * n,
    )


def role_memory(
    name: str,
    role: RoleConfig,
    config: RLVRConfig,
    plan: RolePlan,
    shape: ModelShape,
    capacity: int | None,
    colocated: bool,
) -> RoleMemory:
    """The prediction for one rank of ``name`` (strategies without a formula raise KeyError)."""
    strategy = role.strategy_args.strategy_name if role.strategy_args else "hf_infer"
    cfg = role.strategy_args.config if role.strategy_args else None
    work = workload(config, role, plan.parallel.dp)
    dtype = DTYPE_BYTES.get(role.model_args.dtype, 2)
    build = BUILDERS[strategy]
    parts, idle, knobs = build(name, role, cfg, config, plan, shape, work, dtype, capacity)
    context = CONTEXT_BYTES
    if strategy.startswith("megatron") and plan.world_size > 1:  # one rank opens no communicators
        context = MEGATRON_CONTEXT_BYTES
    elif strategy == "vllm":
        context = 0  # gpu_memory_utilization covers vLLM's whole process
    if not colocated:
        idle = sum(parts.values())
    return RoleMemory(name, strategy, parts, idle, context, knobs)


def _megatron_split(cfg, tp_only: bool = False) -> mem.Split:
    tp = cfg.tensor_model_parallel_size
    return mem.Split(
        tp=tp,
        pp=cfg.pipeline_model_parallel_size,
        ep=cfg.expert_model_parallel_size,
        etp=cfg.expert_tensor_parallel_size or tp,
        cp=cfg.context_parallel_size,
        sequence_parallel=cfg.sequence_parallel and not tp_only,
        vocab_multiple=cfg.make_vocab_size_divisible_by,
    )


def _megatron_train(name, role, cfg, config, plan, shape, work, dtype, capacity):
    split = _megatron_split(cfg)
    recompute = cfg.recompute_granularity == "full"
    parts = mem.megatron_train(
        shape, split, plan.parallel.dp, dtype, work.train_tokens, recompute, cfg.use_distributed_optimizer
    )
    value_head = role.model_args.is_value_model
    if value_head:
        parts["logits"] = 0
    # The old-log-prob (or value) pass holds the same state and one forward's temporaries.
    tokens = work.forward_rows * work.seq
    forward = {
        "activations": mem.forward_bytes(shape, tokens, split),
        "logits": 0 if value_head else mem.logit_bytes(shape, tokens, split),
    }
    if sum(forward.values()) > parts["activations"] + parts["logits"]:
        parts |= forward
    idle = sum(
        parts[part]
        for part, off in (
            ("params", cfg.offload_params),
            ("grads", cfg.offload_grads),
            ("optimizer", cfg.offload_optimizer),
        )
        if not off
    )
    grow = "tensor_model_parallel_size (more devices in device_mapping)"
    knobs = {
        "params": f"{STRATEGY}.{grow}",
        "grads": f"{STRATEGY}.{grow}",
        "optimizer": f"{STRATEGY}.use_distributed_optimizer"
        if not cfg.use_distributed_optimizer
        else f"{STRATEGY}.{grow}",
        "activations": f"{STRATEGY}.recompute_granularity"
        if not recompute
        else "training_args.per_device_train_batch_size",
        "logits": "training_args.per_device_train_batch_size",
        "idle": f"{STRATEGY}.offload_params",
    }
    return parts, idle, knobs


def _fsdp2_train(name, role, cfg, config, plan, shape, work, dtype, capacity):
    recompute = not role.model_args.disable_gradient_checkpointing
    parts = mem.fsdp2_train(
        shape,
        plan.world_size,
        dtype,
        work.train_tokens,
        recompute,
        cfg.sharding == "full_shard",
        cfg.mixed_precision,
    )
    if cfg.cpu_offload:
        for part in ("grads", "optimizer"):
            parts[part] = 0
        parts["params"] = 2 * shape.layer_dense_params() // max(shape.layers, 1) * dtype
    knobs = {
        "params": "device_mapping",
        "grads": "device_mapping",
        "optimizer": f"{STRATEGY}.cpu_offload",
        "activations": "model_args.disable_gradient_checkpointing"
        if not recompute
        else "training_args.per_device_train_batch_size",
        "logits": "training_args.per_device_train_batch_size",
    }
    return parts, 0, knobs


def _inference(name, role, shape, work, split, dtype, config, kv_copies):
    dense, expert = mem.rank_params(shape, split)
    parts = {"params": (dense + expert) * dtype}
    if name == "actor_infer":  # generates; the old log-probs come from actor_train
        forward = mem.generation_bytes(shape, work.gen_rows, work.prompt, work.seq, split, kv_copies)
        # Model update: two buckets in flight and one converted (fused) copy.
        parts["buffers"] = 3 * config.model_update_buffer_size_mb << 20
    else:
        tokens = work.forward_rows * work.seq
        forward = {
            "activations": mem.forward_bytes(shape, tokens, split),
            "logits": mem.logit_bytes(shape, tokens, split),
        }
    parts.update(forward)
    knobs = {"params": f"{STRATEGY}.tensor_model_parallel_size", "buffers": "model_update_buffer_size_mb"}
    knobs |= {part: "infer_batch_size" for part in ("activations", "logits", "kv_cache")}
    return parts, knobs


def _megatron_infer(name, role, cfg, config, plan, shape, work, dtype, capacity):
    parts, knobs = _inference(name, role, shape, work, _megatron_split(cfg, tp_only=True), dtype, config, 1)
    knobs["buffers"] = "model_update_buffer_size_mb"
    return parts, 0, {k: v for k, v in knobs.items()}


def _hf_infer(name, role, cfg, config, plan, shape, work, dtype, capacity):
    parts, knobs = _inference(name, role, shape, work, mem.Split(), dtype, config, 2)
    knobs["params"] = "device_mapping"
    idle = 0 if cfg is None or cfg.offload_to_cpu else parts["params"]
    return parts, idle, knobs


def _engine(name, role, cfg, config, plan, shape, work, dtype, capacity, fraction, knob, asleep):
    """vLLM / SGLang reserve ``fraction`` of the device for weights + KV cache at start."""
    tp = cfg.tensor_parallel_size
    if capacity is not None:
        engine = int(fraction * capacity)
    else:  # unknown device: the weights and the KV cache this batch needs (a lower bound)
        weights = shape.total_params() * dtype // tp
        engine = weights + mem.kv_cache_bytes(shape, work.gen_rows, work.seq, tp)
    parts = {"engine": engine}
    return parts, 0 if asleep else engine, {"engine": f"{STRATEGY}.{knob}", "idle": f"{STRATEGY}.{knob}"}


def _vllm(name, role, cfg, config, plan, shape, work, dtype, capacity):
    return _engine(
        name,
        role,
        cfg,
        config,
        plan,
        shape,
        work,
        dtype,
        capacity,
        cfg.gpu_memory_utilization,
        "gpu_memory_utilization",
        cfg.sleep_level > 0,
    )


def _sglang(name, role, cfg, config, plan, shape, work, dtype, capacity):
    return _engine(
        name,
        role,
        cfg,
        config,
        plan,
        shape,
        work,
        dtype,
        capacity,
        cfg.mem_fraction_static,
        "mem_fraction_static",
        cfg.enable_memory_saver,
    )


BUILDERS = {
    "megatron_train": _megatron_train,
    "megatron_infer": _megatron_infer,
    "fsdp2_train": _fsdp2_train,
    "hf_infer": _hf_infer,
    "vllm": _vllm,
    "sglang": _sglang,
}
