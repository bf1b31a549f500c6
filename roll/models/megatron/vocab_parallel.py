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

from collections.abc import Sequence

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _vocab_range(local_size: int, group) -> tuple[int, int]:
    rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
    return rank * local_size, (rank + 1) * local_size


# Rows of fp32 [rows, V/tp] temporaries per chunk: ~256 MiB each, whatever the vocabulary.
_CHUNK_ELEMENTS = 1 << 26


def _chunks(rows: int, vocab: int) -> list[slice]:
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


class _VocabParallelLogProbs(torch.autograd.Function):
    """Works on [N, V/tp] rows in chunks, so the fp32 temporaries stay ~256 MiB; two rounds of
    all-reduces over the TP group (the max, then sum-exp / E[shifted] / target logit)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, group, temperature: float, vocab_size):
        rows, vocab = logits.shape
        start, end = _vocab_range(vocab, group)
        owned = (targets >= start) & (targets < end)
        local_idx = torch.where(owned, targets - start, torch.zeros_like(targets))
        maxes = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for part in _chunks(rows, vocab):
            maxes[part] = _scaled(logits[part], temperature, vocab_size, group).max(dim=-1).values
        _all_reduce(maxes, dist.ReduceOp.MAX, group)
        stats = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
        for part in _chunks(rows, vocab):
            shifted = _scaled(logits[part], temperature, vocab_size, group) - maxes[part].unsqueeze(-1)
            exp = shifted.exp()
            stats[0, part] = exp.sum(dim=-1)
            # E_p[shifted] for the entropy (exp = 0 on vocab padding, where shifted = -inf)
            stats[1, part] = torch.nan_to_num(exp * shifted, nan=0.0).sum(dim=-1)
            stats[2, part] = shifted.gather(-1, local_idx[part].unsqueeze(-1)).squeeze(-1) * owned[part]
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        log_sum_exp = stats[0].log()
        mean_shifted = stats[1] / stats[0]
        log_probs = stats[2] - log_sum_exp
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
        grad = torch.empty_like(logits)
        for part in _chunks(*logits.shape):
            grad[part] = _chunk_grad(ctx, logits[part], part, grad_log_probs, grad_entropy)
        return grad, None, None, None, None


def _chunk_grad(ctx, logits, part, grad_log_probs, grad_entropy) -> torch.Tensor:
    """d(sum g_lp * logp + g_ent * H) / d logits for one chunk of rows."""
    _, local_idx, owned, maxes, log_sum_exp, mean_shifted = ctx.saved_tensors
    shifted = _scaled(logits, ctx.temperature, ctx.vocab_size, ctx.group) - maxes[part].unsqueeze(-1)
    probs = (shifted - log_sum_exp[part].unsqueeze(-1)).exp()
    grad = torch.zeros_like(probs)
    if grad_log_probs is not None:
        # d logp / d l_i = onehot_i - p_i
        g = grad_log_probs[part]
        grad -= probs * g.unsqueeze(-1)
        grad.scatter_add_(-1, local_idx[part].unsqueeze(-1), (g * owned[part]).unsqueeze(-1))
    if grad_entropy is not None:
        # d H / d l_i = -p_i * (l_i - E_p[l])  (p_i = 0 on vocab padding; avoid 0 * -inf)
        centered = torch.nan_to_num(shifted - mean_shifted[part].unsqueeze(-1), neginf=0.0)
        grad -= probs * centered * grad_entropy[part].unsqueeze(-1)
    if ctx.temperature != 1.0:
        grad /= ctx.temperature
    return grad.to(logits.dtype)


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
    lead = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    log_probs, entropy = _VocabParallelLogProbs.apply(
        flat, targets.reshape(-1).long(), group, float(temperature), vocab_size
    )
    return log_probs.reshape(lead), entropy.reshape(lead)


def exclude_vocab_tokens(logits: torch.Tensor, token_ids: Sequence[int], group=None) -> torch.Tensor:
    """This rank's vocab shard of ``logits`` with the columns of ``token_ids`` (global ids) at
    ``EXCLUDED_LOGIT``: a vision-language model's tokens a response must not hold, scored as every
    other strategy scores them (``roll.models.vision.response_excluded_tokens``)."""
    from roll.models.vision import exclude_response_tokens

    if not token_ids:
        return logits
    start, end = _vocab_range(logits.shape[-1], group)
    return exclude_response_tokens(logits, [t - start for t in token_ids if start <= t < end])
