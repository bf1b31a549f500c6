"""The images and videos of vision-language prompt rows as SGLang's ``Engine.generate`` takes them
(no engine needed; tested on CPU).

SGLang (0.5.16) takes a request's images as ``image_data`` and its videos as ``video_data``, one
entry per request. An entry may be raw images (PIL, bytes, paths: SGLang's processor resizes them
and re-expands the image tokens of the prompt) or ONE dict ``{"format": "processor_output", ...}``
holding the HF processor's tensors for all of the request's images; with such a dict and
``input_ids``, SGLang keeps the ids as given (its ``load_mm_data`` fast path), finds each image at a
run of image tokens and splits ``pixel_values`` per image by ``image_grid_thw``. roll's rows
already hold both halves: the expanded prompt ids the trainer scores and the processor's pixel
inputs (``multi_modal_inputs``), so they go as they are, without a second resize. SGLang computes
the rows' 3-D rope positions by Qwen's rule, as roll's trainers do (``roll.models.qwen_rope_rule``)::

    vision = sglang_vision(model_dir)                      # config.json's vision tokens (text: inert)
    kwargs = vision.request_kwargs(batch, prompts, n=4)    # {"image_data": [...], "video_data": [...]}
    engine.generate(input_ids=ids, sampling_params=sp, **kwargs)

``image_data`` is one list per request (``[]`` for a text row: SGLang reads a batch whose first
entry is not a list as one image per request); ``video_data`` one ``[dict]`` or None per request.

Qwen3-VL and Qwen3-VL-MoE (``timestamped``, roll.models.video_prompt) write a video as one run of
video tokens per temporal patch, each after its time and its own vision start. SGLang's Qwen3-VL
processing of such a dict does the same as for Qwen2.5-VL: it keeps the ids, so the times are roll's
(the trainer's), finds the video at its runs (one offset per patch, grouped back into the video by
``video_grid_thw``'s t), and its rope index splits each video's grid into ``[1, h, w]`` per patch,
as transformers' Qwen3-VL does; no video metadata is needed, the HF processor is not run.

Responses never hold the vision tokens (``roll.models.vision.response_excluded_tokens``): sampling
gets a ``logit_bias`` on them, and scoring (``compute_log_probs``, SGLang's input log-probs, which
see no bias) asks for their log-probs too and renormalizes without them (``masked_logprob``), which
is what roll's forward computes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from roll.configs.errors import ConfigError
from roll.configs.strategies import get_strategy_spec
from roll.core.batch import Batch
from roll.distributed.strategy.engine_requests import ScoringRequest, sglang_input_logprobs
from roll.models.model_dir import config_json
from roll.models.video_prompt import TIMESTAMPED_VIDEO_MODEL_TYPES
from roll.models.vision import MULTI_MODAL_INPUTS, is_vision_config, response_excluded_tokens

PROCESSOR_OUTPUT = "processor_output"
# What one processor_output dict carries per modality (the forward's keyword tensors).
IMAGE_KEYS = ("pixel_values", "image_grid_thw")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
EXCLUDED_BIAS = -1.0e4  # as vLLM's (engine_vision): exp underflows to 0, finite in the log-probs
# SGLang 0.5.16's Qwen3-VL-MoE language model adds deepstack after decoder layers range(3), whatever
# vision_config.deepstack_visual_indexes holds (sglang/srt/models/qwen3_vl_moe.py, Qwen3MoeLLMModel:
# "we use 3 as len(config.vision_config.deepstack_visual_indexes)"); Qwen's released MoE checkpoints
# have 3. With fewer, decoder layer len(indexes) gets an empty slice added to its residual (a
# RuntimeError in the scheduler, which then kills the engine's process); with more, the rest is dropped.
SGLANG_MOE_DEEPSTACK = 3


@dataclass(frozen=True)
class SGLangVision:
    """A model directory's vision tokens as the SGLang strategy needs them; all empty for a text
    model, whose requests then go out unchanged."""

    image: int | None = None
    video: int | None = None
    merge_size: int = 2
    excluded: tuple[int, ...] = ()
    # Qwen3-VL's videos: one run of video tokens per temporal patch (roll.models.video_prompt)
    timestamped: bool = False
    model_type: str | None = None  # config.json's (None for a text model)

    def logit_bias(self) -> dict[str, float]:
        """SGLang's ``sampling_params["logit_bias"]`` (string keys, as its SamplingParams declares)."""
        return {str(token): EXCLUDED_BIAS for token in self.excluded}

    def request_kwargs(self, batch: Batch, prompts: Sequence[Sequence[int]], n: int) -> dict[str, Any]:
        """``image_data``/``video_data`` for ``Engine.generate``: each row's entry ``n`` times in a row
        (the order of ``sglang_generate_requests``); {} when no row has images or videos."""
        rows = row_inputs(batch)
        if rows is None:
            return {}
        images, videos = [], []
        for i, (ids, inputs) in enumerate(zip(prompts, rows, strict=True)):
            image, video = self.row_data(ids, inputs, i)
            images += [[image] if image is not None else [] for _ in range(n)]
            videos += [[video] if video is not None else None for _ in range(n)]
        out: dict[str, Any] = {}
        if any(images):
            out["image_data"] = images
        if any(v is not None for v in videos):
            out["video_data"] = videos
        return out

    def row_data(
        self, ids: Sequence[int], inputs: Mapping[str, Any] | None, row: int
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(image dict, video dict) of one row, each None when the row has none; a ValueError naming
        the row when its ids do not hold one run of expanded tokens per image (video)."""
        inputs = inputs or {}
        if (inputs.get("image_grid_thw") is not None or inputs.get("video_grid_thw") is not None) and (
            self.image is None
        ):
            raise ValueError(
                "the prompts carry images but the engine's model has no image token (not a VL model)"
            )
        out = []
        for keys, token, what in ((IMAGE_KEYS, self.image, "image"), (VIDEO_KEYS, self.video, "video")):
            grid = inputs.get(keys[1])
            runs = token_runs(ids, token) if token is not None else []
            if grid is None:
                if runs:
                    raise ValueError(
                        f"row {row}: the prompt has {len(runs)} {what} token runs and no {what}s"
                    )
                out.append(None)
                continue
            want = self.expected_runs(grid, timestamped=self.timestamped and what == "video")
            if runs != want:
                raise ValueError(
                    f"row {row}: the prompt's {what} token runs are {runs} long; its {len(want)} {what}s "
                    f"(grid {torch.as_tensor(grid).tolist()}) take {want} (SGLang keeps the ids as given)"
                )
            out.append(
                {"format": PROCESSOR_OUTPUT, **{k: inputs[k] for k in keys if inputs.get(k) is not None}}
            )
        return out[0], out[1]

    def expected_runs(self, grid: Any, timestamped: bool) -> list[int]:
        """The token runs of images or videos of ``grid`` ([n, 3] of t, h, w patches) in a prompt:
        one of ``t * h * w / merge**2`` tokens each, or with ``timestamped`` ``t`` of
        ``h * w / merge**2`` (one per temporal patch)."""
        out: list[int] = []
        for t, h, w in torch.as_tensor(grid).tolist():
            per_patch = h * w // self.merge_size**2
            out += [per_patch] * t if timestamped else [t * per_patch]
        return out

    def scoring_kwargs(self, batch: Batch, token_lists: Sequence[Sequence[int]]) -> dict[str, Any]:
        """``Engine.generate``'s extra arguments for scoring ``token_lists`` (each row's prompt +
        response): the rows' images and videos, and for a vision-language model the excluded
        tokens' input log-probs (``token_ids_logprob``) that ``masked_input_logprobs`` reads."""
        out = self.request_kwargs(batch, token_lists, 1)
        if self.excluded:
            out["token_ids_logprob"] = [list(self.excluded) for _ in token_lists]
        return out

    def response_logprobs(self, output: Mapping[str, Any], req: ScoringRequest) -> list[float]:
        """The log-probs of ``req``'s response tokens from a scoring request's output, as roll's
        forward computes them (the excluded tokens renormalized away for a vision-language model)."""
        raw = sglang_input_logprobs(output, req)
        return masked_input_logprobs(output, req, raw, self.excluded) if self.excluded else raw


