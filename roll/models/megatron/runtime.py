"""What both megatron strategies share: building the model chunks of one rank, forward-only
log-probs through the pipeline schedule, and moving plain parameters off and back onto the GPU.

>>> hf_config, chunks = build_chunks(role_config, ctx, megatron_cfg)     # weights loaded from HF
>>> out = forward_log_probs(chunks, batch, megatron_cfg, hf_config.vocab_size, micro_batch_size=4)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from roll.configs.role import RoleConfig
from roll.configs.strategy_configs import MegatronConfig
from roll.core.batch import Batch
from roll.core.worker_context import WorkerContext
from roll.models.logprobs import batch_temperature
from roll.models.megatron import thd_rope
from roll.models.megatron.families import padded_rows_only
from roll.models.megatron.forward import (
    PackedMicroBatch,
    pack_micro_batches,
    packing_enabled,
    response_logprobs,
    run_schedule,
    seq_multiple_for,
    shape_sync_group,
    split_for_pipeline,
)
from roll.models.megatron.parallel import broadcast_from_last_stage, init_parallel
from roll.models.microbatch import invert, split_by_tokens
from roll.models.vision import response_excluded_tokens
from roll.utils.start_marks import init_span

logger = logging.getLogger("roll")


def build_chunks(
    role_config: RoleConfig, ctx: WorkerContext, cfg: MegatronConfig, hf_config: Any = None
) -> tuple[Any, list[torch.nn.Module]]:
    """Parallel state + this rank's GPTModel chunks (one per virtual pipeline stage) with the
    weights of ``model_name_or_path`` (or of ``cfg.mcore_checkpoint``, a converted dist checkpoint); or, given ``hf_config`` (benchmarks), that architecture with
    random weights."""
    from transformers import AutoConfig

    from roll.models.loading import model_path, torch_dtype
    from roll.models.megatron.model_builder import build_model_chunks

    with init_span("megatron.parallel_groups"):
        init_parallel(ctx, cfg)
    if not thd_rope.install():
        logger.warning(
            "megatron-core's thd RoPE has an unknown signature: packed rows keep its per-sequence loop"
        )
    dtype = torch_dtype(role_config.model_args.dtype)
    if hf_config is not None:
        chunks = build_model_chunks(hf_config, cfg, dtype)
        _to_device(chunks, ctx)
        init_random_weights(chunks)
        return hf_config, chunks
    path = model_path(role_config.model_args)
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=role_config.model_args.trust_remote_code)
    with init_span("megatron.build"):
        chunks = build_model_chunks(hf_config, cfg, dtype)  # layer spec: layer_spec.build_layer_spec
    with init_span("megatron.load"):
        _load_weights(chunks, cfg, hf_config, path)
    with init_span("megatron.to_device"):
        _to_device(chunks, ctx)
    return hf_config, chunks


def _load_weights(chunks: list[torch.nn.Module], cfg: MegatronConfig, hf_config: Any, path: str) -> None:
    """The weights of ``cfg.mcore_checkpoint`` (a converted dist checkpoint) or of the HF
    checkpoint at ``path``."""
    from roll.models.megatron.hf_io import load_hf_weights

    if cfg.mcore_checkpoint:
        from roll.models.megatron.mcore_checkpoint import check_compatible, load_mcore_weights

        check_compatible(
            cfg.mcore_checkpoint, hf_config, cfg, "strategy_args.strategy_config.mcore_checkpoint"
        )
        load_mcore_weights(chunks, cfg.mcore_checkpoint)
    else:
        load_hf_weights(chunks, path)


def _to_device(chunks: list[torch.nn.Module], ctx: WorkerContext) -> None:
    """megatron builds some parameters on CPU whatever the device (the MoE router's weight, moved
    lazily by its own forward): put all of them on the worker's GPU before DDP/optimizer see them."""
    if ctx.is_cuda:
        move_params(chunks, torch.device("cuda", torch.cuda.current_device()))


@torch.no_grad()
def init_random_weights(chunks: list[torch.nn.Module], std: float = 0.02) -> None:
    """Norm weights 1 (0 for a norm that stores its offset from 1, Qwen3-Next's), biases 0,
    everything else N(0, std) (the builder leaves params uninitialised)."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if param.dim() == 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                param.normal_(0.0, std)
        for module in chunk.modules():
            if getattr(module, "zero_centered_gamma", False):
                module.weight.zero_()


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


@torch.no_grad()
def forward_log_probs(
    chunks: list[torch.nn.Module],
    batch: Batch,
    cfg: MegatronConfig,
    vocab_size: int,
    micro_batch_size: int,
    hf_config: Any = None,
) -> dict[str, torch.Tensor]:
    """{"log_probs", "entropy"} [B, R] (CPU, fp32) at the batch's temperature, on every rank.

    Micro-batches of ``micro_batch_size`` rows, or formed by ``infer_max_tokens_per_microbatch``
    tokens when set; packed rows when ``packing_enabled`` (``hf_config`` tells a vision-language
    model: its rows carry their images and videos, ``forward.PackedMicroBatch.model_kwargs``, some
    families run padded rows only, ``families.padded_rows_only``, and its vision tokens get zero
    probability, ``forward.response_logprobs``)."""
    from megatron.core import parallel_state as ps

    padded_only = hf_config is not None and padded_rows_only(hf_config)
    excluded = response_excluded_tokens(hf_config) if hf_config is not None else []

    temperature = batch_temperature(batch)
    min_count = ps.get_pipeline_model_parallel_world_size() if len(chunks) > 1 else 1
    order = None
    if cfg.infer_max_tokens_per_microbatch is not None:
        budget = cfg.infer_max_tokens_per_microbatch
        micro, order = split_by_tokens(batch, budget, shape_sync_group(cfg), min_count)
    else:
        micro = split_for_pipeline(batch, micro_batch_size, min_count)
    packed = pack_micro_batches(
        micro,
        seq_multiple_for(cfg),
        _device(),
        shape_sync_group(cfg),
        packed=packing_enabled(cfg, padded_only),
    )
    tp_group = ps.get_tensor_model_parallel_group()

    def loss_maker(mb: PackedMicroBatch, logits: torch.Tensor):
        out = response_logprobs(logits, mb, tp_group, temperature, vocab_size, excluded)
        return torch.zeros((), device=logits.device), out

    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        payloads = run_schedule(chunks, packed, loss_maker, forward_only=True)
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)
    shape = tuple(batch["responses"].shape)
    result = None
    if payloads:
        result = {k: torch.cat([p[k] for p in payloads]) for k in ("log_probs", "entropy")}
        if order is not None:
            back = invert(order).to(result["log_probs"].device)
            result = {k: v[back] for k, v in result.items()}
    result = broadcast_from_last_stage(result, {k: (shape, torch.float32) for k in ("log_probs", "entropy")})
    return {k: v.float().cpu() for k, v in result.items()}


def broadcast_metrics(metrics: dict[str, float] | None) -> dict[str, float]:
    """Metrics computed on the last pipeline stage, given to every stage of the PP group."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return metrics or {}
    box = [metrics]
    dist.broadcast_object_list(
        box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
    )
    return box[0] or {}


def move_params(chunks: list[torch.nn.Module], device: torch.device | str) -> None:
    """Move every parameter's data (and buffer) of plain (un-wrapped) chunks to ``device``."""
    for chunk in chunks:
        for tensor in list(chunk.parameters()) + list(chunk.buffers()):
            if tensor.device.type != torch.device(device).type:
                tensor.data = tensor.data.to(device, non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
