"""The response-window outputs of one micro-batch under Ulysses sequence parallelism.

Every rank of the group holds the same micro-batch. Its columns (padded rows, or the one packed row
of ``roll.models.packing``) are padded to a multiple of N and split into N equal shards; rank ``r``
runs the model on shard ``r`` with the GLOBAL position ids (RoPE sees where the tokens really are),
and attention exchanges shards over the group (``roll.models.ulysses``). Each rank then scores the
response tokens whose logits column it holds, writes them into a zero ``[B, R]`` tensor, and the
group sums these tensors (forward: all-reduce; backward: the gradient passes to each rank's own
part). So every rank ends with the full log-probs / entropy / values of the micro-batch, the loss
is the unsplit run's on every rank, and each rank's backward computes the gradient of its own
tokens; summed over the group (FSDP's gradient reduction) that is the full gradient.

>>> out = ulysses_log_probs(model, micro, temperature, packed=True, group=sp_group)
>>> out["log_probs"].shape == micro["responses"].shape                              # [B, R], whole rows
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from roll.core.batch import Batch
from roll.models.context_parallel import sum_over_ranks
from roll.models.logprobs import entropy_from_logits, log_probs_from_logits
from roll.models.packing import pack_rows
from roll.models.ulysses import UlyssesBatch, set_ulysses_batch


def _pad_columns(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """``tensor`` [B, S] with zero columns appended up to a multiple of ``multiple``."""
    extra = -tensor.shape[1] % multiple
    return torch.nn.functional.pad(tensor, (0, extra)) if extra else tensor


def _sharded_run(
    model: nn.Module, batch: Batch, packed: bool, group: Any, attention: str, value_model: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this rank's outputs [rows, K(, V)], which (b, t) of the window they score [B, R] bool, the
    index into the outputs' first two dims of each such (b, t)). Logits: only the K local columns
    that score a response token go through the LM head."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = batch["input_ids"].device
    width = batch["responses"].shape[1]
    rows = len(batch)
    if packed:
        row = pack_rows(batch, multiple=size).to(device)
        ids, positions, window = row.input_ids, row.position_ids, row.window
        row_of = torch.zeros(rows, dtype=torch.long, device=device)
        state = UlyssesBatch(group, cu_seqlens=row.cu_seqlens, max_seqlen=row.max_seqlen)
    else:
        ids = _pad_columns(batch["input_ids"], size)
        positions = _pad_columns(batch["position_ids"], size)
        prompt_width = batch["input_ids"].shape[1] - width
        window = (prompt_width - 1 + torch.arange(width, device=device)).expand(rows, width)
        row_of = torch.arange(rows, device=device)
        state = UlyssesBatch(group, key_mask=_pad_columns(batch["attention_mask"], size))
    state.packing_attention = attention
    shard = ids.shape[1] // size
    lo = rank * shard
    own = (window >= lo) & (window < lo + shard)
    set_ulysses_batch(state)
    kwargs: dict[str, Any] = {
        "input_ids": ids[:, lo : lo + shard],
        "position_ids": positions[:, lo : lo + shard],
    }
    if value_model:
        out = model(**kwargs)  # [rows, shard]
        return out, own, (row_of.unsqueeze(1).expand(rows, width)[own], window[own] - lo)
    keep = torch.unique(window[own] - lo)
    logits = model(**kwargs, use_cache=False, logits_to_keep=keep).logits  # [rows, K, V]
    return (
        logits,
        own,
        (row_of.unsqueeze(1).expand(rows, width)[own], torch.searchsorted(keep, window[own] - lo)),
    )


def _gather_window(local: torch.Tensor, own: torch.Tensor, outputs: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, R]: ``local`` (one value per owned (b, t)) in place, zeros elsewhere, summed over the
    group. ``outputs`` joins the graph even where this rank owns no window column, so every rank's
    backward runs through the model (its all-to-alls wait for every rank)."""
    full = torch.zeros(own.shape, dtype=torch.float32, device=own.device)
    full = full.index_put((own.nonzero(as_tuple=True)), local.float()) + 0.0 * outputs.sum()
    return sum_over_ranks(full, group)


def ulysses_log_probs(
    model: nn.Module,
    batch: Batch,
    temperature: float,
    packed: bool,
    group: Any,
    attention: str = "auto",
    with_entropy: bool = True,
) -> dict[str, torch.Tensor]:
    """``roll.models.logprobs.response_log_probs`` of the whole micro-batch, on every rank of the
    Ulysses ``group`` (see the module docstring)."""
    logits, own, (rows, cols) = _sharded_run(model, batch, packed, group, attention, value_model=False)
    scoring = logits[rows, cols]  # [owned, V]
    if temperature > 0 and temperature != 1.0:
        scoring = scoring / temperature
    mask = batch["response_mask"].bool()
    picked = log_probs_from_logits(scoring, batch["responses"][own])
    out = {"log_probs": torch.where(mask, _gather_window(picked, own, logits, group), 0.0)}
    if with_entropy:
        entropy = _gather_window(entropy_from_logits(scoring), own, logits, group)
        out["entropy"] = torch.where(mask, entropy, 0.0)
    return out


def ulysses_values(
    model: nn.Module, batch: Batch, packed: bool, group: Any, attention: str = "auto"
) -> torch.Tensor:
    """``roll.models.value_model.response_values`` of the whole micro-batch, on every rank."""
    values, own, (rows, cols) = _sharded_run(model, batch, packed, group, attention, value_model=True)
    full = _gather_window(values[rows, cols], own, values, group)
    return torch.where(batch["response_mask"].bool(), full, 0.0)
