"""The integrity probe: after an update, trainer and engine score the same few sequences.

The probe batch is built once (deterministic random tokens, so it needs no data and is the same
every step). Both roles compute log-probs of its responses; the mean absolute difference over the
response tokens, ``model_update/probe_logprob_diff``, is logged every update. With matching
weights it reflects only the two forward implementations (0 for the same code and dtype, ~1e-2
for bf16 engines against an fp32 trainer); a wrong or missing tensor moves it far more.

    batch = build_probe_batch(vocab_size=151936, size=2, seed=42)
    diff = logprob_diff(trainer_log_probs, engine_log_probs, batch["response_mask"])
"""

from __future__ import annotations

import torch

from roll.distributed.scheduler.batch import Batch


def build_probe_batch(
    vocab_size: int, size: int, seed: int, prompt_length: int = 16, response_length: int = 16
) -> Batch:
    """``size`` rows of random token ids below ``vocab_size`` in the Batch layout of
    ``roll.distributed.strategy.base`` (no padding: every mask is 1)."""
    if size < 1 or vocab_size < 2:
        raise ValueError(f"a probe needs size >= 1 and vocab_size >= 2, got {size} and {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab_size, (size, prompt_length), generator=generator)
    responses = torch.randint(0, vocab_size, (size, response_length), generator=generator)
    prompt_mask = torch.ones_like(prompts)
    response_mask = torch.ones_like(responses)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch.from_dict(
        {
            "prompts": prompts,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        }
    )


def logprob_diff(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean |trainer - engine| over the tokens where ``mask`` is 1 (inf when either has NaN)."""
    if trainer.shape != engine.shape:
        raise ValueError(
            f"probe log-probs differ in shape: trainer {tuple(trainer.shape)}, engine {tuple(engine.shape)}"
        )
    diff = (trainer.double() - engine.double()).abs()
    if torch.isnan(diff).any():
        return float("inf")
    weights = mask.double()
    return float((diff * weights).sum() / weights.sum().clamp(min=1))
