"""Qwen2.5-VL on megatron-core: transformers' vision tower in front of a GPTModel language model.

The language model is megatron-core's GPTModel as for Qwen2 (TP / PP / SP / CP as usual) with
multimodal RoPE (``position_embedding_type="mrope"``, the HF config's ``mrope_section``). The vision
tower and merger are transformers' own module, built from ``vision_config`` and held whole on every
rank of the first pipeline stage (as ``visual``, the HF checkpoint's name). Its image and video
embeddings replace the word embeddings at the image- and video-token positions and enter the
decoder as ``decoder_input``.

Every stage computes the 3-D rope positions of its rows (``mrope_positions``, transformers'
``get_rope_index`` by Qwen's rule, ``roll.models.qwen_rope_rule``, from the ids, the images' and
videos' grids and the videos' seconds per temporal patch). Padded rows start at column 0 (roll's
shifted layout, ``forward.py``), so trailing padding never moves a real token's position; packed
(thd) rows, context parallelism included, get each sequence's positions the same way from the
whole packed row (``packed_vision.py``).

>>> model = Qwen2_5_VLGPTModel(config, block_spec, hf_config=hf, vocab_size=..., ...)
>>> logits = model(input_ids, position_ids, None, pixel_values=pv, image_grid_thw=grid)
>>> logits = model(local_ids, None, None, packed_seq_params=thd, packed_input_ids=row, pixel_values=pv, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from roll.models.megatron.packed_vision import keep_whole_row, vision_inputs, with_vision_features
from roll.models.rope_index import rope_index_positions
from roll.models.vision_tower import idle_tower_output, tower_wants_grads


def _vision_class() -> Any:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


def vision_tensor_names(hf_config: Any) -> tuple[str, ...]:
    """The vision tower's parameter names as the HF checkpoint stores them (``visual.*``)."""
    return tower_tensor_names(_vision_class(), hf_config)


def tower_tensor_names(tower_class: Any, hf_config: Any) -> tuple[str, ...]:
    """``visual.*``: the parameter names of transformers' vision tower ``tower_class`` built (on the
    meta device) from ``hf_config.vision_config``."""
    with torch.device("meta"):
        tower = tower_class._from_config(hf_config.vision_config)
    return tuple(f"visual.{name}" for name, _ in tower.named_parameters())


def mrope_positions(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    hf_config: Any,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, B, S] Qwen2.5-VL rope positions (temporal, height, width) of rows whose tokens start at
    column 0: text tokens count up on all three axes, an image's or video's tokens take its grid
    coordinates (a video's temporal ones spaced by ``tokens_per_second`` x its seconds per temporal
    patch). The grids hold the rows' images / videos in row order (None: none)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    return rope_index_positions(
        Qwen2_5_VLModel,  # Qwen's rule (roll.models.qwen_rope_rule)
        input_ids,
        hf_config,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts,
    )


