"""Qwen3-Omni's 3-D rope positions on vLLM, put right where vLLM 0.24 shifts its image tokens by one.

transformers' thinker (``get_rope_index``) lays an image ``<|vision_start|> pads <|vision_end|>`` as:
the start token is text, the pads take the image's (t, h, w) grid from the next position on, the end
token follows the grid's largest position. vLLM 0.24.0's ``Qwen3OmniMoeThinkerForConditionalGeneration.
get_mrope_input_positions`` (vllm/model_executor/models/qwen3_omni_moe_thinker.py:2241-2345) reads
each item's ``mm_position.offset`` as the index of its start token (``text_len = offset - st``, then
one "bos" position, the item, one "eos" position, ``st = offset + 1 + image_len + 1``), but the
offset is that of the item's first pad: the placeholder is what replaced ``<|image_pad|>`` /
``<|audio_pad|>`` (``_get_prompt_updates``, the same file, line 1411; ``PlaceholderFeaturesInfo.
to_range`` in vllm/multimodal/processing/processor.py:687). So the first pad gets the start
token's "bos" slot, the other pads and the end token take the grid shifted by one: an image row's
log-probs differ from transformers' by about 0.1 (a tiny thinker: mean 0.11, max 0.23 per token).
Audio and text positions come out right (1-D runs the shift does not change).

``fix_qwen3_omni_positions`` (run in every vLLM worker, ``RollWorkerExtension``) asks the model for
the positions of a probe prompt of one image and, when they are not transformers', makes its
``iter_mm_features`` hand on each item's offset less one (the start token, as the method expects),
then asks again: a vLLM that computes them right is left alone, one that still differs is an error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

# [text, <|vision_start|>, 4 pads of one 1 x 4 x 4-patch image (2 x 2 merged), <|vision_end|>, text]
PROBE_GRID = (1, 4, 4)
PROBE_PAD_OFFSET = 2  # where vLLM's placeholder (the first pad) starts
PROBE_LENGTH = 8
# transformers' get_rope_index for that prompt (merge size 2): rows t, h, w
PROBE_POSITIONS = [
    [0, 1, 2, 2, 2, 2, 4, 5],
    [0, 1, 2, 2, 3, 3, 4, 5],
    [0, 1, 2, 3, 2, 3, 4, 5],
]
MODEL_CLASSES = ("Qwen3OmniMoeThinkerForConditionalGeneration",)  # the models this fix is for
_FIXED = "_roll_bos_offsets"


class _Field:
    """What vLLM's ``MultiModalKwargsItem`` fields offer the method: ``.data``."""

    def __init__(self, data: Any) -> None:
        self.data = data


def probe_features() -> list[Any]:
    """The probe's one image as a ``MultiModalFeatureSpec`` looks to ``get_mrope_input_positions``."""
    import torch

    return [
        SimpleNamespace(
            modality="image",
            mm_position=SimpleNamespace(offset=PROBE_PAD_OFFSET),
            data={"image_grid_thw": _Field(torch.tensor(PROBE_GRID))},
        )
    ]


def probe_positions(model: Any) -> list[list[int]]:
    """The model's positions ([3][PROBE_LENGTH]) for the probe prompt."""
    positions, _ = model.get_mrope_input_positions([0] * PROBE_LENGTH, probe_features())
    return [[int(p) for p in row] for row in positions.tolist()]


def bos_offsets(iter_mm_features: Callable[..., Iterator[tuple[int, str, Any]]]) -> Callable[..., Any]:
    """``iter_mm_features`` yielding each item's offset less one: its start token's index."""

    @functools.wraps(iter_mm_features)
    def shifted(self: Any, mm_features: Any) -> Iterator[tuple[int, str, Any]]:
        for offset, modality, data in iter_mm_features(self, mm_features):
            yield offset - 1, modality, data

    setattr(shifted, _FIXED, True)
    return shifted


def fix_qwen3_omni_positions(model: Any) -> str:
    """Make ``model``'s class (vLLM's Qwen3-Omni thinker) compute transformers' positions; returns
    what it did: ``"not qwen3-omni"``, ``"correct"`` (nothing to do) or ``"fixed"``."""
    cls = type(model)
    if cls.__name__ not in MODEL_CLASSES:
        return "not qwen3-omni"
    if probe_positions(model) == PROBE_POSITIONS:
        return "correct"
    if getattr(cls.iter_mm_features, _FIXED, False):
        raise RuntimeError(
            f"{cls.__name__}: the offset fix is in but positions still differ from transformers'"
        )
    cls.iter_mm_features = bos_offsets(cls.iter_mm_features)
    got = probe_positions(model)
    if got != PROBE_POSITIONS:
        raise RuntimeError(
            f"{cls.__name__}.get_mrope_input_positions: {got} for the probe image, transformers' is "
            f"{PROBE_POSITIONS} (roll/distributed/strategy/vllm_omni_positions.py)"
        )
    return "fixed"
