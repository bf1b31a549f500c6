"""What the Megatron Qwen2.5-VL tests share: a tiny Qwen2.5-VL checkpoint, a batch of image rows
(and a text row) with random responses, and transformers' response log-probs of it.

>>> model = save_tiny_vl(tmp_path / "model")
>>> batch = vl_batch(model, tmp_path)                 # prompts with images + responses, roll's layout
>>> want = hf_log_probs(model, batch)                 # [B, R] with transformers' 3-D rope positions
>>> batch = vl_video_batch(model, tmp_path)           # video rows (Video-R1's layout), image rows, a text row
>>> save_case(model, tmp_path)                        # batch.pt and want.pt (its hf_log_probs) in tmp_path
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from tiny_vl import VIDEO_ARGS, build_tiny_vl_dir, detection_rows, math_rows, video_r1_rows  # noqa: E402

from roll.configs.role import DataArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402
from roll.models.vision import (  # noqa: E402
    MULTI_MODAL_INPUTS,
    VisionProcessor,
    exclude_response_tokens,
    forward_kwargs,
    response_excluded_tokens,
    token_types,
)
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH = 48, 8
VIDEO_PROMPT_LENGTH = 600  # the tiny tokenizer spends ~530 tokens on Video-R1's template


def save_tiny_vl(path: Path) -> Path:
    """The tiny Qwen2.5-VL (tests/tiny_vl.py) with spread-out weights, so log-probs differ."""
    return build_tiny_vl_dir(path, seed=0, std=0.1)


def save_case(model: Path, scratch: Path, make_batch: Callable[[Path, Path], Batch] | None = None) -> Batch:
    """Writes ``make_batch(model, scratch)`` (default ``vl_batch``) to ``scratch / "batch.pt"`` and
    transformers' log-probs of it to ``scratch / "want.pt"``; returns the batch."""
    batch = (make_batch or vl_batch)(model, scratch)
    torch.save(batch, scratch / "batch.pt")
    torch.save(hf_log_probs(model, batch), scratch / "want.pt")
    return batch


def vl_batch(model: Path, scratch: Path, seed: int = 0) -> Batch:
    """Two detection rows and one counting row (images of different sizes) and one text row, each
    with a random response of 4..8 tokens and random advantages."""
    processor = VisionProcessor.load(str(model))
    rows = detection_rows(scratch / "images", 2) + math_rows(scratch / "images", 1)
    rows.append(
        {
            "data_source": "text",
            "prompt": [{"role": "user", "content": "What color is red?"}],
            "ground_truth": "red",
        }
    )
    out = _with_responses(rows_prompts(processor, scratch, rows), processor, seed)
    assert sum(1 for r in out[MULTI_MODAL_INPUTS] if r) == 3
    return out


def rows_prompts(processor: VisionProcessor, scratch: Path, rows: list[dict]) -> Batch:
    """The prompt Batch (``PROMPT_LENGTH`` wide) of ROLL-layout ``rows`` (``messages: prompt``), through
    ``scratch / "rows.jsonl"`` and roll's data path."""
    path = scratch / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data_args = DataArgs(file_name=[str(path)], messages="prompt")
    dataset = load_prompt_files(
        data_args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", processor
    )
    return to_batch(dataset.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)


def vl_video_batch(model: Path, scratch: Path, seed: int = 0) -> Batch:
    """Two Video-R1 rows (16 video tokens each: 8 frames at 4 fps, four temporal patches 0.5 s apart),
    a detection row, a counting row and a text row, with random responses (prompts of up to ``VIDEO_PROMPT_LENGTH``)."""
    processor = VisionProcessor.load(str(model))
    videos = scratch / "video_r1.jsonl"
    videos.write_text("".join(json.dumps(r) + "\n" for r in video_r1_rows(scratch / "videos", 2)))
    images = scratch / "image_rows.jsonl"
    rows = detection_rows(scratch / "images", 1) + math_rows(scratch / "images", 1)
    rows.append(
        {"data_source": "text", "prompt": [{"role": "user", "content": "Red?"}], "ground_truth": "red"}
    )
    images.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = []
    for args in (
        DataArgs(file_name=[str(videos)], row_layout="video_r1", **{**VIDEO_ARGS, "video_fps": 4.0}),
        DataArgs(file_name=[str(images)], messages="prompt"),
    ):
        loaded += load_prompt_files(
            args, processor.tokenizer, VIDEO_PROMPT_LENGTH, "actor_train.data_args", processor
        ).rows
    order = [0, 2, 1, 4, 3]  # video, image, video, text, image: the rows' grids interleave
    prompts = to_batch(
        [loaded[i] for i in order], processor.tokenizer.pad_token_id, VIDEO_PROMPT_LENGTH, processor
    )
    out = _with_responses(prompts, processor, seed)
    assert sum(1 for r in out[MULTI_MODAL_INPUTS] if r and "pixel_values_videos" in r) == 2
    return out


def _with_responses(prompts: Batch, processor: VisionProcessor, seed: int) -> Batch:
    """``prompts`` with a random response of 4..8 tokens each and random advantages."""
    gen = torch.Generator().manual_seed(seed)
    responses = [
        torch.randint(3, 300, (RESPONSE_LENGTH - i % 5,), generator=gen).tolist() for i in range(len(prompts))
    ]
    out = build_generation_batch(
        prompts, responses, None, 1, processor.tokenizer.pad_token_id, RESPONSE_LENGTH
    )
    out.tensors["advantages"] = torch.randn(len(out), RESPONSE_LENGTH, generator=gen)
    return out


def hf_log_probs(
    model: Path, batch: Batch, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.Tensor:
    """transformers' response log-probs [B, R] (0 at padding), with Qwen2.5-VL's 3-D rope positions
    (``mm_token_type_ids``, images and videos, makes transformers compute them) and the vision
    tokens excluded, as roll scores responses."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=dtype).to(device).eval()
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    kwargs = forward_kwargs(batch, device)
    with torch.no_grad():
        logits = hf(
            input_ids=ids, attention_mask=mask, mm_token_type_ids=token_types(ids, hf.config), **kwargs
        ).logits.float()
    logits = exclude_response_tokens(logits, response_excluded_tokens(hf.config))  # as roll scores them
    width = batch["responses"].shape[1]
    logps = torch.log_softmax(logits[:, -width - 1 : -1], dim=-1)
    logps = logps.gather(-1, batch["responses"].to(device).unsqueeze(-1)).squeeze(-1).cpu()
    return torch.where(batch["response_mask"].bool(), logps, torch.zeros_like(logps))
