"""Vision-language prompt rows: alibaba/ROLL's layout (One-RL-to-See-Them-All's Orsta-Data-47k),
read from parquet or JSONL.

    {"data_source": "v3det_train",                          # the tag, when the row has no "tag"
     "images": [{"bytes": b"...", "path": "a.png"}],         # or bytes, or a path (relative: to the file's directory, then the working directory)
     "prompt": [{"role": "user", "content": "<image>Find every cat."}],   # data_args.messages: prompt
     "reward_model": {"ground_truth": "<answer>[...]</answer>", "accuracy_ratio": 1.0,
                      "format_ratio": 0.1, "verifier_parm": {"det_verifier_normalized": true, ...}}}

Each ``<image>`` of the prompt is one image, in order; a prompt without any gets its images in front
of its first user message (as ROLL does for a prompt string). A row's ``reward_model`` options
(``verifier_parm``, ``accuracy_ratio``, ``format_ratio``) become its ``reward_context``, which a
reward that takes it (``detection``) reads along with the size of each image as the model saw it.

Images are decoded with PIL on the driver: once when the file is loaded (their token count decides
the prompt length) and again, for the rows of each step, when a batch is built (``vision_fields``),
so the decoded images and pixel values of the whole file are never held at once. An image that
cannot be read is one ``ConfigError`` naming the file, the row and the image.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from roll.configs.errors import ConfigError
from roll.core.batch import object_array
from roll.models.vision import MULTI_MODAL_DATA, MULTI_MODAL_INPUTS, VisionProcessor, pixel_kwargs
from roll.pipeline.rlvr.data.audio_files import audio_fields

REWARD_MODEL = "reward_model"
# A batch's prompt rows whose vision fields are built later (``with_vision_fields``): validation
# holds its rows' image bytes only, and decodes each chunk's images when it generates.
VISION_ROWS = "vision_rows"
CONTEXT_KEYS = ("verifier_parm", "accuracy_ratio", "format_ratio")


def iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    """(row number from 1, row as a dict) of a parquet file (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            "data_args.file_name", f"{path}: reading parquet needs pyarrow (pip install pyarrow)"
        ) from None
    try:
        reader = pq.ParquetFile(path)
        number = 0
        for chunk in reader.iter_batches(batch_size=256):
            for row in chunk.to_pylist():
                number += 1
                yield number, row
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors have many types; one message for all
        raise ConfigError("data_args.file_name", f"{path}: not a readable parquet file ({exc})") from None


def row_images(row: dict[str, Any], field: str) -> list[Any] | None:
    """The image references of a row (bytes or a path each), None when it has none; ValueError
    (the row is bad) for a field of the wrong shape."""
    images = row.get(field)
    if images is None:
        return None
    if not isinstance(images, list):
        images = [images]
    refs = []
    for i, image in enumerate(images):
        if isinstance(image, dict):
            image = image.get("bytes") or image.get("path")
        if not isinstance(image, (bytes, str)) or not image:
            raise ValueError(
                f"wrong type: {field}[{i}] must be image bytes, a path or a {{bytes, path}} record"
            )
        refs.append(image)
    return refs or None


def row_context(row: dict[str, Any]) -> dict[str, Any] | None:
    """The row's ``reward_model`` options a reward may read (see the module docstring)."""
    reward_model = row.get(REWARD_MODEL)
    if not isinstance(reward_model, dict):
        return None
    context = {k: reward_model[k] for k in CONTEXT_KEYS if reward_model.get(k) is not None}
    return context or None


def content_text(content: Any) -> Any:
    """A message's content as text: a list of parts (``{"type": "image"}``, ``{"type": "text",
    "text": ...}``) becomes the text with ``<image>`` for each image part (``<video>``, ``<audio>``
    likewise); anything else is kept."""
    if not isinstance(content, list):
        return content
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image", "video", "audio"):
            out.append(f"<{kind}>")
        elif kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        else:
            return content  # not parts: the message check names it
    return "".join(out)


def place_images(messages: list[dict[str, str]], count: int, kind: str = "image") -> list[dict[str, str]]:
    """``messages`` with ``count`` images (``kind="video"``: videos) placed: as they are when their
    ``<image>`` (``<video>``) marks number ``count``; in front of the first user message when they
    have none; ValueError otherwise."""
    mark = f"<{kind}>"
    marks = sum(m["content"].count(mark) for m in messages)
    if marks == count:
        return messages
    if marks:
        raise ValueError(f"the prompt has {marks} {mark} marks for {count} {kind}s")
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), 0)
    out = [dict(m) for m in messages]
    out[first]["content"] = mark * count + out[first]["content"]
    return out


def decode_image(ref: Any, base: Path, source: str, index: int) -> Any:
    """A PIL RGB image from bytes or a path (relative: to ``base``, then the working directory)."""
    from PIL import Image

    try:
        if isinstance(ref, bytes):
            image = Image.open(io.BytesIO(ref))
        else:
            path = base / ref if not Path(ref).is_absolute() and (base / ref).is_file() else Path(ref)
            image = Image.open(path)
        image.load()
        return image.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - PIL raises many types; one message naming the row
        what = f"{len(ref)} bytes" if isinstance(ref, bytes) else repr(ref)
        raise ConfigError(
            "data_args.file_name", f"{source}: image {index} ({what}) cannot be read: {exc}"
        ) from None


