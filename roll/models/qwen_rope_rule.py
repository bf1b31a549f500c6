"""Qwen2.5-VL's 3-D rope positions by Qwen's rule, on every roll path that asks transformers for them.

Where the text after an image or a video starts:

- Qwen's rule: one past the item's largest position on any axis. This is what the checkpoints were
  trained with and what transformers up to 5.2, vLLM 0.24 (``qwen2_5_vl.py``,
  ``get_mrope_input_positions``) and SGLang 0.5.16 (``mrope_rope_index.py``) compute.
- transformers 5.3 and later (5.12.1 to 5.24, ``Qwen2_5_VLModel.get_rope_index``): one past the
  item's largest *spatial* position.

The two differ after a video whose temporal positions (``tokens_per_second`` x
``second_per_grid_ts`` apart) reach further than its merged height or width: with transformers'
rule, the text and the response after such a video sat earlier than the engines put them, so the
trainers scored other positions than the rollout sampled at. An image (one temporal patch) gets
the same positions from both.

``use_qwen_rope_rule()`` makes transformers' ``Qwen2_5_VLModel.get_rope_index`` compute Qwen's rule
in this process (idempotent). Every roll path asks it for Qwen2.5-VL positions:

- the HF forwards and generate (fsdp2_train, hf_infer: ``roll.models.loading``);
- megatron's positions (``roll.models.rope_index.rope_index_positions``).

The temporal step is applied before truncating to an integer, as Qwen's code and vLLM do
(transformers 5.17 truncated ``second_per_grid_ts`` first).

>>> use_qwen_rope_rule()
>>> positions, deltas = Qwen2_5_VLModel.get_rope_index(model, ids, types, image_grid_thw=g)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids


def use_qwen_rope_rule() -> None:
    """transformers' Qwen2.5-VL computes its rope positions with ``qwen_rope_index`` from now on
    (its own method stays at ``transformers_rope_index()``)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    model = modeling_qwen2_5_vl.Qwen2_5_VLModel
    if model.get_rope_index is not qwen_rope_index:
        _TRANSFORMERS.append(model.get_rope_index)
        model.get_rope_index = qwen_rope_index


def transformers_rope_index() -> Any:
    """transformers' own ``Qwen2_5_VLModel.get_rope_index`` (before ``use_qwen_rope_rule``)."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    return _TRANSFORMERS[0] if _TRANSFORMERS else modeling_qwen2_5_vl.Qwen2_5_VLModel.get_rope_index


_TRANSFORMERS: list[Any] = []  # transformers' method, once replaced


def qwen_rope_index(
    self: Any,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_rope_index`` by Qwen's rule, with transformers' signature and results: positions
    [3, B, L] (0 at masked columns) and each row's delta [B, 1] (its largest position + 1 less its
    token count). ``self.config``: the model's config; ``mm_token_type_ids`` (None: found from the
    config's image and video tokens) says which tokens are images (1) and videos (2); the grids and
    ``second_per_grid_ts`` list the rows' images and videos in row order."""
    from roll.models.vision import token_types

    vision = self.config.vision_config
    types = mm_token_type_ids if mm_token_type_ids is not None else token_types(input_ids, self.config)
    grids = {
        IMAGE: iter(_rows(image_grid_thw)),
        VIDEO: iter(_rows(video_grid_thw)),
    }
    steps = iter(_rows(second_per_grid_ts))
    positions = torch.zeros(3, *input_ids.shape, dtype=input_ids.dtype, device=input_ids.device)
    deltas = []
    for row in range(input_ids.shape[0]):
        keep = (
            attention_mask[row].bool()
            if attention_mask is not None
            else torch.ones(input_ids.shape[1], dtype=torch.bool, device=input_ids.device)
        )
        got = row_positions(
            types[row][keep].tolist(), grids, steps, vision.spatial_merge_size, vision.tokens_per_second
        )
        positions[:, row, keep] = got.to(positions)
        deltas.append(int(got.max()) + 1 - got.shape[1] if got.shape[1] else 0)
    return positions, torch.tensor(deltas, device=input_ids.device).unsqueeze(1)


def row_positions(
    types: list[int],
    grids: dict[int, Iterator[list[int]]],
    steps: Iterator[Any],
    merge: int,
    tokens_per_second: float,
) -> torch.Tensor:
    """[3, len(types)] positions of one row's tokens (``types``: 0 text, 1 image, 2 video); each image
    or video takes the next grid of its kind (and a video the next seconds per temporal patch,
    default 1.0)."""
    out: list[torch.Tensor] = []
    next_pos = 0
    for kind, run in itertools.groupby(types):
        left = len(list(run))
        if kind == TEXT:
            out.append(torch.arange(left).expand(3, -1) + next_pos)
            next_pos += left
            continue
        while left > 0:  # items of one kind right after each other share a run
            t, h, w = (int(v) for v in next(grids[kind]))
            step = float(next(steps, 1.0)) * tokens_per_second if kind == VIDEO else 0.0
            item = _item_positions(t, h // merge, w // merge, step) + next_pos
            out.append(item)
            next_pos = int(item.max()) + 1
            left -= item.shape[1]
    return torch.cat(out, dim=1) if out else torch.zeros(3, 0, dtype=torch.long)


def _item_positions(t: int, h: int, w: int, step: float) -> torch.Tensor:
    """[3, t * h * w] (temporal, height, width) of one image or video's merged grid, the temporal
    index ``step`` apart (truncated after the multiply)."""
    tt = (torch.arange(t).view(-1, 1).expand(-1, h * w) * step).long().flatten()
    hh = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
    ww = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
    return torch.stack([tt, hh, ww])


def _rows(value: torch.Tensor | None) -> list[Any]:
    return [] if value is None else torch.as_tensor(value).tolist()
