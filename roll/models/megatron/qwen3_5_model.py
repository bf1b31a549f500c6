"""Qwen3.5's modules on megatron-core (``roll.models.megatron.qwen3_5`` says what they reproduce):
a GPTModel with transformers' vision tower on the first pipeline stage and interleaved multimodal rope.

>>> model = Qwen3_5GPTModel(config, block_spec, hf_config=hf, vocab_size=..., position_embedding_type="mrope", ...)
>>> logits = model(input_ids, position_ids, None, pixel_values=pv, image_grid_thw=grid)
>>> logits = model(ids, None, None, packed_seq_params=thd, packed_input_ids=row, pixel_values=pv, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from roll.models.megatron.interleaved_mrope import InterleavedMRoPE
from roll.models.megatron.qwen2_5_vl import (
    Qwen2_5_VLGPTModel,
    build_vision_tower,
    tower_tensor_names,
)
from roll.models.rope_index import rope_index_positions


def mrope_positions(
    input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, hf_config: Any
) -> torch.Tensor:
    """[3, B, S] rope positions of rows starting at column 0 (images only): transformers' Qwen2-VL
    ``get_rope_index``, which Qwen3.5's extends only for videos."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    return rope_index_positions(
        Qwen2VLModel, input_ids, hf_config, image_grid_thw=image_grid_thw, video_grid_thw=None
    )


# ---------------------------------------------------------------------------- vision tower
def _vision_class() -> Any:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    return Qwen3_5VisionModel


def vision_tensor_names(hf_config: Any) -> tuple[str, ...]:
    """The vision tower's parameter names in roll's model (``visual.*``; transformers' module and
    the checkpoint have them under ``model.visual.``, ``weight_mapping.module_name``)."""
    return tower_tensor_names(_vision_class(), hf_config)


class Qwen3_5GPTModel(Qwen2_5_VLGPTModel):
    """GPTModel with Qwen3.5's vision tower on the first pipeline stage and interleaved mrope.

    ``forward`` is Qwen2.5-VL's (padded or packed rows, the image embedding, the idle tower on a
    text-only training forward) with Qwen3.5's rope positions (``_row_positions``): GPTModel's
    arguments plus ``pixel_values`` [patches, D] and ``image_grid_thw`` [images, 3] of the rows'
    images in row order, and the whole packed row ``packed_input_ids`` on packed rows; the given
    ``position_ids`` are replaced by the 3-D ones. Videos are refused.
    """

    def __init__(self, config: Any, transformer_layer_spec: Any, *, hf_config: Any, **kwargs: Any) -> None:
        GPTModel.__init__(self, config, transformer_layer_spec, **kwargs)
        self.roll_vl_config = hf_config
        self.rotary_pos_emb = InterleavedMRoPE(self.rotary_pos_emb.inv_freq)  # on rotary_percent of each head
        if self.pre_process:
            self.visual = build_vision_tower(_vision_class(), hf_config, self, config.params_dtype)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("pixel_values_videos") is not None or kwargs.get("video_grid_thw") is not None:
            raise ValueError("Qwen3.5 on the Megatron strategies takes images only, not videos")
        return super().forward(*args, **kwargs)

    def _row_positions(
        self, image_grid_thw: torch.Tensor | None, video_grid_thw: Any, second_per_grid_ts: Any
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        return partial(mrope_positions, image_grid_thw=image_grid_thw, hf_config=self.roll_vl_config)


MODEL_CLASS = Qwen3_5GPTModel  # families.VISION_MODULES' entry point
