"""Held-out accuracy of a causal LM with a rule reward, sampled or greedy (HF ``generate``).

    acc = accuracy(model, tokenizer, val_rows, temperature=1.0, max_new_tokens=24, seed=0)

Used by the default example's warm start to report where RL starts from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from roll.pipeline.rewards.math_rule import math_rule_reward


@torch.no_grad()
def generate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[dict]],
    max_new_tokens: int,
    temperature: float,
    batch_size: int = 64,
    seed: int = 0,
) -> list[str]:
    """One response per chat prompt (greedy when ``temperature`` is 0), special tokens removed."""
    torch.manual_seed(seed)
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]
    responses: list[str] = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(
            texts[start : start + batch_size],
            add_special_tokens=False,
            padding=True,
            padding_side="left",
            return_tensors="pt",
        )
        sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        responses += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return responses


def accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    reward_fn: Callable[[str, str], float] = math_rule_reward,
) -> float:
    """Mean reward of one response per row (rows hold ``messages`` and ``ground_truth``)."""
    responses = generate_responses(
        model, tokenizer, [r["messages"] for r in rows], max_new_tokens, temperature, seed=seed
    )
    return sum(reward_fn(resp, r["ground_truth"]) for resp, r in zip(responses, rows, strict=True)) / len(
        rows
    )