def sglang_vision(model_dir: str | None) -> SGLangVision:
    """The ``SGLangVision`` of a model directory, from one read of its config.json; a ConfigError
    for a vision-language model type that roll has not run on SGLang (the check before launch,
    ``StrategySpec.vision_model_types``, repeated where the engine starts)."""
    config = config_json(model_dir)
    if not is_vision_config(config):
        return SGLangVision()
    allowed = get_strategy_spec("sglang").vision_model_types or ()
    if config.get("model_type") not in allowed:
        raise ConfigError(
            "model_args.model_name_or_path",
            f"sglang runs vision-language model_type {', '.join(allowed)} in roll, not "
            f"{config.get('model_type')!r}; generate with vllm",
        )
    check_sglang_deepstack(config)
    merge = int((config.get("vision_config") or {}).get("spatial_merge_size") or 2)
    excluded = tuple(response_excluded_tokens(config))
    timestamped = config.get("model_type") in TIMESTAMPED_VIDEO_MODEL_TYPES
    return SGLangVision(
        config.get("image_token_id"),
        config.get("video_token_id"),
        merge,
        excluded,
        timestamped,
        config.get("model_type"),
    )


def check_sglang_deepstack(config: Mapping[str, Any], key: str = "model_args.model_name_or_path") -> None:
    """A ConfigError for a Qwen3-VL-MoE whose ``vision_config.deepstack_visual_indexes`` does not
    hold ``SGLANG_MOE_DEEPSTACK`` layers (SGLang 0.5.16 assumes that many; see its comment)."""
    if config.get("model_type") != "qwen3_vl_moe":
        return
    indexes = (config.get("vision_config") or {}).get("deepstack_visual_indexes") or []
    if len(indexes) != SGLANG_MOE_DEEPSTACK:
        raise ConfigError(
            key,
            f"vision_config.deepstack_visual_indexes is {list(indexes)}: SGLang 0.5.16 runs Qwen3-VL-MoE "
            f"with {SGLANG_MOE_DEEPSTACK} deepstack layers only (as Qwen's released checkpoints have); "
            "generate with vllm",
        )


