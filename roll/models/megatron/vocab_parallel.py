"""Log-probs and entropy from vocab-parallel logits, without gathering the full vocabulary.

With tensor parallelism megatron's output layer leaves each TP rank with ``V / tp`` columns of the
logits. The softmax statistics are combined with three small all-reduces over the TP group (max,
sum of exp, and the target logit from the rank that owns it), so memory stays at one shard.

>>> logp, ent = vocab_parallel_logprobs_entropy(local_logits, targets, tp_group, temperature=0.7)

``local_logits``: [..., V/tp] (any float dtype; the math runs in fp32), ``targets``: [...] global
token ids. Both outputs are [...] fp32 and differentiable w.r.t. the logits (one fused backward).
Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``; pass the real
``vocab_size`` and the padding columns are left out of the softmax (as if they were -inf).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _vocab_range(local_size: int, group) -> tuple[int, int]:
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    return rank * local_size, (rank + 1) * local_size


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group, temperature: float, vocab_size):
        scaled = _scaled(logits, temperature, vocab_size, group)
        maxes = _all_reduce(scaled.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = scaled - maxes.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        # E_p[shifted] for the entropy: sum_j p_j * shifted_j.
        weighted = torch.nan_to_num(exp * shifted, nan=0.0)  # exp = 0 on vocab padding
        mean_shifted = _all_reduce(weighted.sum(dim=-1), dist.ReduceOp.SUM, group) / sum_exp
        start, end = _vocab_range(logits.shape[-1], group)
        owned = (targets >= start) & (targets < end)
        local_idx = torch.where(owned, targets - start, torch.zeros_like(targets))
        target_shifted = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * owned
        target_shifted = _all_reduce(target_shifted, dist.ReduceOp.SUM, group)
        log_sum_exp = sum_exp.log()
        log_probs = target_shifted - log_sum_exp
        entropy = log_sum_exp - mean_shifted
        ctx.save_for_backward(logits, local_idx, owned, maxes, log_sum_exp, mean_shifted)
        ctx.temperature = temperature
        ctx.vocab_size = vocab_size
        ctx.group = group
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, local_idx, owned, maxes, log_sum_exp, mean_shifted = ctx.saved_tensors
        scaled = _scaled(logits, ctx.temperature, ctx.vocab_size, ctx.group)
        shifted = scaled - maxes.unsqueeze(-1)
        probs = (shifted - log_sum_exp.unsqueeze(-1)).exp()
        grad = torch.zeros_like(probs)
        if grad_log_probs is not None:
            # d logp / d l_i = onehot_i - p_i
            grad -= probs * grad_log_probs.unsqueeze(-1)
            onehot = grad_log_probs * owned
            grad.scatter_add_(-1, local_idx.unsqueeze(-1), onehot.unsqueeze(-1))
        if grad_entropy is not None:
            # d H / d l_i = -p_i * (l_i - E_p[l])  (p_i = 0 on vocab padding; avoid 0 * -inf)
            centered = torch.nan_to_num(shifted - mean_shifted.unsqueeze(-1), neginf=0.0)
            grad -= probs * centered * grad_entropy.unsqueeze(-1)
        if ctx.temperature != 1.0:
            grad /= ctx.temperature
        return grad.to(logits.dtype), None, None, None, None


def _scaled(logits: torch.Tensor, temperature: float, vocab_size: int | None, group) -> torch.Tensor:
    """fp32 logits / T, with columns at or past ``vocab_size`` (vocab padding) set to -inf."""
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    if vocab_size is not None:
        start, end = _vocab_range(logits.shape[-1], group)
        if end > vocab_size:
            if scaled is logits:
                scaled = scaled.clone()
            scaled[..., max(vocab_size - start, 0) :] = float("-inf")
    return scaled


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group=None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) per position from this rank's vocab shard of the logits.

    ``group`` is the tensor-parallel group over which the vocabulary is split (None or size 1:
    plain computation). ``temperature`` divides the logits first, as the sampler did.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _VocabParallelLogProbs.apply(logits, targets.long(), group, float(temperature), vocab_size)
