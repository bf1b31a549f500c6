"""How a video is written into a prompt: one run of video tokens (Qwen2-VL, Qwen2.5-VL), or frame by
frame with timestamps (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5: transformers' ``Qwen3VLProcessor``).

Qwen3-VL's processor writes each temporal patch (two sampled frames) of a video as its time, then
its own vision start, video tokens and vision end, in place of the chat template's one
``<|video_pad|>`` (which keeps the template's vision start and end around it)::

    <|vision_start|><0.5 seconds><|vision_start|><|video_pad|>*n<|vision_end|><1.5 seconds>...<|vision_end|><|vision_end|>

the time being the mean of the patch's two frames' ``index / video fps`` (the video's own rate,
not the sampling rate). Its rope index then takes each temporal patch as an image of its own
(``get_rope_index`` splits ``video_grid_thw`` into ``[1, h, w]`` per patch), and its forward takes
no ``second_per_grid_ts``.

roll writes that text with transformers' own ``Qwen3VLProcessor.replace_video_token`` (given the
grid and the frames' indices and rate), without building the processor, whose video processor
needs torchvision. vLLM takes such a prompt with each video's frames back as one
``<|vision_start|><|video_pad|><|vision_end|>`` (``collapse_timestamped_videos``) and the frames with
their metadata, and writes the same tokens itself. vLLM 0.24 replaces that whole placeholder with the
frames (each with its own vision start and end), where transformers keeps the template's start and end
around them, so the placeholder is sent inside the video's outer start and end, which vLLM keeps: the
engine's prompt is then roll's, token for token.

>>> timestamped_video_text([2, 4, 4], [0, 2, 5, 7], 4.0, merge_size=2, temporal_patch_size=2)
'<0.2 seconds><|vision_start|><|video_pad|>...<|vision_end|><1.5 seconds><|vision_start|>...<|vision_end|>'
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from types import SimpleNamespace

import torch

# Model types (config.json) whose processor is transformers' Qwen3VLProcessor: videos frame by frame.
TIMESTAMPED_VIDEO_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
VISION_START, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"


def timestamped_video_text(
    grid: Sequence[int], indices: Sequence[int], rate: float, merge_size: int, temporal_patch_size: int
) -> str:
    """The text one video's ``<|video_pad|>`` becomes in Qwen3-VL's prompt: transformers'
    ``Qwen3VLProcessor.replace_video_token`` for a video of ``grid`` ([t, h, w] patches) whose
    sampled frames are ``indices`` of a video at ``rate`` frames per second."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    # replace_video_token reads only these of the processor (transformers 5.17 to 5.24).
    host = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=merge_size, temporal_patch_size=temporal_patch_size),
        video_token=VIDEO_PAD,
        vision_start_token=VISION_START,
        vision_end_token=VISION_END,
    )
    host._calculate_timestamps = partial(Qwen3VLProcessor._calculate_timestamps, host)
    metadata = VideoMetadata(total_num_frames=max(indices) + 1, fps=float(rate), frames_indices=list(indices))
    inputs = {"video_grid_thw": torch.tensor([list(grid)]), "video_metadata": [metadata]}
    return Qwen3VLProcessor.replace_video_token(host, inputs, 0)


def collapse_timestamped_videos(ids: Sequence[int], video: int, start: int, end: int) -> list[int]:
    """``ids`` with each video written frame by frame (``start`` [time] ``start`` ``video``... ``end``
    per temporal patch, then ``end``) as ``start start video end end``: the prompt as vLLM takes it,
    which writes the frames again from the video's metadata in place of the inner ``start video end``
    (see the module docstring). Other tokens are kept."""
    out: list[int] = []
    i = 0
    while i < len(ids):
        stop = _video_end(ids, i, video, start, end) if ids[i] == start else None
        if stop is None:
            out.append(int(ids[i]))
            i += 1
        else:
            out += [start, start, video, end, end]
            i = stop
    return out


def _video_end(ids: Sequence[int], i: int, video: int, start: int, end: int) -> int | None:
    """Where the video written frame by frame from ``ids[i]`` (its outer ``start``) ends (the index
    after its outer ``end``); None when no such video starts there."""
    marks = (video, start, end)
    j, frames = i + 1, 0
    while True:
        while j < len(ids) and ids[j] not in marks:  # the patch's time, as text tokens
            j += 1
        if j == len(ids) or ids[j] != start or j + 1 == len(ids) or ids[j + 1] != video:
            return None
        j += 1
        while j < len(ids) and ids[j] == video:
            j += 1
        if j == len(ids) or ids[j] != end:
            return None
        frames, j = frames + 1, j + 1
        if j < len(ids) and ids[j] == end:
            return j + 1 if frames else None
