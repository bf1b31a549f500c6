"""Expert parallelism for the MoE blocks of an HF model (fsdp2_train's ``ep_size``).

Each group of ``ep_size`` ranks (an EP group) splits the experts of every MoE layer: EP rank p keeps
experts ``p * E/N .. (p + 1) * E/N - 1`` (E experts, N = ep_size). The router stays whole on every
rank; the experts module's forward is replaced (the model itself is transformers' as loaded) by one
that sends each (token, chosen expert) row to the rank owning that expert (``all_to_all_single``
with split sizes), runs the local experts on what arrives, sends the outputs back and sums them
per token weighted by the router's probabilities, in the order the unsplit module adds them.

>>> experts = moe_experts(model)                    # the fused-experts modules (Qwen3-MoE)
>>> shard_experts(experts, ep_rank, ep_size, group)  # keep this rank's slice, swap the forward
>>> full = gather_experts(local_slice, group)         # the [E, ...] tensor again (weight export)

Backward: the all-to-alls are autograd functions, so a rank's expert gradients are the sum over
every token of its EP group that chose them; the strategy scales them to the unsplit model's
(``roll.distributed.strategy.fsdp2_experts``).
"""

from __future__ import annotations

import types
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from roll.configs.errors import ConfigError

# The fused expert weights of transformers' MoE experts modules ([E, 2I, H] and [E, H, I]).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def moe_experts(model: nn.Module) -> list[nn.Module]:
    """The experts modules of ``model``: those holding ``num_experts`` and the fused 3-D expert
    weights (transformers 5's Qwen3-MoE layout); empty for a dense model."""
    found = []
    for module in model.modules():
        params = [getattr(module, name, None) for name in EXPERT_PARAMS]
        if hasattr(module, "num_experts") and all(
            isinstance(p, nn.Parameter) and p.dim() == 3 for p in params
        ):
            found.append(module)
    return found


def check_experts(num_experts: int | None, ep_size: int, path: str) -> None:
    """``ep_size`` against a model's experts per MoE layer (None or 0: a dense model)."""
    if not num_experts:
        raise ConfigError(
            path, f"{ep_size} splits the experts of an MoE model; this model is dense (set ep_size: 1)"
        )
    if num_experts % ep_size:
        raise ConfigError(path, f"{ep_size} does not divide the model's {num_experts} experts")


def config_experts(config: Any) -> int | None:
    """The experts per MoE layer an HF config names (Qwen3-MoE: num_experts; Mixtral-style:
    num_local_experts), None for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)


def shard_experts(experts: list[nn.Module], ep_rank: int, ep_size: int, group: dist.ProcessGroup) -> None:
    """Keep EP rank ``ep_rank``'s slice of every experts module's weights (before sharding with
    FSDP2) and route its forward through ``group``. ``num_experts`` must divide by ``ep_size``."""
    for module in experts:
        local = module.num_experts // ep_size
        rows = slice(ep_rank * local, (ep_rank + 1) * local)
        for name in EXPERT_PARAMS:
            full = getattr(module, name)
            setattr(module, name, nn.Parameter(full.detach()[rows].clone(), requires_grad=full.requires_grad))
        module.forward = types.MethodType(partial(_ep_forward, ep_size=ep_size, group=group), module)


def _ep_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    ep_size: int,
    group: dist.ProcessGroup,
) -> torch.Tensor:
    """The unsplit experts forward's result ([T, H]) with this rank holding E / ep_size experts."""
    top_k = top_k_index.shape[-1]
    local = module.gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) rows grouped by expert, tokens ascending
    send_counts = torch.bincount(flat, minlength=local * ep_size).view(ep_size, local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    routed = hidden_states[order // top_k]
    received = _all_to_all(routed, recv_splits, send_splits, group)
    # Received rows: from each source rank, its rows for local expert 0, then 1, ...
    expert_of_row = torch.arange(local, device=flat.device).repeat(ep_size)
    expert_of_row = torch.repeat_interleave(expert_of_row, recv_counts.reshape(-1))
    outputs = _run_local_experts(module, received, expert_of_row, local)
    back = _all_to_all(outputs, send_splits, recv_splits, group)
    weights = top_k_weights.reshape(-1)[order]
    contributions = (back * weights[:, None]).to(hidden_states.dtype)
    return torch.zeros_like(hidden_states).index_add(0, order // top_k, contributions)


def _run_local_experts(
    module: nn.Module, rows: torch.Tensor, expert_of_row: torch.Tensor, local: int
) -> torch.Tensor:
    """Each row through its local expert (the unsplit module's ops: gate/up, act * up, down). An
    expert without rows still runs (on none): its weights then get a zero gradient, so every rank
    of the slice's FSDP group has one to reduce-scatter, as the unsplit fused weights always do."""
    by_expert = torch.argsort(expert_of_row, stable=True)
    counts = torch.bincount(expert_of_row, minlength=local).tolist()
    pieces = []
    for index, chunk in enumerate(torch.split(rows[by_expert], counts)):
        gate, up = nn.functional.linear(chunk, module.gate_up_proj[index]).chunk(2, dim=-1)
        pieces.append(nn.functional.linear(module.act_fn(gate) * up, module.down_proj[index]))
    return torch.cat(pieces)[torch.argsort(by_expert)]


def _all_to_all(
    rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Rows exchanged within ``group`` (``in_splits`` sent to each rank, ``out_splits`` received);
    differentiable (the backward sends the gradients the other way)."""
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    return dist_fn.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)


def gather_experts(local_slice: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All EP ranks' slices ([E/N, ...] each) stacked in rank order: the full [E, ...] tensor."""
    ranks = dist.get_world_size(group)
    out = local_slice.new_empty((ranks * local_slice.shape[0], *local_slice.shape[1:]))
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(out, local_slice.contiguous(), group=group)
    return out
