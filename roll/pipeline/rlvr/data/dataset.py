"""Prompt files: JSONL rows read into tokenized prompts, bad rows reported and skipped.

Each JSONL row holds either a ``messages`` field (a list of ``{"role", "content"}``) or a ``prompt``
field (a string, taken as one user message), a ground-truth field and an optional ``tag`` (the
file's stem when absent). The tag routes the row to the reward role whose ``tag_included`` lists it,
and is also its domain for ``domain_interleave_probs``. Field names come from ``DataArgs``.

    dataset = load_prompt_files(config.actor_train.data_args, tokenizer, config.prompt_length,
                                path_prefix="actor_train.data_args")
    dataset[0].prompt_ids, dataset[0].tag, dataset.num_too_long, dataset.bad_rows

Prompts are rendered with the tokenizer's chat template (``add_generation_prompt=True``). A
tokenizer without one, or ``data_args.template: plain``, uses ``PLAIN_TEMPLATE``: one
``"<role>: <content>\\n"`` line per message, then ``"assistant: "``. Other ``template`` values (ROLL's
``qwen2_5``, ``native``, ...) are accepted and mean the tokenizer's own template.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.role import DataArgs

logger = logging.getLogger(__name__)

PLAIN_TEMPLATE = "plain"
MAX_LOGGED_BAD_ROWS = 20


@dataclass
class PromptRow:
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: str
    tag: str
    domain: str
    source: str  # "file:line"


@dataclass
class BadRow:
    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass
class PromptDataset:
    rows: list[PromptRow]
    num_too_long: int = 0
    bad_rows: list[BadRow] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]

    def domains(self) -> list[str]:
        return sorted({row.domain for row in self.rows})

    def indices_by_domain(self) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {d: [] for d in self.domains()}
        for i, row in enumerate(self.rows):
            groups[row.domain].append(i)
        return groups


def render_prompt(messages: list[dict[str, str]], tokenizer: Any, template: str | None) -> str:
    """The prompt text for ``messages``, ending where the assistant's answer starts."""
    if template != PLAIN_TEMPLATE and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def parse_row(row: Any, args: DataArgs, default_tag: str) -> tuple[list[dict[str, str]], str, str]:
    """(messages, ground_truth, tag) of one decoded row; ValueError with the reason when it is bad."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    if args.messages in row:
        messages = row[args.messages]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"wrong type: field {args.messages!r} must be a non-empty list of messages")
        for m in messages:
            if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            ):
                raise ValueError(f"wrong type: each {args.messages!r} item needs string 'role' and 'content'")
    elif args.prompt in row:
        if not isinstance(row[args.prompt], str):
            raise ValueError(f"wrong type: field {args.prompt!r} must be a string")
        messages = [{"role": "user", "content": row[args.prompt]}]
    else:
        raise ValueError(f"missing field: neither {args.messages!r} nor {args.prompt!r}")
    if args.ground_truth not in row:
        raise ValueError(f"missing field: {args.ground_truth!r}")
    truth = row[args.ground_truth]
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise ValueError(f"wrong type: field {args.ground_truth!r} must be a string or a number")
    tag = row.get(args.tag, default_tag)
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"wrong type: field {args.tag!r} must be a non-empty string")
    return messages, str(truth), tag


def read_rows(path: Path, args: DataArgs, bad_rows: list[BadRow]) -> list[tuple[list[dict], str, str, int]]:
    """Good rows of one JSONL file as (messages, ground_truth, tag, line); bad ones go to ``bad_rows``."""
    rows = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
                rows.append((*parse_row(row, args, path.stem), line_no))
            except UnicodeDecodeError:
                bad_rows.append(BadRow(str(path), line_no, "invalid UTF-8"))
            except json.JSONDecodeError as exc:
                bad_rows.append(BadRow(str(path), line_no, f"invalid JSON: {exc.msg} (column {exc.colno})"))
            except ValueError as exc:
                bad_rows.append(BadRow(str(path), line_no, str(exc)))
    return rows


def resolve_files(data_args: DataArgs, path_prefix: str) -> list[Path]:
    key = f"{path_prefix}.file_name" if path_prefix else "file_name"
    if not data_args.file_name:
        raise ConfigError(key, "no prompt files given")
    paths = []
    for name in data_args.file_name:
        path = Path(data_args.dataset_dir) / name if data_args.dataset_dir else Path(name)
        if not path.is_file():
            raise ConfigError(key, f"{name!r}: no such file {str(path)!r}")
        paths.append(path)
    return paths


def load_prompt_files(
    data_args: DataArgs, tokenizer: Any, prompt_length: int, path_prefix: str
) -> PromptDataset:
    """Read, render and tokenize every file of ``data_args.file_name`` (see the module docstring)."""
    dataset = PromptDataset(rows=[])
    too_long: Counter[str] = Counter()
    for path in resolve_files(data_args, path_prefix):
        rows = read_rows(path, data_args, dataset.bad_rows)
        texts = [render_prompt(messages, tokenizer, data_args.template) for messages, *_ in rows]
        ids_list = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        for (_, truth, tag, line_no), text, ids in zip(rows, texts, ids_list, strict=True):
            if len(ids) > prompt_length:
                too_long[str(path)] += 1
                continue
            dataset.rows.append(PromptRow(list(ids), text, truth, tag, tag, f"{path}:{line_no}"))
    if data_args.max_samples is not None:
        dataset.rows = dataset.rows[: data_args.max_samples]
    dataset.num_too_long = sum(too_long.values())
    _log_summary(dataset, too_long, prompt_length)
    if not dataset.rows:
        key = f"{path_prefix}.file_name" if path_prefix else "file_name"
        raise ConfigError(key, f"no usable prompt rows in {data_args.file_name} (see the warnings above)")
    return dataset


def _log_summary(dataset: PromptDataset, too_long: Counter[str], prompt_length: int) -> None:
    for bad in dataset.bad_rows[:MAX_LOGGED_BAD_ROWS]:
        logger.warning("skipped bad prompt row %s", bad)
    if len(dataset.bad_rows) > MAX_LOGGED_BAD_ROWS:
        logger.warning(
            "skipped %d bad prompt rows in all (first %d shown)", len(dataset.bad_rows), MAX_LOGGED_BAD_ROWS
        )
    for path, count in too_long.items():
        logger.warning(
            "dropped %d prompts longer than prompt_length=%d tokens from %s", count, prompt_length, path
        )
    logger.info(
        "loaded %d prompts (domains %s); dropped %d too long, skipped %d bad rows",
        len(dataset),
        dict(Counter(row.domain for row in dataset.rows)),
        dataset.num_too_long,
        len(dataset.bad_rows),
    )
