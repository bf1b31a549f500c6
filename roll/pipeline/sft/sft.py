"""Supervised fine-tuning of a Hugging Face causal LM on (prompt, target) pairs, on CPU or one GPU.

The loss covers target tokens only (the prompt is context). Used as the warm start of the default
example, so it is small and deterministic: the same seed, data and config give the same weights.

    examples = encode_examples(tokenizer, [row["messages"] for row in rows], [row["solution"] for row in rows])
    losses = train_sft(model, examples, SFTConfig(steps=800), pad_token_id=tokenizer.pad_token_id)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

IGNORE_INDEX = -100


@dataclass
class SFTConfig:
    steps: int = 800
    batch_size: int = 32
    learning_rate: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 100


@dataclass
class SFTExample:
    prompt_ids: list[int]
    target_ids: list[int]  # ends with the end-of-sequence token


def encode_examples(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[list[dict] | str], targets: Sequence[str]
) -> list[SFTExample]:
    """Chat-template each prompt (a message list, or a string taken as one user message) with the
    generation prompt, and append the end-of-sequence token to each target."""
    examples = []
    for prompt, target in zip(prompts, targets, strict=True):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        target_ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append(SFTExample(prompt_ids, target_ids))
    return examples


def collate(examples: Sequence[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask`` and ``labels`` that are -100 off the targets."""
    length = max(len(e.prompt_ids) + len(e.target_ids) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):
        ids = e.prompt_ids + e.target_ids
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(e.prompt_ids) : len(ids)] = torch.tensor(e.target_ids)
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def target_loss(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over target tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX
    )


def lr_factor(step: int, config: SFTConfig) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train_sft(
    model: PreTrainedModel,
    examples: Sequence[SFTExample],
    config: SFTConfig,
    pad_token_id: int,
    log: Callable[[str], None] = print,
) -> list[float]:
    """Train ``model`` in place for ``config.steps`` AdamW steps; returns the loss of every step.

    Batches are drawn by a generator seeded with ``config.seed`` (epochs of shuffled examples)."""
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    model.train()
    order: list[int] = []
    losses = []
    for step in range(config.steps):
        if len(order) < config.batch_size:
            order += torch.randperm(len(examples), generator=generator).tolist()
        picked, order = order[: config.batch_size], order[config.batch_size :]
        loss = target_loss(model, collate([examples[i] for i in picked], pad_token_id))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if config.log_every and (step + 1) % config.log_every == 0:
            recent = losses[-config.log_every :]
            log(f"sft step {step + 1}/{config.steps}  loss {sum(recent) / len(recent):.4f}")
    model.eval()
    return losses
