"""Token sampling for the megatron generation loop, with HF ``generate``'s processor order.

Processors run as transformers applies them: repetition penalty, the min-new-tokens EOS mask,
then temperature, top-k, top-p. The recorded log-prob of a sampled token is the log-softmax of the
final processed logits (as ``hf_infer`` records it), so with top_p = 1, top_k off, no repetition
penalty and min_new_tokens = 0 it equals ``compute_log_probs`` at the same temperature.

>>> token, logp = sample_next(logits, params, history, step, eos_ids)
"""

from __future__ import annotations

import torch

from roll.core.sampling import SamplingParams


def _repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor, penalty: float
):
    """HF's rule: seen tokens' logits divided by the penalty when > 0, multiplied when < 0."""
    ids = torch.where(history_mask, history, torch.zeros_like(history))
    counts = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
    counts.scatter_add_(-1, ids, history_mask.to(torch.int32))
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(counts > 0, penalized, logits)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    k = min(k, logits.shape[-1])
    threshold = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """HF's TopPLogitsWarper: drop the lowest-probability tokens whose cumulative mass <= 1 - p."""
    sorted_logits, order = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    history: torch.Tensor,
    history_mask: torch.Tensor,
    step: int,
    eos_ids: list[int],
) -> torch.Tensor:
    """fp32 [N, V] logits after every processor (see the module docstring)."""
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        logits = _repetition_penalty(logits, history, history_mask, params.repetition_penalty)
    if step < params.min_new_tokens and eos_ids:
        logits[:, eos_ids] = float("-inf")
    if params.temperature > 0:
        if params.temperature != 1.0:
            logits = logits / params.temperature
        if params.top_k is not None and params.top_k > 0:
            logits = _top_k(logits, params.top_k)
        if params.top_p < 1.0:
            logits = _top_p(logits, params.top_p)
    return logits


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    history: torch.Tensor,
    history_mask: torch.Tensor,
    step: int,
    eos_ids: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [N], their log-probs [N]) drawn from the processed distribution (argmax when
    ``params.temperature`` is 0)."""
    scores = process_logits(logits, params, history, history_mask, step, eos_ids)
    log_probs = torch.log_softmax(scores, dim=-1)
    if params.temperature > 0:
        tokens = torch.multinomial(log_probs.exp(), 1).squeeze(-1)
    else:
        tokens = scores.argmax(dim=-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
