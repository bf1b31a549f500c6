"""Running a roll Batch through megatron GPT model chunks: packing, the schedule, response log-probs.

Prompts are LEFT-padded and responses RIGHT-padded (see ``roll.distributed.strategy.base``), so a
row's real tokens are one contiguous run. Two layouts:

- packed (``sequence_packing``, the default where exact): each micro-batch's runs concatenated into
  one row (``roll.models.packing``) and handed to megatron as ``qkv_format="thd"``
  ``PackedSeqParams``: RoPE restarts per sequence (megatron's thd path) and the plain-torch spec's
  ``SDPAttention`` confines attention to each sequence (``roll.models.packed_attention``).
- shifted: each row shifted left so its run starts at column 0 (pads end up at the tail): plain
  causal attention is then exact for every real token (no mask, so SDPA's fused causal kernels
  apply), position ids are ``arange``, and RoPE sees the same positions as HF with
  ``position_ids = cumsum(mask) - 1``.

Every micro-batch of a call is padded to the same [rows, seq] so pipeline stages exchange
fixed-shape tensors. The log-prob of ``responses[:, t]`` is read at ``window[i, t]`` of sequence
i's logits row, vocab-parallel (no full-vocab gather), and is 0 where the response is padding.

>>> packed = pack_micro_batches(micro_batches, seq_multiple=8, device=device, packed=True)
>>> losses = run_schedule(model_chunks, packed, make_loss_func, forward_only=False)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from roll.core.batch import Batch
from roll.models.context_parallel import sum_over_ranks, zigzag_indices
from roll.models.megatron.vocab_parallel import exclude_vocab_tokens, vocab_parallel_logprobs_entropy
from roll.models.packing import pack_rows, packed_length


@dataclass
class PackedMicroBatch:
    """One micro-batch as the model sees it, padded to the call's common [rows, seq].

    Shifted layout: one sequence per row (``rows`` = the call's most rows; missing rows repeat row
    0). Packed layout (``packed_seq_params`` set): every sequence in ONE row (see
    ``roll.models.packing``), position ids restarting per sequence.
    """

    input_ids: torch.Tensor  # [rows, seq]
    position_ids: torch.Tensor  # [rows, seq]
    row_index: torch.Tensor  # [B] the row of the logits holding sequence i
    window: torch.Tensor  # [B, R] logits column (in that row) that scores responses[:, t]
    targets: torch.Tensor  # [B, R] the response tokens
    response_mask: torch.Tensor  # [B, R] bool
    batch: Batch  # the caller's micro-batch on the device (given to the loss function)
    packed_seq_params: Any = None  # megatron PackedSeqParams (qkv_format "thd") when packed
    loss_scale: float = 1.0  # what the training loss is multiplied by
    cp_owned: torch.Tensor | None = None  # [B, R] context parallelism: this rank holds window[i, t]
    # Extra model inputs: a vision-language model's images / videos of the rows (and, packed, the
    # whole packed row: packed_vision.py).
    model_kwargs: dict[str, torch.Tensor] = field(default_factory=dict)


def _lengths(batch: Batch) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(P, prompt lengths [B], response mask [B, R]) from input_ids/attention_mask/responses."""
    input_ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    resp_len = batch["responses"].shape[1]
    prompt_cols = input_ids.shape[1] - resp_len
    return prompt_cols, mask[:, :prompt_cols].sum(1), mask[:, prompt_cols:]


def packed_seq_len(batches: list[Batch], seq_multiple: int) -> int:
    """The common sequence length of the shifted layout: the longest real row, rounded up."""
    longest = max(int(b["attention_mask"].sum(1).max()) for b in batches)
    return max(seq_multiple, math.ceil(longest / seq_multiple) * seq_multiple)


def _shift_one(batch: Batch, seq_len: int, rows: int, device: torch.device) -> PackedMicroBatch:
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
    filled = torch.cat([ids, ids[pad]]) if pad else ids
    return PackedMicroBatch(
        input_ids=filled.to(device),
        position_ids=torch.arange(seq_len).expand(rows, seq_len).contiguous().to(device),
        row_index=torch.arange(n, device=device),
        window=window.to(device),
        targets=batch["responses"].to(device),
        response_mask=resp_mask.to(device),
        batch=batch.to(device),
        model_kwargs=_vision_inputs(batch, pad, device),
    )


