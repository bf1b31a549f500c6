"""The integrity probe: after an update, trainer and engine score the same few sequences.

The probe batch is built once (deterministic random tokens, so it needs no data and is the same
every step). Both roles compute log-probs of its responses; the mean absolute difference over the
response tokens, ``model_update/probe_logprob_diff``, is logged every update. With matching
weights it reflects only the two forward implementations (0 for the same code and dtype, ~1e-2
for bf16 engines against a bf16 trainer); a wrong or missing tensor moves it far more.

What a difference means is decided by ``classify_probe``: non-finite log-probs are corruption
(always an error); a difference above ``model_update_probe_tolerance``, when the user set one, is an
error; above the dtype's warning threshold (``PROBE_WARN_THRESHOLDS``, the less precise of the two
roles' dtypes) it is checked tensor by tensor and is a warning when the weights are equal.

    batch = build_probe_batch(vocab_size=151936, size=2, seed=42)
    diff = logprob_diff(trainer_log_probs, engine_log_probs, batch["response_mask"])
    verdict = classify_probe(diff, tolerance=None, warn_threshold=probe_warn_threshold("bf16", "bf16"))
"""

from __future__ import annotations

import math
from enum import Enum

import torch

from roll.core.batch import Batch
from roll.models.positions import make_position_ids

# Mean |log-prob difference| above which two forwards over equal weights are unusual, by dtype.
# A log-prob sums rounding errors of every layer: bf16 keeps 8 mantissa bits (2^-8 = 3.9e-3 per
# value), and healthy bf16 pairs on 2 x H200 measured 0.0065-0.0106 (Megatron -> megatron_infer) and
# 0.011-0.013 (Megatron -> vLLM); fp16 keeps 11 bits, 8x finer; fp32 pairs measured ~6e-7 on CPU.
# docs/runtime_faults.md gives the margins.
PROBE_WARN_THRESHOLDS = {"bf16": 5e-2, "fp16": 1e-2, "fp32": 1e-4}


class ProbeVerdict(Enum):
    OK = "ok"
    # Above the dtype's warning threshold: the weights are compared; equal weights make it a warning.
    CHECK = "check"
    # Non-finite, or above the tolerance the user set.
    ERROR = "error"


def probe_warn_threshold(*dtypes: str) -> float:
    """The warning threshold of the least precise of ``dtypes`` (e.g. the trainer's and the engine's)."""
    return max(PROBE_WARN_THRESHOLDS[dtype] for dtype in dtypes)


def classify_probe(diff: float, tolerance: float | None, warn_threshold: float) -> ProbeVerdict:
    """What a probe difference means: see the module docstring."""
    if not math.isfinite(diff):
        return ProbeVerdict.ERROR
    if tolerance is not None and diff > tolerance:
        return ProbeVerdict.ERROR
    return ProbeVerdict.CHECK if diff > warn_threshold else ProbeVerdict.OK


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
            "position_ids": make_position_ids(attention_mask),
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
