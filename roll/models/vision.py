"""Vision-language models (Qwen2.5-VL): the prompt's images turned into model inputs, and those
inputs carried by a Batch.

    processor = VisionProcessor.load("models/qwen2.5-vl-3b")       # tokenizer + image processor
    text = with_image_tokens(chat_text)                            # <image> -> one image token each
    ids = processor.encode(text, images)                           # image tokens expanded
    inputs = processor.image_inputs(images)                        # per batch, when it is built
    inputs["pixel_values"].shape, inputs["image_grid_thw"]          # [patches, C*14*14*2], [images, 3]

A prompt row's vision inputs ride in the Batch as the per-row non-tensor ``multi_modal_inputs``:
a dict ``{"pixel_values": [patches_i, D], "image_grid_thw": [images_i, 3]}`` per row, None for a
text row, so rows of any image count and size stay separate through ``index``/``concat``/Ray and
are concatenated only for a forward (``forward_kwargs``). The engines get the images themselves
(``multi_modal_data``: ``{"image": [PIL images]}`` per row) with the prompt's image tokens not
expanded (``collapse_image_tokens``): vLLM expands them itself.

What the model computes itself: given ``image_grid_thw`` and the attention mask, transformers'
Qwen2.5-VL computes its 3-D multimodal rope positions, so a vision forward passes no position ids
and runs on padded rows (no sequence packing, no Ulysses; ``check_vision_options``).

roll calls the model directory's image processor (``AutoImageProcessor``) and expands the image
tokens itself, as ``Qwen2_5_VLProcessor`` does (one ``<|image_pad|>`` becomes
``grid_t * grid_h * grid_w / merge_size**2`` of them): ``AutoProcessor`` would also build the video
processor, which needs torchvision.

Videos (``<video>`` in the prompt, one ``<|video_pad|>`` each) are sampled frames of one size
(``roll.pipeline.rlvr.data.video``); ``video_inputs`` runs the same image processor on each frame
and pairs consecutive frames into one temporal patch, which is the layout of Qwen2-VL's and
Qwen3-VL's video processors (``pixel_values_videos`` [patches, C*2*p*p], ``video_grid_thw``
[frames / 2, h, w]), without their torchvision dependency; ``second_per_grid_ts`` (Qwen2.5-VL only)
is 2 / the sampling fps. ``video_text`` is what one ``<|video_pad|>`` becomes: a run of video tokens,
or for Qwen3-VL's processor a timestamp and tokens per temporal patch (``roll.models.video_prompt``).

The 3-D rope positions: transformers (5.x) computes them only when the forward also gets
``mm_token_type_ids`` (1 at image tokens, 2 at video tokens; ``token_types``), which the HF
processor returns and roll builds from the ids; without them the model falls back to 1-D positions.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from roll.configs.errors import ConfigError
from roll.models.audio import (
    AUDIO_END,
    AUDIO_INPUT_KEYS,
    AUDIO_PAD,
    AUDIO_PLACEHOLDER,
    AUDIO_START,
    AudioProcessor,
    concat_audio_inputs,
)
from roll.models.model_dir import config_json
from roll.models.video_prompt import TIMESTAMPED_VIDEO_MODEL_TYPES, timestamped_video_text

# alibaba/ROLL's (and Orsta-Data-47k's) image placeholder in prompt text.
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"  # one video of a prompt (ROLL's {"type": "video"} part)
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
# The forward's keyword tensors of a row's vision inputs, concatenated over rows in row order.
VISION_INPUT_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)
MULTI_MODAL_INPUTS = "multi_modal_inputs"  # per-row model inputs (the trainer's, hf_infer's)
MULTI_MODAL_DATA = "multi_modal_data"  # per-row images for an engine (vLLM)
# The vision-language model types roll has run (CPU tests; docs/vision_language.md).
VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_omni_moe")
# Vision-language model types roll knows but does not run yet, and why (the launch check's line).
UNRUN_VISION_MODEL_TYPES: dict[str, str] = {}


# (min_pixels, max_pixels) of an image's resize; None (or a None bound): the image processor's.
PixelBounds = tuple[int | None, int | None] | None


def pixel_kwargs(pixels: PixelBounds) -> dict[str, int]:
    """``pixels`` as the ``min_pixels``/``max_pixels`` keywords vLLM's Qwen2-VL processing reads
    from a prompt's ``mm_processor_kwargs``; {} for the processor's own bounds."""
    if pixels is None:
        return {}
    return {k: b for k, b in zip(("min_pixels", "max_pixels"), pixels) if b is not None}


def multimodal_config(config: Any) -> Any:
    """The part of a model config (config.json's dict or a transformers config) that holds the
    vision config and the image token ids: Qwen3-Omni's ``thinker_config``, else the config itself."""
    inner = (
        config.get("thinker_config") if isinstance(config, dict) else getattr(config, "thinker_config", None)
    )
    return config if inner is None else inner


def is_vision_config(config: Any) -> bool:
    """Whether a model config (a dict from config.json, or a transformers config) has a vision tower."""
    config = multimodal_config(config)
    if isinstance(config, dict):
        return isinstance(config.get("vision_config"), dict)
    return getattr(config, "vision_config", None) is not None


def is_vision_model_dir(path: str | None) -> bool:
    """Whether the model directory's config.json describes a vision-language model."""
    return is_vision_config(config_json(path))


@dataclass
class VisionProcessor:
    """The model's tokenizer and image processor, and how one image becomes image tokens."""

    tokenizer: Any
    image_processor: Any
    image_token_id: int
    merge_size: int
    patch_size: int
    video_token_id: int | None = None  # None: the tokenizer has no <|video_pad|>
    temporal_patch_size: int = 2
    # Videos written frame by frame with timestamps (Qwen3-VL's processor; roll.models.video_prompt).
    timestamped_videos: bool = False
    audio: AudioProcessor | None = None  # a model with an audio tower (Qwen3-Omni): roll.models.audio

    @classmethod
    def load(cls, path: str, trust_remote_code: bool = False) -> VisionProcessor:
        from transformers import AutoImageProcessor

        from roll.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path, trust_remote_code)
        try:
            image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                "model_args.model_name_or_path", f"cannot load the image processor of {path!r}: {exc}"
            ) from exc
        token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ConfigError(
                "model_args.model_name_or_path", f"the tokenizer of {path!r} has no {IMAGE_PAD} token"
            )
        video_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
        try:
            audio = AudioProcessor.load(path, tokenizer, config_json(path))
        except ValueError as exc:
            raise ConfigError("model_args.model_name_or_path", str(exc)) from None
        return cls(
            tokenizer,
            image_processor,
            token_id,
            int(image_processor.merge_size),
            int(image_processor.patch_size),
            None if video_id is None or video_id == tokenizer.unk_token_id else int(video_id),
            int(getattr(image_processor, "temporal_patch_size", 2) or 2),
            config_json(path).get("model_type") in TIMESTAMPED_VIDEO_MODEL_TYPES,
            audio,
        )

    def image_inputs(self, images: Sequence[Any], pixels: PixelBounds = None) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` of ``images``, resized within ``pixels`` ((min,
        max) pixel counts; None or a None bound: the processor's own)."""
        kwargs = {}
        if pixels is not None and any(b is not None for b in pixels):
            size = dict(self.image_processor.size)
            size.update({k: b for k, b in zip(("shortest_edge", "longest_edge"), pixels) if b is not None})
            kwargs["size"] = size
        out = self.image_processor(images=list(images), return_tensors="pt", **kwargs)
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def image_tokens(self, images: Sequence[Any], pixels: PixelBounds = None) -> list[int]:
        """How many image tokens each image becomes: from its size alone where the image processor
        can say (``get_number_of_image_patches``, as vLLM asks it), else by processing it."""
        count = getattr(self.image_processor, "get_number_of_image_patches", None)
        if count is None:
            grids = self.image_inputs(images, pixels)["image_grid_thw"]
            return [int(g.prod()) // self.merge_size**2 for g in grids]
        kwargs = pixel_kwargs(pixels)
        return [count(image.height, image.width, kwargs) // self.merge_size**2 for image in images]

    def video_inputs(self, videos: Sequence[Sequence[Any]], fps: Sequence[float]) -> dict[str, torch.Tensor]:
        """``pixel_values_videos``, ``video_grid_thw`` and (not for ``timestamped_videos``, whose
        times are in the prompt) ``second_per_grid_ts`` of ``videos`` (each a list of PIL frames of
        one size, an even count), sampled at ``fps`` frames per second."""
        values, grids = [], []
        for frames in videos:
            if not frames or len(frames) % self.temporal_patch_size:
                raise ValueError(
                    f"a video needs a multiple of {self.temporal_patch_size} frames, got {len(frames)}"
                )
            width, height = frames[0].size
            bound = (height * width, height * width)  # frames come resized: the processor keeps them
            out = self.image_inputs(frames, bound)
            grid = out["image_grid_thw"][0]
            tp, p = self.temporal_patch_size, self.patch_size
            # [frames, patches, C, tp, p, p], the tp copies of a frame alike: keep one copy and put
            # each pair of consecutive frames in its place: [frames / tp, patches, C, tp, p, p]
            pv = out["pixel_values"].reshape(len(frames), int(grid.prod()), -1, tp, p, p)[:, :, :, 0]
            pv = pv.reshape(len(frames) // tp, tp, *pv.shape[1:]).permute(0, 2, 3, 1, 4, 5)
            values.append(pv.reshape(-1, out["pixel_values"].shape[1]))
            grids.append([len(frames) // self.temporal_patch_size, int(grid[1]), int(grid[2])])
        out = {
            "pixel_values_videos": torch.cat(values),
            "video_grid_thw": torch.tensor(grids, dtype=torch.long),
        }
        if not self.timestamped_videos:
            out["second_per_grid_ts"] = torch.tensor(
                [self.temporal_patch_size / f for f in fps], dtype=torch.float32
            )
        return out

    def video_tokens(self, frame_count: int, height: int, width: int) -> int:
        """How many video tokens a video of ``frame_count`` frames of ``height`` x ``width`` (already
        resized to multiples of patch_size * merge_size) becomes."""
        unit = self.patch_size * self.merge_size
        return frame_count // self.temporal_patch_size * (height // unit) * (width // unit)

    def video_text(self, indices: Sequence[int], rate: float, height: int, width: int) -> str:
        """What one video's ``<|video_pad|>`` becomes in the prompt: its ``video_tokens``, or for
        ``timestamped_videos`` Qwen3-VL's timestamp and tokens per temporal patch, from the sampled
        frames' ``indices`` in the video and its own ``rate`` (frames per second)."""
        count = self.video_tokens(len(indices), height, width)
        if not self.timestamped_videos:
            return VIDEO_PAD * count
        grid = [len(indices) // self.temporal_patch_size, height // self.patch_size, width // self.patch_size]
        return timestamped_video_text(grid, indices, rate, self.merge_size, self.temporal_patch_size)

    def encode(
        self,
        text: str,
        images: Sequence[Any],
        pixels: PixelBounds = None,
        video_texts: Sequence[str] = (),
        audio_tokens: Sequence[int] = (),
    ) -> list[int]:
        """Token ids of ``text`` with each image's ``<|image_pad|>`` expanded to its token count,
        each video's ``<|video_pad|>`` replaced by its ``video_text`` (``video_texts``: per video)
        and each audio's ``<|audio_pad|>`` expanded to its count (``audio_tokens``: per audio)."""
        expanded = _expand(text, IMAGE_PAD, self.image_tokens(images, pixels) if images else [], "image")
        if audio_tokens or AUDIO_PAD in expanded:
            expanded = _expand(expanded, AUDIO_PAD, list(audio_tokens), "audio")
        if video_texts or (VIDEO_PAD in expanded):
            parts = expanded.split(VIDEO_PAD)
            if len(parts) - 1 != len(video_texts):
                raise ValueError(f"{len(parts) - 1} video tokens in the prompt for {len(video_texts)} videos")
            expanded = parts[0] + "".join(v + part for v, part in zip(video_texts, parts[1:]))
        return list(self.tokenizer(expanded, add_special_tokens=False)["input_ids"])

    def image_sizes(self, grid_thw: torch.Tensor) -> list[list[int]]:
        """[width, height] in pixels of each image as the model saw it (after the resize)."""
        return [[int(w) * self.patch_size, int(h) * self.patch_size] for _, h, w in grid_thw.tolist()]


def _expand(text: str, pad: str, counts: list[int], what: str) -> str:
    parts = text.split(pad)
    if len(parts) - 1 != len(counts):
        raise ValueError(f"{len(parts) - 1} {what} tokens in the prompt for {len(counts)} {what}s")
    return parts[0] + "".join(pad * n + part for n, part in zip(counts, parts[1:]))


def with_image_tokens(text: str) -> str:
    """Prompt text with each ``<image>`` as ``<|vision_start|><|image_pad|><|vision_end|>`` and each
    ``<video>`` as ``<|vision_start|><|video_pad|><|vision_end|>`` and each ``<audio>`` as
    ``<|audio_start|><|audio_pad|><|audio_end|>`` (Qwen3-Omni's chat template's audio part)."""
    text = text.replace(AUDIO_PLACEHOLDER, AUDIO_START + AUDIO_PAD + AUDIO_END)
    text = text.replace(IMAGE_PLACEHOLDER, VISION_START + IMAGE_PAD + VISION_END)
    return text.replace(VIDEO_PLACEHOLDER, VISION_START + VIDEO_PAD + VISION_END)


def collapse_image_tokens(ids: Sequence[int], *token_ids: int | None) -> list[int]:
    """``ids`` with each run of one of ``token_ids`` (the image token, the video token) as one
    token: the prompt as vLLM takes it with images and videos."""
    collapse = {t for t in token_ids if t is not None}
    out: list[int] = []
    for token in ids:
        if token in collapse and out and out[-1] == token:
            continue
        out.append(int(token))
    return out


# A vision-language model's tokens that a response must not hold: the forward over prompt + response
# would read a generated image token as a place for image features, and a generated vision start as
# the start of an image (its rope positions), which the engine that sampled them did not. Every
# strategy gives them zero probability in responses (``exclude_response_tokens``; vLLM a bias), so
# the sampling and scoring distributions are the same.
EXCLUDED_TOKEN_KEYS = (
    "vision_start_token_id",
    "image_token_id",
    "video_token_id",
    "audio_token_id",  # Qwen3-Omni: an audio's tokens and its start, as an image's
    "audio_start_token_id",
)
EXCLUDED_LOGIT = -1.0e9  # exp() of it is 0 in fp32; finite, so 0 * logit stays 0 in the entropy


def response_excluded_tokens(config: Any) -> list[int]:
    """The token ids a response of this model must not hold ([] for a text model); ``config`` is a
    transformers config or config.json's dict."""
    if not is_vision_config(config):
        return []
    config = multimodal_config(config)
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    return sorted({int(get(k)) for k in EXCLUDED_TOKEN_KEYS if isinstance(get(k), int)})


def exclude_response_tokens(logits: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """``logits`` [..., V] with ``token_ids`` set to ``EXCLUDED_LOGIT`` (a new tensor; autograd-safe)."""
    if not token_ids:
        return logits
    index = torch.as_tensor(list(token_ids), device=logits.device)
    return logits.index_fill(-1, index, EXCLUDED_LOGIT)


def has_vision_inputs(batch: Any) -> bool:
    """Whether any row of the batch has images, videos or audio."""
    return MULTI_MODAL_INPUTS in batch and any(r for r in batch[MULTI_MODAL_INPUTS])


def forward_kwargs(
    batch: Any, device: torch.device | str, input_ids: torch.Tensor | None = None, model: Any = None
) -> dict[str, torch.Tensor]:
    """The vision inputs of the batch's rows (``VISION_INPUT_KEYS``, each concatenated over the rows
    that have it, in row order; audio inputs, ``AUDIO_INPUT_KEYS``, padded to the longest) on ``device``, and with ``input_ids`` [B, T] and a ``model`` whose
    forward takes them (transformers >= 5) their ``mm_token_type_ids`` (``token_types``); {} for a
    batch without vision inputs."""
    if MULTI_MODAL_INPUTS not in batch:
        return {}
    rows = [r for r in batch[MULTI_MODAL_INPUTS] if r]
    if not rows:
        return {}
    out = {}
    for key in VISION_INPUT_KEYS:
        parts = [r[key] for r in rows if r.get(key) is not None]
        if parts:
            out[key] = torch.cat(parts).to(device)
    audio = [{k: r[k] for k in AUDIO_INPUT_KEYS} for r in rows if r.get(AUDIO_INPUT_KEYS[0]) is not None]
    if audio:  # rows' audios differ in length: padded to the longest, the mask says which frames
        out.update({k: t.to(device) for k, t in concat_audio_inputs(audio).items()})
    if input_ids is not None and model is not None and takes_token_types(model):
        out["mm_token_type_ids"] = token_types(input_ids, model.config).to(device)
    return out


def takes_token_types(model: Any) -> bool:
    """Whether the model's forward takes ``mm_token_type_ids`` (transformers 5's Qwen2.5-VL; 4.x
    computes the rope positions from the ids alone)."""
    return _forward_takes_token_types(type(model))


@functools.cache
def _forward_takes_token_types(model_class: type) -> bool:  # once per class, not per forward
    return "mm_token_type_ids" in inspect.signature(model_class.forward).parameters


def token_types(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """``mm_token_type_ids``: 1 at the config's image tokens, 2 at its video tokens, 0 elsewhere; with
    them transformers computes the 3-D rope positions (``get_rope_index``)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for token, kind in (
        (getattr(config, "image_token_id", None), 1),
        (getattr(config, "video_token_id", None), 2),
    ):
        if token is not None:
            types[input_ids == token] = kind
    return types


def repeat_rows(rows: Sequence[Any], n: int) -> list[Any]:
    """Each row's entry ``n`` times in a row (the order of ``repeat_interleave``)."""
    return [r for r in rows for _ in range(n)]


def check_vision_options(role: str, packing: bool, ulysses_size: int) -> None:
    """A vision forward runs on padded rows on one rank per sequence: refuse what would split it."""
    path = f"{role}.strategy_args.strategy_config"
    if packing:
        raise ConfigError(
            f"{path}.sequence_packing",
            "true does not run with a vision-language model (its rope positions come from the padded "
            "rows' attention mask and image grid); set sequence_packing: false or leave it null",
        )
    if ulysses_size > 1:
        raise ConfigError(
            f"{path}.ulysses_size", f"{ulysses_size} does not run with a vision-language model; set it to 1"
        )


def freeze_prefixes(model: torch.nn.Module, prefixes: Sequence[str] | None, path: str) -> int:
    """Freeze the parameters whose names start with one of ``prefixes`` (``model_args.
    freeze_module_prefix``); returns how many tensors were frozen. A prefix matching nothing is a
    ConfigError listing the model's top-level modules."""
    if not prefixes:
        return 0
    names = [name for name, _ in model.named_parameters()]
    frozen = 0
    for prefix in prefixes:
        pattern = re.compile(re.escape(prefix) + r"(\.|$)")
        matched = [p for name, p in model.named_parameters() if pattern.match(name)]
        if not matched:
            tops = sorted({".".join(n.split(".")[:2]) for n in names})
            raise ConfigError(
                path, f"{prefix!r} matches no parameter; the model's modules: {', '.join(tops)}"
            )
        for param in matched:
            param.requires_grad_(False)
        frozen += len(matched)
    return frozen
