"""Prompt files: JSONL (or parquet) rows read into tokenized prompts, bad rows reported and skipped.

Each JSONL row holds either a ``messages`` field (a list of ``{"role", "content"}``, or that list as
a JSON string, as in alibaba/ROLL's files) or a ``prompt``
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

A row is rejected (skipped, counted in ``bad_rows`` and logged as ``file:line: reason``) when it is
not JSON (invalid UTF-8, bad syntax, nested too deeply), has an empty or whitespace-only prompt or
message content, a missing / null / NaN / infinite ground truth, or a string holding a lone UTF-16
surrogate (``"\ud800"``: valid JSON, but no tokenizer can encode it). Prompts longer than
``prompt_length`` tokens are dropped and counted, the first ``MAX_LOGGED_BAD_ROWS`` by ``file:line``.

A ``.json`` file holding one JSON list of rows (Video-R1's files) is read as rows numbered from 1.

alibaba/ROLL's vision-language rows (``roll.pipeline.rlvr.data.vision``): ``.parquet`` files are read
too (rows numbered from 1 where JSONL has lines); a row without ``tag`` takes its ``data_source``, one
without a ground truth its ``reward_model.ground_truth``; a row's ``images`` (``data_args.images``) are
tokenized with the model's image processor (``processor``, a vision-language model's), and a
message's content may be a list of ``{"type": "image"}`` / ``{"type": "text"}`` parts.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError
from roll.configs.role import DataArgs
from roll.pipeline.rlvr.data.audio import read_audio_test_row, row_audios
from roll.pipeline.rlvr.data.audio_files import read_row_audios
from roll.pipeline.rlvr.data.video import FramePlan, VideoOptions, probe_video, read_video_r1_row, row_videos
from roll.pipeline.rlvr.data.vision import (
    REWARD_MODEL,
    content_text,
    decode_images,
    iter_parquet,
    place_images,
    row_context,
    row_images,
)

logger = logging.getLogger(__name__)

PLAIN_TEMPLATE = "plain"
MAX_LOGGED_BAD_ROWS = 20
MAX_LOGGED_TOO_LONG = 5


@dataclass
class PromptRow:
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: str
    tag: str
    domain: str
    source: str  # "file:line"
    images: list[Any] | None = None  # image bytes or paths (vision-language rows), decoded per batch
    reward_context: dict[str, Any] | None = None  # the row's reward options (``data.vision``)
    pixels: tuple[int | None, int | None] | None = None  # its file's image_min/max_pixels
    videos: list[str] | None = None  # video paths (``data.video``), their frames decoded per batch
    video_options: VideoOptions | None = None  # its file's frame sampling
    video_plans: list[FramePlan] | None = None  # each video's frames, probed once when the file loads
    audios: list[str] | None = None  # audio file names (``data.audio``), read per batch
    audio_folder: str | None = None  # its file's audio_folder


@dataclass
class RawRow:
    """One good row of a prompt file, before rendering."""

    messages: list[dict[str, str]]
    ground_truth: str
    tag: str
    line: int
    images: list[Any] | None = None
    reward_context: dict[str, Any] | None = None
    videos: list[str] | None = None
    audios: list[str] | None = None


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
    too_long: list[str] = field(default_factory=list)  # "file:line" of each dropped long prompt

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
    messages = _messages(row, args)
    truth = _ground_truth(row, args)
    tag = row.get(args.tag, row.get("data_source", default_tag))
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"wrong type: field {args.tag!r} must be a non-empty string")
    texts = [(args.tag, tag), (args.ground_truth, truth)]
    field = _messages_field(row, args)
    if field is not None:
        texts += [(f"{field}[{i}].{k}", m[k]) for i, m in enumerate(messages) for k in ("role", "content")]
    else:
        texts.append((args.prompt, messages[0]["content"]))
    for name, text in texts:
        _check_encodable(name, text)
    return messages, truth, tag


def _messages_field(row: dict[str, Any], args: DataArgs) -> str | None:
    """The field holding the message list: ``messages``, or ``prompt`` when it holds a list
    (alibaba/ROLL's vision-language rows, whatever ``data_args.messages`` says)."""
    if args.messages in row:
        return args.messages
    return args.prompt if isinstance(row.get(args.prompt), list) else None


def _messages(row: dict[str, Any], args: DataArgs) -> list[dict[str, str]]:
    field = _messages_field(row, args)
    if field is not None:
        messages = row[field]
        if isinstance(messages, str):  # alibaba/ROLL's files hold the list as a JSON string
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError as exc:
                raise ValueError(f"invalid JSON in field {field!r}: {exc.msg} (column {exc.colno})") from None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"wrong type: field {field!r} must be a non-empty list of messages")
        messages = [
            {**m, "content": content_text(m.get("content"))} if isinstance(m, dict) else m for m in messages
        ]
        for i, m in enumerate(messages):
            if not (
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            ):
                raise ValueError(f"wrong type: each {field!r} item needs string 'role' and 'content'")
            if not m["content"].strip():
                raise ValueError(f"empty content: {field}[{i}] ({m['role']}) has no text")
        return messages
    if args.prompt in row:
        if not isinstance(row[args.prompt], str):
            raise ValueError(f"wrong type: field {args.prompt!r} must be a string")
        if not row[args.prompt].strip():
            raise ValueError(f"empty prompt: field {args.prompt!r} has no text")
        return [{"role": "user", "content": row[args.prompt]}]
    raise ValueError(f"missing field: neither {args.messages!r} nor {args.prompt!r}")


