"""Running a roll Batch through megatron GPT model chunks: packing, the schedule, response log-probs.

Prompts are LEFT-padded and responses RIGHT-padded (see ``roll.distributed.strategy.base``), so a
row's real tokens are one contiguous run. ``pack_micro_batches`` shifts each row left so that run
starts at column 0 (pads end up at the tail): plain causal attention is then exact for every real
token (no mask, so SDPA's fused causal kernels apply), position ids are ``arange``, and RoPE sees
the same positions as HF with ``position_ids = cumsum(mask) - 1``. Every micro-batch of a call is
padded to the same [rows, seq] so pipeline stages exchange fixed-shape tensors.

The log-prob of ``responses[:, t]`` is read at column ``prompt_len - 1 + t`` of the logits,
vocab-parallel (no full-vocab gather), and is 0 where ``response_mask`` is 0.

>>> packed = pack_micro_batches(micro_batches, seq_multiple=8, device=device)
>>> losses = run_schedule(model_chunks, packed, make_loss_func, forward_only=False)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from roll.distributed.scheduler.batch import Batch
from roll.models.megatron.vocab_parallel import vocab_parallel_logprobs_entropy


@dataclass
class PackedMicroBatch:
    """One micro-batch in the shifted layout, padded to the call's common [rows, seq]."""

    input_ids: torch.Tensor  # [rows, seq]
    position_ids: torch.Tensor  # [rows, seq]
    window: torch.Tensor  # [rows, R] logits column that scores responses[:, t]
    targets: torch.Tensor  # [rows, R] the response tokens
    response_mask: torch.Tensor  # [rows, R] bool
    num_rows: int  # real rows (the rest repeat row 0 and are dropped)
    batch: Batch  # the caller's micro-batch on the device (given to the loss function)


def _lengths(batch: Batch) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(P, prompt lengths [B], response mask [B, R]) from input_ids/attention_mask/responses."""
    input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    resp_len = batch["responses"].shape[1]
    prompt_cols = input_ids.shape[1] - resp_len
    return prompt_cols, mask[:, :prompt_cols].sum(1), mask[:, prompt_cols:]


def packed_seq_len(batches: list[Batch], seq_multiple: int) -> int:
    """The common sequence length: the longest real row, rounded up to ``seq_multiple``."""
    longest = max(int(b["attention_mask"].sum(1).max()) for b in batches)
    return max(seq_multiple, math.ceil(longest / seq_multiple) * seq_multiple)


def _pack_one(batch: Batch, seq_len: int, rows: int, device: torch.device) -> PackedMicroBatch:
    prompt_cols, prompt_len, resp_mask = _lengths(batch)
    input_ids = batch["input_ids"]
    shift = (prompt_cols - prompt_len).unsqueeze(1)
    total = input_ids.shape[1]
    cols = torch.arange(seq_len).unsqueeze(0) + shift
    ids = input_ids.gather(1, cols.clamp(max=total - 1))
    ids = torch.where(cols < total, ids, torch.zeros_like(ids))
    resp_len = resp_mask.shape[1]
    window = (prompt_len.unsqueeze(1) - 1 + torch.arange(resp_len).unsqueeze(0)).clamp(0, seq_len - 1)
    n = len(batch)
    pad = [0] * (rows - n)

    def fill(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[pad]]) if pad else t

    return PackedMicroBatch(
        input_ids=fill(ids).to(device),
        position_ids=torch.arange(seq_len).expand(rows, seq_len).contiguous().to(device),
        window=fill(window).to(device),
        targets=fill(batch["responses"]).to(device),
        response_mask=fill(resp_mask).to(device),
        num_rows=n,
        batch=batch.to(device),
    )


def pack_micro_batches(
    batches: list[Batch], seq_multiple: int, device: torch.device, sync_group: Any = None
) -> list[PackedMicroBatch]:
    """Shift and pad every micro-batch to a common [max rows, seq] (see the module docstring).

    ``sync_group``: ranks that must run identical shapes (expert-parallel MoE layers all-gather
    tokens across data-parallel ranks): the shape is agreed on by all-reduce, and the number of
    micro-batches must match.
    """
    if not batches:
        raise ValueError("no micro-batches to run")
    seq_len = packed_seq_len(batches, seq_multiple)
    rows = max(len(b) for b in batches)
    if sync_group is not None and dist.get_world_size(sync_group) > 1:
        sizes = torch.tensor([seq_len, rows, len(batches), -len(batches)], device=device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=sync_group)
        seq_len, rows = int(sizes[0]), int(sizes[1])
        if int(sizes[2]) != -int(sizes[3]):
            raise ValueError(
                f"expert-parallel ranks got {-int(sizes[3])}..{int(sizes[2])} micro-batches; "
                "every data-parallel rank of an MoE model must run the same number"
            )
    return [_pack_one(b, seq_len, rows, device) for b in batches]


def shape_sync_group(megatron_cfg: Any) -> Any:
    """The group whose ranks must agree on micro-batch shapes (None when they need not)."""
    from megatron.core import parallel_state as ps

    if megatron_cfg.expert_model_parallel_size > 1:
        return ps.get_data_parallel_group()
    return None


def response_logprobs(
    logits: torch.Tensor,
    packed: PackedMicroBatch,
    tp_group: Any,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """{"log_probs", "entropy"} [num_rows, R] from this rank's vocab shard of ``logits``
    [rows, seq, V/tp]; ``vocab_size`` (the HF one) leaves megatron's vocab padding out."""
    vocab = logits.shape[-1]
    index = packed.window.unsqueeze(-1).expand(-1, -1, vocab)
    window_logits = logits.gather(1, index)  # [rows, R, V/tp]
    log_probs, entropy = vocab_parallel_logprobs_entropy(
        window_logits, packed.targets, tp_group, temperature, vocab_size
    )
    mask = packed.response_mask
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    n = packed.num_rows
    return {
        "log_probs": torch.where(mask, log_probs, zero)[:n],
        "entropy": torch.where(mask, entropy, zero)[:n],
    }


