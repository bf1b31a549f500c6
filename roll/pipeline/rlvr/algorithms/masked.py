"""Reductions over the valid (mask == 1) tokens of ``[B, R]`` tensors, and loss aggregation.

Every RL quantity lives on right-padded response tokens, so every mean, variance and loss must
ignore the padding. ``agg_loss`` turns a per-token loss matrix into the scalar that is
back-propagated, following ``RLVRConfig.loss_agg_mode``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over all elements, or along ``dim``)."""
    total = values * mask
    return total.sum() if dim is None else total.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the elements where ``mask`` is 1; 0 where nothing is valid."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid elements; ``unbiased`` applies Bessel's correction n / (n - 1).

    With a single valid element the unbiased variance is defined as 0 (not NaN) so that whitening
    a one-token batch stays finite.
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with mean and unbiased var over the valid elements.

    ``shift_mean=False`` adds the mean back (only rescales). Padding positions are transformed too;
    callers multiply by the mask when they need zeros there.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened if shift_mean else whitened + mean


def _token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(loss_mat, mask)


def _mean_over_sequences(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    has_tokens = (mask.sum(dim=-1) > 0).to(per_seq.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def _seq_mean_token_sum(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _mean_over_sequences(masked_sum(loss_mat, mask, dim=-1), mask)


def _seq_mean_token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _mean_over_sequences(masked_mean(loss_mat, mask, dim=-1), mask)


# loss_agg_mode -> reduction of a [B, R] loss matrix. With L the loss, m the mask, and the outer
# means taken over the sequences that have at least one valid token:
#   token-mean:           sum_{b,t} L*m / sum_{b,t} m           (every token weighs the same)
#   seq-mean-token-sum:   mean_b( sum_t L*m )                    (Dr. GRPO style, length-unbiased)
#   seq-mean-token-mean:  mean_b( sum_t L*m / sum_t m )          (GRPO paper; every sequence weighs the same)
#   seq-mean:             alias of seq-mean-token-mean
AGG_MODES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean": _seq_mean_token_mean,
}


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a per-token loss ``[B, R]`` to a scalar by ``mode`` (see ``AGG_MODES``).

    >>> agg_loss(torch.tensor([[1.0, 3.0], [5.0, 0.0]]), torch.tensor([[1, 1], [1, 0]]), "token-mean")
    tensor(3.)
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode: expected one of {list(AGG_MODES)}, got {mode!r}")
    return AGG_MODES[mode](loss_mat, mask.to(loss_mat.dtype))
