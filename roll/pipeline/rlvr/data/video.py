"""Video prompt rows: alibaba/ROLL's Video-R1 layout, and the frames of a video as the model sees them.

    {"problem": "Why does the video end on a red screen? Options:\\nA. ...", "problem_type": "multiple choice",
     "solution": "<answer>A</answer>", "video": "videos/ytb_HBxn56l9WcU.mp4", "modality_type": "video"}

``data_args.row_layout: video_r1`` (what ROLL's ``custom_data_kwargs_func: ...video_r1_get_data_kwargs``
maps to) reads such rows: the prompt is the problem in Video-R1's question template with the
answer-type instruction after it, after the video (ROLL's ``video_r1_format_prompt``); the ground
truth is ``solution``, the tag ``modality_type``, and ``problem_type`` goes to the row's
``reward_context`` for the ``video_r1`` reward. A row of the default layout may carry videos too
(``data_args.video``, default ``video``: a path or a list of paths, ``<video>`` marks in the prompt
like ``<image>``).

Frames (Qwen's ``qwen_vl_utils.fetch_video``, which ROLL calls): ``round(frames / video fps *
video_fps)`` frames, at least 4, at most ``video_max_frames`` and the video's own count, rounded to
an even number, evenly spaced from the first frame to the last; each resized to the same multiple
of the model's merged patch (28 pixels for Qwen2.5-VL, 32 for Qwen3-VL: ``factor``) by Qwen's
``smart_resize`` within ``video_min_pixels`` and ``min(video_max_pixels, video_total_pixels / frames
* 2)`` (unset: Qwen's token counts times ``factor**2``, as qwen_vl_utils scales them). The plan keeps
the video's own rate too: Qwen3-VL's prompt writes each temporal patch's time, ``index / rate``. Decoded with PyAV (``pip install -e .[vision]``): probed for the
frame count and size when the file is loaded (they decide the prompt length; the row keeps the
plan), and its planned frames decoded when a batch is built. A relative path is looked up under ``video_folder``, then beside the data
file, then from the working directory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError
from roll.pipeline.rlvr.data.fields import row_files

# Qwen's qwen_vl_utils defaults (used where data_args leaves a key unset): frames, and merged
# patches (tokens) per frame / per video, times factor**2 pixels each.
FPS, FPS_MIN_FRAMES, FPS_MAX_FRAMES = 2.0, 4, 768
VIDEO_MIN_TOKENS, VIDEO_MAX_TOKENS, VIDEO_TOTAL_TOKENS = 128, 768, 128000 * 0.9
FRAME_FACTOR, IMAGE_FACTOR = 2, 28
VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS, VIDEO_TOTAL_PIXELS = (
    VIDEO_MIN_TOKENS * IMAGE_FACTOR**2,
    VIDEO_MAX_TOKENS * IMAGE_FACTOR**2,
    int(VIDEO_TOTAL_TOKENS * IMAGE_FACTOR**2),
)

# Video-R1's prompt (tulerfeng/Video-R1, as ROLL's vlm_dataset_utils writes it).
QUESTION_TEMPLATE = (
    "{Question}\n"
    "Please think about this question as if you were a human pondering deeply. "
    "Engage in an internal dialogue using expressions such as 'let me think', 'wait', 'Hmm', 'oh, I see', "
    "'let's break it down', etc, or other natural language thought expressions "
    "It's encouraged to include self-reflection or verification in the reasoning process. "
    "Provide your detailed reasoning between the <think> </think> tags, and then give your final answer "
    "between the <answer> </answer> tags."
)
TYPE_TEMPLATE = {
    "multiple choice": " Please provide only the single option letter (e.g., A, B, C, D, etc.) within the "
    "<answer> </answer> tags.",
    "numerical": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
    "OCR": " Please transcribe text from the image/video clearly and provide your text answer within the "
    "<answer> </answer> tags.",
    "free-form": " Please provide your text answer within the <answer> </answer> tags.",
    "regression": " Please provide the numerical value (e.g., 42 or 3.14) within the <answer> </answer> tags.",
}


@dataclass(frozen=True)
class VideoOptions:
    """A file's frame sampling (``data_args.video_*``, ROLL's keys; None: Qwen's defaults above)."""

    fps: float | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    folder: str | None = None

    @classmethod
    def of(cls, data_args: Any) -> VideoOptions:
        return cls(
            data_args.video_fps,
            data_args.video_max_frames,
            data_args.video_min_pixels,
            data_args.video_max_pixels,
            data_args.video_total_pixels,
            data_args.video_folder,
        )


@dataclass(frozen=True)
class FramePlan:
    """Which frames of a video the model sees, at what size, and at what rate."""

    indices: tuple[int, ...]
    height: int
    width: int
    fps: float  # frames sampled per second of video (second_per_grid_ts = 2 / fps)
    rate: float = FPS  # the video's own frames per second (Qwen3-VL's timestamps: index / rate)
    total: int = 0  # the video's frame count


def video_r1_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """A Video-R1 row's prompt as one user message (its video, or images, are placed in front of it
    by the reader, as ROLL's template puts the media first); ValueError naming what is missing."""
    problem, kind = row.get("problem"), row.get("problem_type")
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError("missing field: 'problem' (a Video-R1 row's question)")
    if kind not in TYPE_TEMPLATE:
        raise ValueError(f"wrong value: problem_type {kind!r}; one of {', '.join(TYPE_TEMPLATE)}")
    return [{"role": "user", "content": QUESTION_TEMPLATE.format(Question=problem) + TYPE_TEMPLATE[kind]}]


