"""transformers' 3-D rope positions of a vision-language row, sent to SGLang with its images and
videos so that the engine samples at the positions roll's trainer scores at.

SGLang 0.5.16 computes a row's positions itself (``QwenVLImageProcessor.process_mm_data_async``,
sglang/srt/multimodal/processors/qwen_vl.py:776-804, calling ``get_rope_index`` of
sglang/srt/layers/rotary_embedding/mrope_rope_index.py) unless the ``processor_output`` dict it is
given holds ``mrope_positions`` and ``mrope_position_delta`` (``_get_precomputed_mrope_from_output``,
qwen_vl.py:431). Its rule is transformers 4's: the text after an image or video starts one past the
item's largest position (mrope_rope_index.py:193-196, ``llm_pos_ids_list[-1].max() + 1``).
transformers 5 (5.12.1, 5.17, 5.24: ``Qwen2_5_VLModel.get_rope_index``, ``current_pos +=
max(grid_thw[1], grid_thw[2]) // spatial_merge_size``) starts it one past the largest *spatial*
position. For an image (one temporal patch) the two agree; for a Qwen2.5-VL video of ``t`` temporal
patches, whose temporal positions step by ``tokens_per_second * second_per_grid_t``, SGLang's text
after the video sits ``(t - 1) * step + 1 - max(h, w) / merge`` positions later than transformers'
(the tiny test model: 3), and every response token with it. Qwen3-VL writes each temporal patch as
its own ``[1, h, w]`` run, so both rules agree there.

So a Qwen2.5-VL row with a video carries transformers' positions of its ids ([3, L]) and the delta
that continues them for the response (SGLang decodes token ``i`` at ``i + delta``): the position a
text token right after the ids takes in transformers, less the ids' length. Other rows, where the two
rules agree, leave the positions to SGLang (the path the GPU tests ran before this module).

>>> positions = rope_positions(model_dir)          # None for a model type without a rope index
>>> extra = positions(ids, inputs)                 # {"mrope_positions": [3, L], "mrope_position_delta": [[d]]}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from roll.models.rope_index import ROPE_INDEX_CLASSES, rope_index_class, rope_index_positions
from roll.models.vision import token_types

POSITIONS, DELTA = "mrope_positions", "mrope_position_delta"  # SGLang's processor_output keys


@dataclass(frozen=True, eq=False)
class RopePositions:
    """transformers' positions of one model's rows (``hf_config``: its transformers config)."""

    hf_config: Any
    model_class: Any

    def __call__(self, ids: Sequence[int], inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``{POSITIONS: [3, len(ids)], DELTA: [[d]]}`` of a row's ids and its ``multi_modal_inputs``
        (image and video grids in row order, Qwen2.5-VL's ``second_per_grid_ts``)."""
        # one text token after the ids: where transformers' forward over ids + response goes on
        x = torch.tensor([[*ids, 0]], dtype=torch.long)
        types = token_types(x, self.hf_config)
        types[0, -1] = 0
        extra = {}
        if inputs.get("second_per_grid_ts") is not None:
            extra["second_per_grid_ts"] = torch.as_tensor(inputs["second_per_grid_ts"])
        positions = rope_index_positions(
            self.model_class,
            x,
            self.hf_config,
            image_grid_thw=_grid(inputs.get("image_grid_thw")),
            video_grid_thw=_grid(inputs.get("video_grid_thw")),
            types=types,
            **extra,
        )[:, 0]
        delta = int(positions[:, -1].max()) - len(ids)
        return {POSITIONS: positions[:, :-1].contiguous(), DELTA: torch.tensor([[delta]], dtype=torch.long)}


def _grid(value: Any) -> torch.Tensor | None:
    return None if value is None else torch.as_tensor(value, dtype=torch.long).clone()


def rope_positions(model_dir: str) -> RopePositions | None:
    """The ``RopePositions`` of the model in ``model_dir`` (transformers' config and model class);
    None for a model type with no rope index in ``ROPE_INDEX_CLASSES``."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    if hf_config.model_type not in ROPE_INDEX_CLASSES:
        return None
    return RopePositions(hf_config, rope_index_class(hf_config.model_type))