def _ground_truth(row: dict[str, Any], args: DataArgs) -> str:
    reward_model = row.get(REWARD_MODEL)
    if args.ground_truth not in row and isinstance(reward_model, dict) and args.ground_truth in reward_model:
        row = reward_model  # alibaba/ROLL's vision-language rows keep it there
    if args.ground_truth not in row:
        raise ValueError(f"missing field: {args.ground_truth!r}")
    truth = row[args.ground_truth]
    if truth is None:
        raise ValueError(f"missing value: field {args.ground_truth!r} is null")
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise ValueError(f"wrong type: field {args.ground_truth!r} must be a string or a number")
    if isinstance(truth, float) and not math.isfinite(truth):
        raise ValueError(f"missing value: field {args.ground_truth!r} is {truth} (not a finite number)")
    return str(truth)


def _check_encodable(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise ValueError(
            f"invalid text: field {name!r} holds a lone surrogate {bad!r} at character {exc.start}"
        ) from None


def read_rows(path: Path, args: DataArgs, bad_rows: list[BadRow]) -> list[RawRow]:
    """Good rows of one JSONL or parquet file; bad ones go to ``bad_rows``."""
    if path.suffix == ".parquet":
        return _numbered_rows(iter_parquet(path), path, args, bad_rows)
    if path.suffix == ".json" and _starts_a_list(path):
        return _numbered_rows(_json_list(path), path, args, bad_rows)
    rows = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rows.append(_raw_row(json.loads(raw.decode("utf-8")), args, path.stem, line_no))
            except UnicodeDecodeError:
                bad_rows.append(BadRow(str(path), line_no, "invalid UTF-8"))
            except RecursionError:
                bad_rows.append(BadRow(str(path), line_no, "invalid JSON: nested too deeply"))
            except json.JSONDecodeError as exc:
                bad_rows.append(BadRow(str(path), line_no, f"invalid JSON: {exc.msg} (column {exc.colno})"))
            except ValueError as exc:
                bad_rows.append(BadRow(str(path), line_no, str(exc)))
    return rows


def _numbered_rows(
    numbered: Iterable[tuple[int, Any]], path: Path, args: DataArgs, bad_rows: list[BadRow]
) -> list[RawRow]:
    """Good rows of (number, row) pairs (a parquet file's, a JSON list's); bad ones to ``bad_rows``."""
    rows = []
    for number, row in numbered:
        try:
            rows.append(_raw_row(row, args, path.stem, number))
        except ValueError as exc:
            bad_rows.append(BadRow(str(path), number, str(exc)))
    return rows


def _starts_a_list(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(64).lstrip().startswith(b"[")


def _json_list(path: Path) -> Iterable[tuple[int, Any]]:
    """(number from 1, row) of a ``.json`` file holding one list of rows (Video-R1's files)."""
    try:
        items = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("data_args.file_name", f"{path}: not a JSON list of rows ({exc})") from None
    return enumerate(items, start=1)


def _raw_row(row: Any, args: DataArgs, default_tag: str, line: int) -> RawRow:
    if args.row_layout == "video_r1":
        messages, truth, tag, context = read_video_r1_row(row, default_tag)
    elif args.row_layout == "audio_test":
        messages, truth, tag, context = read_audio_test_row(row, args, default_tag)
    else:
        (messages, truth, tag), context = parse_row(row, args, default_tag), row_context(row)
    images, videos = row_images(row, args.images), row_videos(row, args.video)
    if images and videos:
        raise ValueError("a row holds images or videos, not both")
    if images:
        messages = place_images(messages, len(images))
    if videos:
        messages = place_images(messages, len(videos), "video")
    audios = row_audios(row, args.audios) if isinstance(row, dict) else None
    if audios:
        messages = place_images(messages, len(audios), "audio")
    return RawRow(messages, truth, tag, line, images, context, videos, audios)


def resolve_files(data_args: DataArgs, path_prefix: str) -> list[Path]:
    key = f"{path_prefix}.file_name" if path_prefix else "file_name"
    if not data_args.file_name:
        raise ConfigError(key, "no prompt files given")
    paths = []
    for name in data_args.file_name:
        path = prompt_file_path(data_args.dataset_dir, name)
        if not path.is_file():
            joined = " (dataset_dir joined in front)" if path != Path(name) else ""
            raise ConfigError(key, f"{name!r}: no such file {str(path)!r}{joined}")
        paths.append(path)
    return paths


def prompt_file_path(dataset_dir: str | None, name: str) -> Path:
    """``dataset_dir / name``, as alibaba/ROLL does, except where ``name`` is absolute or already
    starts with ``dataset_dir`` (``dataset_dir: data`` + ``data/x.jsonl`` reads ``data/x.jsonl``)."""
    path = Path(name)
    if not dataset_dir or path.is_absolute():
        return path
    base = Path(dataset_dir)
    if path.parts[: len(base.parts)] == base.parts:
        return path
    return base / path


def load_prompt_files(
    data_args: DataArgs, tokenizer: Any, prompt_length: int, path_prefix: str, processor: Any = None
) -> PromptDataset:
    """Read, render and tokenize every file of ``data_args.file_name`` (see the module docstring);
    ``processor``: a vision-language model's ``VisionProcessor``, which rows with images need."""
    dataset = PromptDataset(rows=[])
    for path in resolve_files(data_args, path_prefix):
        rows = read_rows(path, data_args, dataset.bad_rows)
        texts = [render_prompt(row.messages, tokenizer, data_args.template) for row in rows]
        ids_list = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        pixels = (data_args.image_min_pixels, data_args.image_max_pixels)
        video_options = VideoOptions.of(data_args)
        for row, text, ids in zip(rows, texts, ids_list, strict=True):
            source = f"{path}:{row.line}"
            plans = None
            if row.images or row.videos or row.audios:
                key = f"{path_prefix}.file_name"
                text, ids, plans = _vision_prompt(
                    text, row, processor, source, key, pixels, video_options, data_args.audio_folder
                )
            if len(ids) > prompt_length:
                dataset.too_long.append(f"{source} ({len(ids)} tokens)")
                continue
            dataset.rows.append(
                PromptRow(
                    list(ids),
                    text,
                    row.ground_truth,
                    row.tag,
                    row.tag,
                    source,
                    row.images,
                    row.reward_context,
                    pixels if row.images else None,
                    row.videos,
                    video_options if row.videos else None,
                    plans or None,
                    row.audios,
                    data_args.audio_folder if row.audios else None,
                )  # fmt: skip
            )
    if data_args.max_samples is not None:
        dataset.rows = dataset.rows[: data_args.max_samples]
    dataset.num_too_long = len(dataset.too_long)
    _log_summary(dataset, prompt_length)
    if not dataset.rows:
        key = f"{path_prefix}.file_name" if path_prefix else "file_name"
        raise ConfigError(key, f"no usable prompt rows in {data_args.file_name} (see the warnings above)")
    return dataset


def _vision_prompt(
    text: str,
    row: RawRow,
    processor: Any,
    source: str,
    key: str,
    pixels: tuple[int | None, int | None],
    video_options: VideoOptions,
    audio_folder: str | None = None,
) -> tuple[str, list[int], list[FramePlan]]:
    """(text with vision and audio tokens, ids with each image's, video's and audio's tokens
    expanded, each video's frame plan) of a row with images, videos or audios."""
    from roll.models.vision import with_image_tokens

    if processor is None:
        what = "images" if row.images else "videos" if row.videos else "audios"
        raise ConfigError(key, f"{source}: the row has {what} but the model is not a vision-language model")
    if row.audios and processor.audio is None:
        raise ConfigError(
            key, f"{source}: the row has audios but the model has no audio tower (Qwen3-Omni has)"
        )
    text = with_image_tokens(text)
    try:
        factor = processor.patch_size * processor.merge_size
        plans = [probe_video(ref, source, i, video_options, factor) for i, ref in enumerate(row.videos or [])]
        videos = [processor.video_text(p.indices, p.rate, p.height, p.width) for p in plans]
        images = decode_images(row.images, source) if row.images else []
        audios = read_row_audios(row.audios, source, audio_folder, processor.audio) if row.audios else []
        counts = processor.audio.audio_tokens(audios) if audios else []
        ids = processor.encode(text, images, pixels, videos, counts)
    except ConfigError as exc:
        raise ConfigError(key, exc.message) from None
    except ValueError as exc:
        raise ConfigError(key, f"{source}: {exc}") from None
    return text, ids, plans


def _log_summary(dataset: PromptDataset, prompt_length: int) -> None:
    for bad in dataset.bad_rows[:MAX_LOGGED_BAD_ROWS]:
        logger.warning("skipped bad prompt row %s", bad)
    if len(dataset.bad_rows) > MAX_LOGGED_BAD_ROWS:
        logger.warning(
            "skipped %d bad prompt rows in all (first %d shown)", len(dataset.bad_rows), MAX_LOGGED_BAD_ROWS
        )
    if dataset.too_long:
        shown = ", ".join(dataset.too_long[:MAX_LOGGED_TOO_LONG])
        more = f" (first {MAX_LOGGED_TOO_LONG} shown)" if len(dataset.too_long) > MAX_LOGGED_TOO_LONG else ""
        logger.warning(
            "dropped %d prompts longer than prompt_length=%d tokens: %s%s",
            len(dataset.too_long),
            prompt_length,
            shown,
            more,
        )
    logger.info(
        "loaded %d prompts (domains %s); dropped %d too long, skipped %d bad rows",
        len(dataset),
        dict(Counter(row.domain for row in dataset.rows)),
        dataset.num_too_long,
        len(dataset.bad_rows),
    )
