"""The 3-D rope positions of Qwen-VL rows from the model class's ``get_rope_index``, without a model
(Qwen2.5-VL's by Qwen's rule: ``roll.models.qwen_rope_rule``).

The trainers' forwards take these positions (transformers' model computes them; roll's megatron
models call the same method), and the engines compute the same ones:

>>> cls = rope_index_class("qwen2_5_vl")
>>> positions = rope_index_positions(cls, ids, hf_config, image_grid_thw=g, video_grid_thw=None)
>>> cls = rope_index_class("qwen3_vl_moe")                    # transformers' Qwen3VLMoeModel
"""

from __future__ import annotations

import importlib
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from roll.models.qwen_rope_rule import use_qwen_rope_rule
from roll.models.vision import token_types

# model_type -> (module, class) whose ``get_rope_index`` lays the model's positions in transformers
ROPE_INDEX_CLASSES: dict[str, tuple[str, str]] = {
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel"),
    "qwen3_vl": ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel"),
    "qwen3_vl_moe": ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeModel"),
}


def rope_index_class(model_type: str) -> Any:
    """transformers' model class whose ``get_rope_index`` computes ``model_type``'s positions; a
    KeyError naming the types known (``ROPE_INDEX_CLASSES``)."""
    if model_type not in ROPE_INDEX_CLASSES:
        raise KeyError(f"no rope index for model_type {model_type!r}; known: {sorted(ROPE_INDEX_CLASSES)}")
    use_qwen_rope_rule()  # Qwen2.5-VL's get_rope_index by Qwen's rule (roll.models.qwen_rope_rule)
    module, name = ROPE_INDEX_CLASSES[model_type]
    return getattr(importlib.import_module(module), name)


def rope_index_positions(
    model_class: Any,
    input_ids: torch.Tensor,
    hf_config: Any,
    *,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    types: torch.Tensor | None = None,
    **extra: Any,
) -> torch.Tensor:
    """[3, B, S] rope positions of rows starting at column 0 from ``model_class.get_rope_index``
    (transformers' Qwen2.5-VL / Qwen3-VL model class; ``extra``: its further keyword arguments);
    rows without images or videos count up on all three axes. ``types``: the rows'
    ``mm_token_type_ids`` (default: the config's image and video tokens in ``input_ids``), the
    only thing transformers 5 reads to find the images and videos."""
    use_qwen_rope_rule()  # whichever class the caller passes: Qwen2.5-VL's by Qwen's rule
    if not any(g is not None and len(g) for g in (image_grid_thw, video_grid_thw)):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return positions.view(1, 1, -1).expand(3, input_ids.shape[0], -1)
    host = SimpleNamespace(config=hf_config)  # get_rope_index reads only the config and this method
    host.get_vision_position_ids = partial(model_class.get_vision_position_ids, host)
    if types is None:
        types = token_types(input_ids, hf_config)
    positions, _ = model_class.get_rope_index(
        host, input_ids, types, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, **extra
    )
    return positions