def _vision_inputs(batch: Batch, filler_rows: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """The rows' images and videos (``roll.models.vision.MULTI_MODAL_INPUTS``), filler rows'
    included (they repeat a row of the batch, vision tokens and all); {} for rows without them."""
    from roll.models.vision import MULTI_MODAL_INPUTS, forward_kwargs

    if MULTI_MODAL_INPUTS not in batch:
        return {}
    rows = list(batch[MULTI_MODAL_INPUTS])
    return forward_kwargs({MULTI_MODAL_INPUTS: rows + [rows[i] for i in filler_rows]}, device)


def _pack_one(
    batch: Batch, seq_len: int, device: torch.device, cp_size: int, cp_rank: int
) -> PackedMicroBatch:
    from megatron.core.packed_seq_params import PackedSeqParams

    row = pack_rows(batch, length=seq_len, segment_multiple=2 * cp_size if cp_size > 1 else 1)
    input_ids, position_ids, window, owned = row.input_ids, row.position_ids, row.window, None
    if cp_size > 1:  # this rank's zig-zag share; the window points into it where it holds the column
        local = zigzag_indices(row.cu_seqlens, cp_size, cp_rank)
        where = torch.full((seq_len,), -1, dtype=torch.long)
        where[local] = torch.arange(len(local))
        input_ids, position_ids = input_ids[:, local], position_ids[:, local]
        owned, window = (where[window] >= 0).to(device), where[window].clamp(min=0)
    vision = _vision_inputs(batch, [], device)
    if vision:  # the whole row: a vision-language model's positions and features (packed_vision.py)
        vision["packed_input_ids"] = row.input_ids.to(device)
    cu_seqlens = row.cu_seqlens.to(device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=row.max_seqlen,
        max_seqlen_kv=row.max_seqlen,
    )
    return PackedMicroBatch(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        row_index=torch.zeros(len(batch), dtype=torch.long, device=device),
        window=window.to(device),
        targets=batch["responses"].to(device),
        response_mask=_lengths(batch)[2].to(device),
        batch=batch.to(device),
        packed_seq_params=params,
        cp_owned=owned,
        model_kwargs=vision,
    )


def _context_parallel() -> tuple[int, int]:
    """(CP size, CP rank); (1, 0) outside megatron's parallel state."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()


def pack_micro_batches(
    batches: list[Batch],
    seq_multiple: int,
    device: torch.device,
    sync_group: Any = None,
    packed: bool = False,
) -> list[PackedMicroBatch]:
    """Every micro-batch in the shifted layout padded to a common [max rows, seq], or (``packed``)
    packed into one row each, padded to a common length (see the module docstring).

    ``sync_group``: ranks that must run identical shapes (expert-parallel MoE layers all-gather
    tokens across data-parallel ranks): the shape is agreed on by all-reduce, and the number of
    micro-batches must match.
    """
    if not batches:
        raise ValueError("no micro-batches to run")
    cp_size, cp_rank = _context_parallel() if packed else (1, 0)
    if packed:  # under CP every sequence splits into 2 x CP chunks and each rank's share into seq_multiple
        segment = 2 * cp_size if cp_size > 1 else 1
        seq_len, rows = packed_length(batches, seq_multiple * cp_size, segment), 1
    else:
        seq_len, rows = packed_seq_len(batches, seq_multiple), max(len(b) for b in batches)
    if sync_group is not None and dist.get_world_size(sync_group) > 1:
        sizes = torch.tensor([seq_len, rows, len(batches), -len(batches)], device=device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=sync_group)
        seq_len, rows = int(sizes[0]), int(sizes[1])
        if int(sizes[2]) != -int(sizes[3]):
            raise ValueError(
                f"expert-parallel ranks got {-int(sizes[3])}..{int(sizes[2])} micro-batches; "
                "every data-parallel rank of an MoE model must run the same number"
            )
    if packed:
        return [_pack_one(b, seq_len, device, cp_size, cp_rank) for b in batches]
    return [_shift_one(b, seq_len, rows, device) for b in batches]


def packing_enabled(megatron_cfg: Any, padded_only: bool = False) -> bool:
    """``sequence_packing``, or when null: on where something needs it (context parallelism, which
    runs on packed rows only, or a token budget) and the attention path is exact with it (the
    plain-torch spec with SDPA core attention); padded rows otherwise. On an H200 at the
    Qwen2.5-1.5B shape padded rows were as fast as packed ones on a ragged RL batch and 9% faster
    on full-length rows (benchmarks/packing.py, docs/packing.md): packing saves memory, not time,
    at RL response lengths. A model whose forward takes padded rows only (``padded_only``: a
    vision-language family without ``Family.packed_vision``) always runs on padded rows."""
    from roll.models.megatron.layer_spec import HAVE_TE

    if padded_only:  # the pre-launch check refuses sequence_packing: true and CP for it
        return False
    if megatron_cfg.sequence_packing is not None:
        return bool(megatron_cfg.sequence_packing)
    needed = megatron_cfg.context_parallel_size > 1 or any(
        budget is not None
        for budget in (megatron_cfg.max_tokens_per_microbatch, megatron_cfg.infer_max_tokens_per_microbatch)
    )
    return needed and megatron_cfg.attention_backend == "sdpa" and not HAVE_TE


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
    excluded: Sequence[int] = (),
) -> dict[str, torch.Tensor]:
    """{"log_probs", "entropy"} [B, R] from this rank's vocab shard of ``logits``
    [rows, seq, V/tp]; ``vocab_size`` (the HF one) leaves megatron's vocab padding out, and the
    ``excluded`` token ids get zero probability (a vision-language model's vision tokens)."""
    window_logits = logits[packed.row_index.unsqueeze(1), packed.window]  # [B, R, V/tp]
    window_logits = exclude_vocab_tokens(window_logits, excluded, tp_group)
    log_probs, entropy = vocab_parallel_logprobs_entropy(
        window_logits, packed.targets, tp_group, temperature, vocab_size
    )
    mask = packed.response_mask
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    if packed.cp_owned is None:
        return {"log_probs": torch.where(mask, log_probs, zero), "entropy": torch.where(mask, entropy, zero)}
    from megatron.core import parallel_state as ps

    mask, group = mask & packed.cp_owned, ps.get_context_parallel_group()
    return {
        "log_probs": sum_over_ranks(torch.where(mask, log_probs, zero), group),
        "entropy": sum_over_ranks(torch.where(mask, entropy, zero), group),
    }


def _forward_step(loss_maker: Callable, data_iterator, model):
    packed: PackedMicroBatch = next(data_iterator)
    output = model(
        packed.input_ids,
        packed.position_ids,
        None,
        packed_seq_params=packed.packed_seq_params,
        **packed.model_kwargs,
    )
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