def _forward_step(loss_maker: Callable, data_iterator, model):
    packed: PackedMicroBatch = next(data_iterator)
    output = model(packed.input_ids, packed.position_ids, None)
    return output, partial(loss_maker, packed)


def run_schedule(
    model_chunks: list[torch.nn.Module],
    packed: list[PackedMicroBatch],
    loss_maker: Callable[[PackedMicroBatch, torch.Tensor], tuple[torch.Tensor, dict]],
    forward_only: bool,
) -> list[dict]:
    """Forward (and backward) every micro-batch through megatron's pipeline schedule.

    ``loss_maker(packed_mb, logits)`` runs on the last stage and returns (loss, payload); the
    payloads come back in micro-batch order on the last stage ([] elsewhere).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq_len = packed[0].input_ids.shape[1]
    rows = packed[0].input_ids.shape[0]
    iterators = [iter(packed) for _ in model_chunks]
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_maker),
        data_iterator=iterators if len(model_chunks) > 1 else iterators[0],
        model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
        num_microbatches=len(packed),
        seq_length=seq_len,
        micro_batch_size=rows,
        forward_only=forward_only,
    )


def seq_multiple_for(megatron_cfg: Any) -> int:
    """Sequence padding: a multiple of 8 (kernel-friendly), times TP under sequence parallelism."""
    tp = megatron_cfg.tensor_model_parallel_size
    return 8 * tp if megatron_cfg.sequence_parallel else 8


def split_for_pipeline(batch: Batch, micro_batch_size: int, min_micro_batches: int) -> list[Batch]:
    """Inference micro-batches of ``micro_batch_size`` rows, at least ``min_micro_batches`` of them
    when the batch allows (interleaved pipelines need >= PP micro-batches)."""
    size = max(1, micro_batch_size)
    if math.ceil(len(batch) / size) < min_micro_batches:
        size = max(1, math.ceil(len(batch) / min_micro_batches))
    return batch.split(size)
