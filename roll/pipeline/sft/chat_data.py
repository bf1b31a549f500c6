"""SFT chat data: JSONL rows of ``messages`` turned into token ids with a loss mask on assistant tokens.

Each row holds a list of ``{"role", "content"}`` messages (field name ``data.messages_key``) with at
least one ``assistant`` turn. The text is the tokenizer's chat template; an assistant turn is
trained on its content followed by the end-of-sequence token, right after the template's
generation prompt (``add_generation_prompt=True`` over the messages before it). Everything else
(system/user turns, the template's markup, text after the last assistant turn's EOS) is context:
its tokens carry no loss. Messages after the last assistant turn are dropped.

    examples = load_chat_files(["data/sft.jsonl"], tokenizer, max_length=512, key="data.train_files")
    batch = to_sft_batch([examples[i] for i in rows], tokenizer.pad_token_id)

A row without an assistant turn, or whose assistant tokens all fall past ``max_length``, is a
``ConfigError`` naming ``file:line``: a data set that trains on nothing should not run quietly.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from roll.configs.errors import ConfigError
from roll.core.batch import Batch
from roll.models.positions import make_position_ids


@dataclass
class ChatExample:
    """One conversation: ``input_ids`` and a 0/1 ``loss_mask`` of the same length."""

    input_ids: list[int]
    loss_mask: list[int]
    source: str  # "file:line"

    @property
    def prompt_length(self) -> int:
        """Tokens before the first trained token (the left part of the Batch layout)."""
        return self.loss_mask.index(1)


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def encode_chat(tokenizer: Any, messages: list[dict], source: str) -> ChatExample:
    """Token ids and loss mask of one conversation (see the module docstring)."""
    if not any(m.get("role") == "assistant" for m in messages):
        raise ConfigError(source, "the conversation has no assistant turn, so nothing to train on")
    eos_text = tokenizer.decode([tokenizer.eos_token_id])
    ids: list[int] = []
    mask: list[int] = []
    covered = ""  # the template text that ids already stand for
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        context = _render(tokenizer, messages[:i], generation_prompt=True)
        if not context.startswith(covered):
            raise ConfigError(
                source, "the chat template renders earlier turns differently once later turns follow"
            )
        context_ids = _tokens(tokenizer, context[len(covered) :])
        answer_ids = _tokens(tokenizer, str(message.get("content", ""))) + [tokenizer.eos_token_id]
        ids += context_ids + answer_ids
        mask += [0] * len(context_ids) + [1] * len(answer_ids)
        covered = context + str(message.get("content", "")) + eos_text
    return ChatExample(ids, mask, source)


def _read_rows(path: Path, key: str) -> list[tuple[int, Any]]:
    if not path.is_file():
        raise ConfigError(key, f"{path}: no such file")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}", f"not JSON: {exc.msg}") from None
    return rows


def load_chat_files(
    files: Sequence[str],
    tokenizer: Any,
    max_length: int,
    key: str,
    messages_key: str = "messages",
    response_key: str | None = None,
) -> list[ChatExample]:
    """Every row of ``files`` encoded and cut to ``max_length`` tokens (see the module docstring).
    With ``response_key`` the row's string under that key is appended as the final assistant turn
    (prompt/answer rows such as the default example's ``target``)."""
    examples = []
    for name in files:
        for number, row in _read_rows(Path(name), key):
            source = f"{name}:{number}"
            messages = row.get(messages_key) if isinstance(row, dict) else None
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise ConfigError(source, f"expected a {messages_key!r} list of {{role, content}} messages")
            if response_key is not None:
                if not isinstance(row.get(response_key), str):
                    raise ConfigError(source, f"expected a string under {response_key!r} (data.response_key)")
                messages = messages + [{"role": "assistant", "content": row[response_key]}]
            example = encode_chat(tokenizer, messages, source)
            example = ChatExample(example.input_ids[:max_length], example.loss_mask[:max_length], source)
            if not any(example.loss_mask):
                raise ConfigError(
                    source,
                    f"every assistant token lies past max_length {max_length}; the loss mask is empty",
                )
            examples.append(example)
    if not examples:
        raise ConfigError(key, f"no rows in {', '.join(files)}")
    return examples


def to_sft_batch(examples: Sequence[ChatExample], pad_token_id: int) -> Batch:
    """The strategies' Batch layout: the context before the first trained token is the left-padded
    prompt; the rest is the right-padded response, with ``loss_mask`` marking trained tokens."""
    prompt_width = max(e.prompt_length for e in examples)
    response_width = max(len(e.input_ids) - e.prompt_length for e in examples)
    rows = len(examples)
    prompts = torch.full((rows, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.long)
    responses = torch.full((rows, response_width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, response_width), dtype=torch.long)
    loss_mask = torch.zeros((rows, response_width), dtype=torch.float32)
    for i, e in enumerate(examples):
        p = e.prompt_length
        r = len(e.input_ids) - p
        prompts[i, prompt_width - p :] = torch.tensor(e.input_ids[:p])
        prompt_mask[i, prompt_width - p :] = 1
        responses[i, :r] = torch.tensor(e.input_ids[p:])
        response_mask[i, :r] = 1
        loss_mask[i, :r] = torch.tensor(e.loss_mask[p:], dtype=torch.float32)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch.from_dict(
        {
            "prompts": prompts,
            "prompt_mask": prompt_mask,
            "responses": responses,
            "response_mask": response_mask,
            "loss_mask": loss_mask,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": make_position_ids(attention_mask),
        }
    )