def row_inputs(batch: Batch) -> list[Mapping[str, Any] | None] | None:
    """Each row's ``multi_modal_inputs`` (None for a text row); None when no row has any."""
    if MULTI_MODAL_INPUTS not in batch:
        return None
    rows = list(batch[MULTI_MODAL_INPUTS])
    return rows if any(rows) else None


def token_runs(ids: Sequence[int], token: int) -> list[int]:
    """The lengths of the runs of ``token`` in ``ids``, in order."""
    runs: list[int] = []
    previous = None
    for t in ids:
        if t == token:
            if previous == token:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = t
    return runs


# --------------------------------------------------------------------------------- scoring


def masked_logprob(logprob: float, excluded_logprobs: Sequence[float]) -> float:
    """A token's log-prob once the excluded tokens' probability is removed and the rest
    renormalized: ``log p(t) - log(1 - sum p(v))``, what roll's forward gets by setting their
    logits to -1e9 (``exclude_response_tokens``)."""
    mass = sum(math.exp(v) for v in excluded_logprobs)
    if mass >= 1.0:
        raise RuntimeError(
            f"the excluded tokens hold all of the probability ({mass}); nothing to renormalize"
        )
    return logprob - math.log1p(-mass)


def masked_input_logprobs(
    output: Mapping[str, Any], req: ScoringRequest, raw: Sequence[float], excluded: Sequence[int]
) -> list[float]:
    """``raw`` (the input log-probs of ``req``'s scored positions) renormalized without ``excluded``,
    read from ``meta_info.input_token_ids_logprobs`` (per input position from ``logprob_start_len``,
    a list of ``(logprob, token_id, text)`` for the ids asked for, or None; matched from the end as
    ``sglang_input_logprobs`` does)."""
    total = len(req.token_ids)
    entries = output["meta_info"].get("input_token_ids_logprobs")
    if entries is None or len(entries) < total - req.start:
        got = None if entries is None else len(entries)
        raise RuntimeError(
            f"SGLang returned {got} input log-probs of the excluded tokens; {total - req.start} are "
            "needed (was token_ids_logprob passed?)"
        )
    out = []
    for k, t in enumerate(range(req.start, req.start + req.count)):
        entry = entries[len(entries) - (total - t)]
        if not entry or sorted(int(e[1]) for e in entry) != sorted(excluded):
            raise RuntimeError(
                f"SGLang's excluded-token log-probs at position {t} are {entry}, not of {excluded}"
            )
        out.append(masked_logprob(raw[k], [float(e[0]) for e in entry]))
    return out