def vision_parts(
    hf_config: Any,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    pixel_values_videos: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(token id, pixels, grid) of the rows' images, then of their videos, those present only: the
    vision tower's calls, as transformers runs them."""
    parts = [(hf_config.image_token_id, pixel_values, image_grid_thw)]
    parts.append((hf_config.video_token_id, pixel_values_videos, video_grid_thw))
    return [p for p in parts if p[1] is not None]


def build_vision_tower(tower_class: Any, hf_config: Any, model: GPTModel, params_dtype: torch.dtype) -> Any:
    """transformers' vision tower ``tower_class`` built from ``hf_config.vision_config`` on the device
    of ``model``'s word embeddings (a first-stage GPTModel), in ``params_dtype``."""
    tower = tower_class._from_config(hf_config.vision_config)
    return tower.to(device=model.embedding.word_embeddings.weight.device, dtype=params_dtype)


class Qwen2_5_VLGPTModel(GPTModel):
    """GPTModel with Qwen2.5-VL's vision tower on the first pipeline stage (see the module docstring).

    ``forward`` takes GPTModel's arguments plus the rows' vision inputs in row order
    (``pixel_values`` [patches, D], ``image_grid_thw`` [images, 3], ``pixel_values_videos``,
    ``video_grid_thw`` [videos, 3], ``second_per_grid_ts`` [videos]) and, on packed rows, the whole
    packed row ``packed_input_ids`` [1, T]; the given ``position_ids`` are replaced by the 3-D ones.
    """

    def __init__(self, config: Any, transformer_layer_spec: Any, *, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(config, transformer_layer_spec, **kwargs)
        self.roll_vl_config = hf_config
        keep_whole_row(self.rotary_pos_emb)
        if self.pre_process:
            self.visual = build_vision_tower(_vision_class(), hf_config, self, config.params_dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        *args: Any,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        packed_input_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        row_positions = self._row_positions(image_grid_thw, video_grid_thw, second_per_grid_ts)
        rows, local, position_ids = vision_inputs(
            input_ids,
            kwargs.get("packed_seq_params"),
            packed_input_ids,
            row_positions,
            self.config.context_parallel_size,
            type(self).__name__,
        )
        parts = self._vision_parts(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        if self.pre_process and decoder_input is None and parts:
            decoder_input, block_kwargs = self._embed_with_vision(input_ids, rows, local, parts)
            if block_kwargs:  # e.g. Qwen3-VL's deepstack features, for its decoder layers' hooks
                kwargs["extra_block_kwargs"] = {**(kwargs.get("extra_block_kwargs") or {}), **block_kwargs}
        elif self.pre_process and decoder_input is None and tower_wants_grads(self.visual):
            # Text rows in training: the tower on a dummy image, times 0, so its parameters get (zero)
            # gradients on every DP rank and DDP's overlapped bucket all-reduce is issued alike
            # (roll.models.vision_tower). The embeddings are unchanged.
            decoder_input = idle_tower_embeddings(self.embedding, self.visual, input_ids)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs)

    def _vision_parts(
        self,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        pixel_values_videos: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
    ) -> list[tuple[int, Any, Any]]:
        """The towers' calls of this forward, (token id, inputs, grid) each (``vision_parts``;
        Qwen3-Omni adds its audio)."""
        return vision_parts(
            self.roll_vl_config, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
        )

    def _row_positions(
        self,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        second_per_grid_ts: torch.Tensor | None,
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The rope positions [3, B, S] of rows starting at column 0, given their ids."""
        return partial(
            mrope_positions,
            image_grid_thw=image_grid_thw,
            hf_config=self.roll_vl_config,
            video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
        )

    def _embed_with_vision(
        self,
        input_ids: torch.Tensor,
        rows: torch.Tensor,
        local: torch.Tensor | None,
        parts: list[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """[s, b, h] (this rank's tokens; its sequence share under SP) word embeddings with the image
        and video tokens' replaced by the vision tower's output (images and videos in two calls, as
        transformers runs them), and the keyword arguments the decoder's layers get besides (none
        here)."""
        words = self.embedding(input_ids=input_ids, position_ids=None)  # [s(/tp), b, h]
        features = [
            (token, self.visual(pixels.to(self.config.params_dtype), grid_thw=grid).pooler_output)
            for token, pixels, grid in parts
        ]
        return with_vision_features(words, rows, features, local, self.config.sequence_parallel), {}


def idle_tower_embeddings(embedding: Any, tower: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """[s, b, h] the word embeddings of ``input_ids`` plus 0 from the vision tower run on a dummy
    image (``vision_tower.idle_tower_output``): a text-only training forward gives the tower's
    parameters (zero) gradients as an image forward does."""
    words = embedding(input_ids=input_ids, position_ids=None)
    return words + idle_tower_output(tower, words.device).to(words.dtype)


MODEL_CLASS = Qwen2_5_VLGPTModel  # families.VISION_MODULES' entry point


# ROLL's mcore_adapter names of the towers (Qwen3.5's, Qwen3-VL's, Qwen3-Omni's) -> roll's.
ROLL_TOWER_NAMES = {"vision_model": "visual", "audio_model": "audio_tower"}
# Modules of a ROLL model that roll does not build (Qwen3-Omni's speech output): nothing to freeze.
UNBUILT_MODULES = ("talker", "code2wav")


def freeze_vision_tower(chunks: list[torch.nn.Module], prefixes: list[str] | None, path: str) -> int:
    """``model_args.freeze_module_prefix`` on megatron_train: ROLL's / transformers' module names
    (``model.visual``, ``model.visual.merger``, ``visual...``, ROLL's ``vision_model...`` and
    ``audio_model...``) freeze that part of a tower on the ranks that hold it (the first pipeline
    stage); a module roll does not build (``talker``, ``code2wav``) is logged and skipped; other
    prefixes are a ConfigError. Returns how many tensors this rank froze; call before DDP and the
    optimizer are built."""
    import logging

    from roll.configs.errors import ConfigError
    from roll.models.vision import freeze_prefixes

    if not prefixes:
        return 0
    names = []
    for prefix in prefixes:
        head, dot, rest = prefix.removeprefix("model.").partition(".")
        if head in UNBUILT_MODULES and not any(hasattr(c, head) for c in chunks):
            logging.getLogger(__name__).info(
                "%s: %r is not built by roll (the thinker only): nothing to freeze", path, prefix
            )
            continue
        name = ROLL_TOWER_NAMES.get(head, head) + dot + rest
        if name.partition(".")[0] not in ("visual", "audio_tower"):
            raise ConfigError(
                path,
                f"{prefix!r}: megatron_train freezes parts of the vision or audio tower (model.visual... or "
                "ROLL's vision_model... / audio_model...) only",
            )
        names.append(name)
    return sum(freeze_prefixes(c, names, path) for c in chunks if getattr(c, "pre_process", False))
