"""The images of a vision-language prompt as an engine takes them (no engine needed; tested on CPU).

vLLM (0.24) takes a token prompt with images as ``{"prompt_token_ids": ids, "multi_modal_data":
{"image": [PIL images]}}`` where each image is ONE image token: its multimodal processor resizes the
images with the model directory's image processor (as roll's data loader did) and expands each token
to the image's patch count itself. roll's prompt rows hold the expanded ids (what the trainer sees),
so the engine's prompt collapses each run of image tokens back to one::

    tokens = vision_tokens(model_dir)                     # config.json's image/video tokens (None: text)
    prompts = vllm_prompts(batch, prompt_token_lists(batch), tokens.image, tokens.video)  # a dict per row

Videos go the same way: ``{"video": [frames [T, H, W, 3] uint8]}`` with each run of video tokens
collapsed to one, and ``mm_processor_kwargs`` holding the frames' ``video_metadata`` (their sampling
fps, from which the processor computes ``second_per_grid_ts`` and vLLM the temporal rope positions)
and their pixel area as ``min_pixels``/``max_pixels``, so the engine keeps roll's frames as they are
(``roll.pipeline.rlvr.data.vision.video_fields``). A model whose prompt
writes a video frame by frame with timestamps (Qwen3-VL: ``roll.models.video_prompt``) gets each such
video's frames back as ``<|vision_start|><|video_pad|><|vision_end|>`` inside the video's outer start
and end, and the frames with their metadata (``(frames, {"fps", "frames_indices", ...})``), from which
vLLM writes the same timestamps and tokens.

Audios (Qwen3-Omni's thinker): ``{"audio": [float32 waveforms at 16 kHz]}``, each run of
``<|audio_pad|>`` collapsed to one; vLLM's thinker pads each waveform to whole hops and runs the
model directory's feature extractor, which roll's data path did on the same hop-padded waveform
(``roll.models.audio``), so both count the same audio tokens.

The engine's outputs are the responses only; the Batch keeps roll's expanded prompt ids, so the
trainer and the reference score the same tokens the engine conditioned on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from roll.core.batch import Batch
from roll.models.model_dir import config_json
from roll.models.video_prompt import TIMESTAMPED_VIDEO_MODEL_TYPES, collapse_timestamped_videos
from roll.models.vision import (
    MULTI_MODAL_DATA,
    collapse_image_tokens,
    is_vision_config,
    multimodal_config,
    response_excluded_tokens,
)

EXCLUDED_BIAS = -1.0e4


@dataclass(frozen=True)
class VisionTokens:
    """A model directory's vision tokens as the engine needs them (all None / {} for a text model):
    the image and video tokens (config.json's ``image_token_id`` / ``video_token_id``) and vLLM's
    ``logit_bias`` keeping the vision tokens out of responses, as roll's forward scores them
    (``roll.models.vision.response_excluded_tokens``): a large finite bias (exp underflows to 0),
    not -inf, which the engine would carry into its processed log-probs."""

    image: int | None = None
    video: int | None = None
    bias: dict[int, float] = field(default_factory=dict)
    # (vision start, vision end) of a model writing videos frame by frame (Qwen3-VL); None: one run.
    frames: tuple[int, int] | None = None
    audio: int | None = None  # the audio token (Qwen3-Omni's thinker_config.audio_token_id)
    model_type: str | None = None  # config.json's (None for a text model)


def vision_tokens(model_dir: str | None) -> VisionTokens:
    """The ``VisionTokens`` of a model directory, from one read of its config.json."""
    config = config_json(model_dir)
    if not is_vision_config(config):
        return VisionTokens()
    bias = {token: EXCLUDED_BIAS for token in response_excluded_tokens(config)}
    frames = None
    if config.get("model_type") in TIMESTAMPED_VIDEO_MODEL_TYPES:
        frames = (config.get("vision_start_token_id"), config.get("vision_end_token_id"))
    tokens = multimodal_config(config)  # Qwen3-Omni keeps its token ids in thinker_config
    return VisionTokens(
        tokens.get("image_token_id"),
        tokens.get("video_token_id"),
        bias,
        frames,
        tokens.get("audio_token_id"),
        config.get("model_type"),
    )


def vllm_prompts(
    batch: Batch,
    prompts: Sequence[Sequence[int]],
    image_token: int | None,
    video_token: int | None = None,
    frames: tuple[int, int] | None = None,
    audio_token: int | None = None,
) -> list[Any] | None:
    """Per row, vLLM's prompt with the row's images, videos or audios (text rows: their ids as they
    are); None when the batch carries none, so the caller keeps its text path unchanged. ``frames``:
    the vision start and end of a model writing videos frame by frame (``VisionTokens.frames``);
    ``audio_token``: a model with an audio tower (each audio's run of tokens collapsed to one, the
    waveforms as ``{"audio": [...]}``)."""
    if MULTI_MODAL_DATA not in batch or not any(batch[MULTI_MODAL_DATA]):
        return None
    if image_token is None:
        raise ValueError(
            "the prompts carry images but the engine's model has no image token (not a VL model)"
        )
    out: list[Any] = []
    for ids, data in zip(prompts, batch[MULTI_MODAL_DATA], strict=True):
        if not data:
            out.append(list(ids))
            continue
        if frames is not None and video_token is not None:
            ids = collapse_timestamped_videos(ids, video_token, *frames)
        collapsed = collapse_image_tokens(ids, image_token, video_token, audio_token)
        items = {}
        for kind, token in (("image", image_token), ("video", video_token), ("audio", audio_token)):
            values = list(data.get(kind) or [])
            runs = collapsed.count(token) if token is not None else 0
            if runs != len(values):
                raise ValueError(f"a prompt has {runs} {kind} token runs for {len(values)} {kind}s")
            if values:
                items[kind] = values
        prompt = {"prompt_token_ids": collapsed, "multi_modal_data": items}
        if data.get("mm_processor_kwargs"):  # the file's image_min/max_pixels: vLLM resizes alike
            prompt["mm_processor_kwargs"] = dict(data["mm_processor_kwargs"])
            if "video_metadata" in prompt["mm_processor_kwargs"] and len(items.get("video", ())) > 1:
                prompt["multi_modal_uuids"] = {"video": row_video_ids(items["video"])}
        out.append(prompt)
    return out


def row_video_ids(videos: Sequence[Any]) -> list[str]:
    """vLLM cache ids for the videos of one row that has several, whose ``mm_processor_kwargs``
    list a metadata per video: the digest of all the row's frames, and each video's index. vLLM
    runs its processor on only the videos its processor cache misses, with the row's whole
    ``mm_processor_kwargs``; a row sharing a video and the options with an earlier row would hand
    transformers fewer videos than metadata (a ValueError on fps and video_grid_thw lengths). With
    ids of the row as a whole its videos hit or miss the cache together."""
    digest = hashlib.blake2b(digest_size=16)
    for frames in videos:
        array = np.ascontiguousarray(frames)
        digest.update(f"{array.shape}{array.dtype}".encode())
        digest.update(memoryview(array).cast("B"))
    return [f"roll-video-{digest.hexdigest()}-{i}" for i in range(len(videos))]