def decode_images(refs: Sequence[Any], source: str) -> list[Any]:
    """Every image of the row at ``source`` ("file:row")."""
    base = Path(source.rsplit(":", 1)[0]).parent
    return [decode_image(ref, base, source, i) for i, ref in enumerate(refs)]


def with_vision_fields(batch: Any, processor: VisionProcessor | None) -> Any:
    """``batch`` with the vision fields of its ``VISION_ROWS`` built (``vision_fields``); a batch
    without them as it is."""
    if processor is None or VISION_ROWS not in batch:
        return batch
    rows = list(batch.non_tensors.pop(VISION_ROWS))
    for key, values in vision_fields(rows, processor).items():
        batch.non_tensors[key] = object_array(values)
    return batch


def video_fields(row: Any, processor: VisionProcessor) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model inputs, engine data) of a row with videos: the sampled frames through the processor,
    and for vLLM the same frames ([frames, H, W, 3] uint8 each) with their metadata (their sampling
    fps, ``sampled_video_metadata``) and pixel area as ``mm_processor_kwargs``, so the engine
    neither resamples nor resizes them and lays their positions as roll does; for a model
    whose prompt holds each frame's time (``processor.timestamped_videos``, Qwen3-VL), each video
    with its metadata instead (``engine_video_metadata``) and no resize."""
    import numpy as np

    from roll.pipeline.rlvr.data.video import decode_video

    folder = row.video_options.folder
    videos = [
        decode_video(ref, row.source, i, folder, plan)
        for i, (ref, plan) in enumerate(zip(row.videos, row.video_plans))
    ]
    fps = [plan.fps for plan in row.video_plans]
    mm = processor.video_inputs(videos, fps)
    arrays = [np.stack([np.asarray(f) for f in frames]) for frames in videos]
    if processor.timestamped_videos:
        engine = {
            "video": [(a, engine_video_metadata(plan)) for a, plan in zip(arrays, row.video_plans)],
            "mm_processor_kwargs": {"do_resize": False},
        }
        return mm, engine
    width, height = videos[0][0].size
    engine = {
        "video": arrays,
        "mm_processor_kwargs": {
            "video_metadata": [sampled_video_metadata(len(a), f) for a, f in zip(arrays, fps, strict=True)],
            "min_pixels": height * width,
            "max_pixels": height * width,
        },
    }
    return mm, engine


def sampled_video_metadata(frames: int, fps: float) -> dict[str, Any]:
    """transformers' ``VideoMetadata`` of ``frames`` frames that roll sampled at ``fps``: its
    ``sampled_fps`` is ``fps``, so the processor's ``second_per_grid_ts`` (temporal_patch_size /
    sampled_fps) is the one roll's trainers use. Without metadata, transformers (5.17 to 5.24) takes
    24 fps for a video given as frames, whatever an ``fps`` option says, and vLLM passes none for
    Qwen2.5-VL: its rope positions then put a video's temporal patches 12 times closer (at 2 fps)
    than roll's trainers did."""
    return {"total_num_frames": frames, "fps": float(fps), "frames_indices": list(range(frames))}


def engine_video_metadata(plan: Any) -> dict[str, Any]:
    """vLLM's metadata of a video whose frames roll sampled (a ``FramePlan``): the sampled frames'
    indices and the video's own rate, from which vLLM's Qwen3-VL processing writes each temporal
    patch's time as roll's prompt does; ``do_sample_frames: False`` keeps the frames as sent."""
    return {
        "fps": plan.rate,
        "frames_indices": list(plan.indices),
        "total_num_frames": plan.total,
        "duration": plan.total / plan.rate,
        "do_sample_frames": False,
    }


def vision_fields(rows: Sequence[Any], processor: VisionProcessor) -> dict[str, list[Any]]:
    """The per-row non-tensor fields of a VL batch: ``multi_modal_inputs`` (pixel values and image
    grid; audio features, ``roll.pipeline.rlvr.data.audio``), ``multi_modal_data`` (the images, for
    vLLM, with ``mm_processor_kwargs`` holding the file's ``image_min/max_pixels`` where set, so the
    engine resizes alike; the audio waveforms) and ``reward_context`` (the row's options with
    ``image_sizes``); None entries for a text row."""
    inputs, data, contexts = [], [], []
    for row in rows:
        context = dict(row.reward_context or {})
        mm: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        if row.videos:
            mm, engine = video_fields(row, processor)
        elif row.images:
            images = decode_images(row.images, row.source)
            mm = processor.image_inputs(images, row.pixels)
            engine = {"image": images}
            if pixel_kwargs(row.pixels):
                engine["mm_processor_kwargs"] = pixel_kwargs(row.pixels)
            context["image_sizes"] = processor.image_sizes(mm["image_grid_thw"])
        if getattr(row, "audios", None):
            audio_mm, audio_engine = audio_fields(row, processor.audio)
            mm, engine = {**mm, **audio_mm}, {**engine, **audio_engine}
        inputs.append(mm or None)
        data.append(engine or None)
        contexts.append(context or None)
    return {MULTI_MODAL_INPUTS: inputs, MULTI_MODAL_DATA: data, "reward_context": contexts}
