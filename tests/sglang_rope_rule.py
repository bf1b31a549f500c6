"""SGLang 0.5.16's rule for Qwen-VL rope positions, written again for the CPU tests (SGLang does
not run here): sglang/srt/layers/rotary_embedding/mrope_rope_index.py ``get_rope_index``. Text counts
up on all three axes; an image's or video's tokens take its merged grid (``t`` temporal patches
spaced by ``interval``: Qwen2.5-VL's ``tokens_per_second * second_per_grid_t``, truncated after the
multiply), offset by where the item starts; the text after an item starts one past the item's
largest position on any axis (line 193, ``llm_pos_ids_list[-1].max() + 1``). Qwen3-VL's videos
(``split_videos``) count as one ``[1, h, w]`` grid per temporal patch.
"""

from __future__ import annotations

import itertools

import torch


def sglang_positions(
    ids: list[int],
    image: int,
    video: int,
    image_grids: list[list[int]],
    video_grids: list[list[int]],
    merge: int = 2,
    video_intervals: list[float] | None = None,
    split_videos: bool = False,
) -> torch.Tensor:
    """[3, len(ids)] positions of ``ids`` under SGLang's rule (grids in row order)."""
    if split_videos:
        video_grids = [[1, h, w] for t, h, w in video_grids for _ in range(t)]
        video_intervals = None
    grids = {image: iter(image_grids), video: iter(video_grids)}
    intervals = iter(video_intervals or [1.0] * len(video_grids))
    out, next_pos = [], 0
    for token, group in itertools.groupby(ids, key=lambda t: t if t in (image, video) else None):
        n = len(list(group))
        if token is None:
            out.append(torch.arange(n).expand(3, -1) + next_pos)
        else:
            t, h, w = next(grids[token])
            step = next(intervals) if token == video else 0.0
            gt, gh, gw = t, h // merge, w // merge
            assert gt * gh * gw == n, (gt, gh, gw, n)
            tt = (torch.arange(gt).view(-1, 1).expand(-1, gh * gw) * step).long().flatten()
            hh = torch.arange(gh).view(1, -1, 1).expand(gt, -1, gw).flatten()
            ww = torch.arange(gw).view(1, 1, -1).expand(gt, gh, -1).flatten()
            out.append(torch.stack([tt, hh, ww]) + next_pos)
        next_pos = int(out[-1].max()) + 1
    return torch.cat(out, dim=1)


def trainer_positions(hf_config, ids: list[int], inputs: dict) -> torch.Tensor:
    """[3, len(ids)] positions roll's trainers compute for one row (``rope_index_positions`` with the
    model type's transformers class: Qwen2.5-VL by Qwen's rule, ``roll.models.qwen_rope_rule``)."""
    import importlib

    from roll.models.rope_index import rope_index_positions

    module, name = TRANSFORMERS_CLASSES[hf_config.model_type]

    extra = {}
    if inputs.get("second_per_grid_ts") is not None:
        extra["second_per_grid_ts"] = torch.as_tensor(inputs["second_per_grid_ts"])
    grid = lambda key: None if inputs.get(key) is None else torch.as_tensor(inputs[key])  # noqa: E731
    return rope_index_positions(
        getattr(importlib.import_module(f"transformers.models.{module}"), name),
        torch.tensor([ids]),
        hf_config,
        image_grid_thw=grid("image_grid_thw"),
        video_grid_thw=grid("video_grid_thw"),
        **extra,
    )[:, 0]


# model_type -> (transformers.models submodule, the model class whose get_rope_index the trainers use)
TRANSFORMERS_CLASSES = {
    "qwen2_5_vl": ("qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel"),
    "qwen3_vl": ("qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel"),
    "qwen3_vl_moe": ("qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeModel"),
}