def row_videos(row: dict[str, Any], field: str) -> list[str] | None:
    """A row's video paths, None when it has none; ValueError for a field of the wrong shape."""
    return row_files(row, field, "a video path")


def smart_resize(
    height: int, width: int, min_pixels: int, max_pixels: int, factor: int = IMAGE_FACTOR
) -> tuple[int, int]:
    """Qwen's resize target: both sides multiples of ``factor``, the area within the bounds, the
    aspect ratio kept as well as that allows."""
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = (
            max(factor, math.floor(height / beta / factor) * factor),
            max(factor, math.floor(width / beta / factor) * factor),
        )
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def frame_plan(
    total: int, video_fps: float, height: int, width: int, options: VideoOptions, factor: int = IMAGE_FACTOR
) -> FramePlan:
    """The frames to sample of a video of ``total`` frames at ``video_fps``, resized to multiples of
    ``factor`` pixels (module docstring)."""
    fps = options.fps or FPS
    max_frames = min(options.max_frames or FPS_MAX_FRAMES, total)
    max_frames = max(FRAME_FACTOR, max_frames // FRAME_FACTOR * FRAME_FACTOR)
    count = total / max(video_fps, 1e-6) * fps
    count = min(max(count, FPS_MIN_FRAMES), max_frames)
    count = max(FRAME_FACTOR, round(count / FRAME_FACTOR) * FRAME_FACTOR)
    step = (total - 1) / (count - 1) if count > 1 else 0.0
    indices = tuple(min(total - 1, round(i * step)) for i in range(count))
    min_pixels = options.min_pixels or VIDEO_MIN_TOKENS * factor**2
    total_pixels = options.total_pixels or int(VIDEO_TOTAL_TOKENS * factor**2)
    max_pixels = max(
        min(options.max_pixels or VIDEO_MAX_TOKENS * factor**2, total_pixels / count * FRAME_FACTOR),
        int(min_pixels * 1.05),
    )
    h, w = smart_resize(height, width, min_pixels, max_pixels, factor)
    return FramePlan(indices, h, w, count / max(total, 1e-6) * video_fps, video_fps, total)


def video_path(ref: str, source: str, folder: str | None) -> Path:
    """Where a video of the row at ``source`` ("file:row") is: under ``folder``, beside the data file,
    else as given."""
    path = Path(ref)
    if path.is_absolute():
        return path
    for base in (Path(folder) if folder else None, Path(source.rsplit(":", 1)[0]).parent):
        if base is not None and (base / ref).is_file():
            return base / ref
    return path


def _open(path: Path, source: str, index: int) -> Any:
    try:
        import av
    except ImportError:
        raise ConfigError(
            "data_args.file_name", f"{source}: reading videos needs PyAV (pip install av)"
        ) from None
    try:
        return av.open(str(path))
    except Exception as exc:  # noqa: BLE001 - PyAV raises many types; one message naming the row
        raise ConfigError(
            "data_args.file_name", f"{source}: video {index} ({str(path)!r}) cannot be read: {exc}"
        ) from None


def probe_video(
    ref: str, source: str, index: int, options: VideoOptions, factor: int = IMAGE_FACTOR
) -> FramePlan:
    """The frame plan of a video, from its frame count, rate and size (every frame is demuxed, none
    decoded, when the container does not store the count); frames resized to multiples of ``factor``."""
    with _open(video_path(ref, source, options.folder), source, index) as container:
        stream = container.streams.video[0]
        total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        rate = float(stream.average_rate or 0) or FPS
        if total < 1:
            raise ConfigError("data_args.file_name", f"{source}: video {index} ({ref!r}) has no frames")
        return frame_plan(total, rate, stream.height, stream.width, options, factor)


def decode_video(ref: str, source: str, index: int, folder: str | None, plan: FramePlan) -> list[Any]:
    """The frames of ``plan`` (``probe_video``'s, made when the file was loaded) as RGB PIL images of
    the plan's size."""
    wanted: dict[int, int] = {}
    for i in plan.indices:
        wanted[i] = wanted.get(i, 0) + 1
    frames = []
    with _open(video_path(ref, source, folder), source, index) as container:
        for number, frame in enumerate(container.decode(video=0)):
            if number in wanted:
                image = frame.to_image().convert("RGB").resize((plan.width, plan.height), resample=3)
                frames += [image] * wanted[number]
            if number >= plan.indices[-1]:
                break
    if len(frames) != len(plan.indices):
        raise ConfigError(
            "data_args.file_name",
            f"{source}: video {index} ({ref!r}) decoded {len(frames)} of its {len(plan.indices)} sampled frames",
        )
    return frames


def read_video_r1_row(row: Any, default_tag: str) -> tuple[list[dict[str, str]], str, str, dict[str, Any]]:
    """(messages, ground truth, tag, reward context) of a Video-R1 row; ValueError when it is bad."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    messages = video_r1_messages(row)
    truth = row.get("solution")
    if not isinstance(truth, (str, int, float)) or isinstance(truth, bool) or str(truth) == "":
        raise ValueError("missing field: 'solution' (a Video-R1 row's answer)")
    tag = row.get("modality_type") or default_tag
    if not isinstance(tag, str):
        raise ValueError("wrong type: field 'modality_type' must be a string")
    return messages, str(truth), tag, {"problem_type": row["problem_type"]}
