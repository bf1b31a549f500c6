"""Token log-probs and entropies of Hugging Face causal LMs over the response window.

>>> out = response_log_probs(model, batch, temperature=batch_temperature(batch))
>>> out["log_probs"].shape == batch["responses"].shape                 # [B, R]

Window convention (``roll.distributed.strategy.base``): position t scores ``responses[:, t]``
from the logits at column P + t - 1 of ``input_ids``. Values are 0 on response padding.

Temperature: the sampler draws from softmax(logits / T), so the log-probs that match what was
sampled are those of ``logits / T``. Inference strategies record T in ``batch.meta["temperature"]``
when they generate (1.0 for greedy); ``batch_temperature`` reads it back so old, reference and
new log-probs all use the sampler's T. (megatron strategies compute the same thing with a
vocab-parallel version of these functions.)
"""

from __future__ import annotations

import torch
from torch import nn

from roll.core.batch import Batch
from roll.models.packing import pack_rows
from roll.models.vision import (
    exclude_response_tokens,
    forward_kwargs,
    has_vision_inputs,
    response_excluded_tokens,
)

TEMPERATURE_KEY = "temperature"
# Rows of [N, V] logits turned into fp32 at once: bounds the fp32 copy to ~256 MiB for any vocabulary.
_CHUNK_ELEMENTS = 1 << 26


def batch_temperature(batch: Batch) -> float:
    """The sampling temperature recorded by the generating strategy (1.0 when none was recorded)."""
    return float(batch.meta.get(TEMPERATURE_KEY, 1.0))


def _rows_per_chunk(vocab_size: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(vocab_size, 1))


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] in fp32, shape ``labels.shape``.

    Computed as ``logit[label] - logsumexp(logits)`` over row chunks, so the full fp32
    log-softmax of a large vocabulary is never materialised at once (autograd still saves each
    chunk's fp32 copy for backward).
    """
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1, 1)
    step = _rows_per_chunk(vocab)
    parts = []
    for start in range(0, flat_logits.shape[0], step):
        chunk = flat_logits[start : start + step].float()
        picked = chunk.gather(-1, flat_labels[start : start + step]).squeeze(-1)
        parts.append(picked - torch.logsumexp(chunk, dim=-1))
    if not parts:
        return torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, fp32, chunked like ``log_probs_from_logits``."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    step = _rows_per_chunk(vocab)
    parts = []
    for start in range(0, flat.shape[0], step):
        chunk = flat[start : start + step].float()
        lse = torch.logsumexp(chunk, dim=-1)
        probs = torch.softmax(chunk, dim=-1)
        parts.append(lse - (probs * chunk).sum(-1))
    if not parts:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(logits.shape[:-1])


def response_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Logits [B, R, V] predicting ``responses[:, t]`` (columns P - 1 .. P + R - 2).

    Only the last R + 1 positions go through the LM head (``logits_to_keep``). Rows with images or
    videos (``roll.models.vision``) pass their pixel values, grids and token types instead of
    position ids: the model computes its 3-D rope positions from them and the attention mask.
    """
    width = batch["responses"].shape[1]
    vision = forward_kwargs(batch, batch["input_ids"].device, batch["input_ids"], model)
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=None if vision else batch["position_ids"],
        use_cache=False,
        logits_to_keep=width + 1,
        **vision,
    )
    return out.logits[:, -width - 1 : -1]


def transformers_detects_packing() -> bool:
    """Whether the installed transformers confines attention to each sequence of a packed row
    given restarting position ids and no attention mask (``masking_utils``, transformers >= 4.54)."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


def packed_response_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``response_logits`` with the rows packed into one (``roll.models.packing``): position ids
    restart per sequence and no attention mask is given, so transformers confines attention to
    each sequence (its packed-sequence detection; flash-attention kernels read the position ids).
    Only the window's columns go through the LM head."""
    if has_vision_inputs(batch):
        raise ValueError("rows with images cannot be packed (roll.models.vision); turn sequence_packing off")
    row = pack_rows(batch).to(batch["input_ids"].device)
    out = model(
        input_ids=row.input_ids,
        position_ids=row.position_ids,
        use_cache=False,
        logits_to_keep=row.window.reshape(-1),
    )
    return out.logits[0].view(*row.window.shape, -1)


def response_log_probs(
    model: nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = True,
    packed: bool = False,
) -> dict[str, torch.Tensor]:
    """{"log_probs": [B, R], "entropy": [B, R]} (fp32, 0 on response padding) of ``logits / temperature``.

    Pass the temperature the responses were sampled with (``batch_temperature(batch)``); 0 or
    negative means greedy and scores the raw logits (T = 1). ``packed``: one packed row instead
    of padded rows (same values; see ``packed_response_logits``).
    """
    logits = packed_response_logits(model, batch) if packed else response_logits(model, batch)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    # A vision-language model's responses never hold its vision tokens (roll.models.vision).
    logits = exclude_response_tokens(logits, response_excluded_tokens(getattr(model, "config", None)))
    mask = batch["response_mask"].bool()
    out = {"log_probs": torch.where(mask, log_probs_from_logits(logits, batch["responses"]), 0.0)}
    if with_entropy:
        out["entropy"] = torch.where(mask, entropy_from_logits(logits), 0.0)
    return out
