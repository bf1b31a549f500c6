"""The 3-D rope positions of Qwen-VL rows from a transformers model class's ``get_rope_index``,
without a model (Qwen2.5-VL's by Qwen's rule: ``roll.models.qwen_rope_rule``). The trainers' forwards
take these positions (transformers' model computes them; roll's megatron models call this), and the
engines compute the same ones:

>>> positions = rope_index_positions(Qwen2_5_VLModel, ids, hf_config, image_grid_thw=g, video_grid_thw=None)
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from roll.models.qwen_rope_rule import use_qwen_rope_rule
from roll.models.vision import token_types


def rope_index_positions(
    model_class: Any,
    input_ids: torch.Tensor,
    hf_config: Any,
    *,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    **extra: Any,
) -> torch.Tensor:
    """[3, B, S] rope positions of rows starting at column 0 from ``model_class.get_rope_index``
    (transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL model class; ``extra``: its further keyword
    arguments); rows without images or videos count up on all three axes. transformers 5 finds the
    images and videos by the rows' ``mm_token_type_ids``, built here from the config's tokens."""
    use_qwen_rope_rule()  # Qwen2.5-VL's get_rope_index by Qwen's rule
    if not any(g is not None and len(g) for g in (image_grid_thw, video_grid_thw)):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return positions.view(1, 1, -1).expand(3, input_ids.shape[0], -1)
    host = SimpleNamespace(config=hf_config)  # get_rope_index reads only the config and this method
    host.get_vision_position_ids = partial(model_class.get_vision_position_ids, host)
    positions, _ = model_class.get_rope_index(
        host,
        input_ids,
        token_types(input_ids, hf_config),
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        **extra,
    )
    return positions
