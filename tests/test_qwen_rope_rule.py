"""Qwen2.5-VL's rope positions by Qwen's rule (``roll.models.qwen_rope_rule``), which every roll path
uses through transformers' ``get_rope_index`` (tests/conftest.py puts it in this process too):

- a left-padded batch of a video row and an image row: each row's positions at its tokens equal
  the rule as SGLang and vLLM compute it (tests/sglang_rope_rule.py), 0 at padding, and the deltas
  continue them; transformers 5.3+'s own rule starts the text after the video 3 earlier;
- a video's temporal step is applied before truncating (0.5 s x 2 tokens per second: 1 apart);
- transformers' model takes it: the tiny Qwen2.5-VL's logits of a video row equal its logits with
  those positions given explicitly, and differ from them with transformers' own rule's positions.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sglang_rope_rule import sglang_positions  # noqa: E402
from tiny_vl import build_tiny_vl_tokenizer, tiny_vl_config  # noqa: E402

from roll.models.qwen_rope_rule import qwen_rope_index, transformers_rope_index, use_qwen_rope_rule  # noqa: E402
from roll.models.vision import token_types  # noqa: E402


def _config():
    return tiny_vl_config(build_tiny_vl_tokenizer())


class _Host:
    """What ``get_rope_index`` reads of a model: its config (and transformers' own, this method)."""

    def __init__(self, config):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        self.config = config
        self.get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids.__get__(self)


def _video_row(config) -> list[int]:
    start, end, video = config.vision_start_token_id, config.vision_end_token_id, config.video_token_id
    return [5, 5, 5, start, *[video] * 8, end, 6, 6, 6, 6]


def _image_row(config) -> list[int]:
    start, end, image = config.vision_start_token_id, config.vision_end_token_id, config.image_token_id
    return [5, start, *[image] * 2, end, 6, start, *[image] * 4, end, 7]


def test_transformers_get_rope_index_is_qwens_rule_once_used():
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    use_qwen_rope_rule()
    use_qwen_rope_rule()
    assert Qwen2_5_VLModel.get_rope_index is qwen_rope_index
    assert transformers_rope_index() is not qwen_rope_index


def test_a_left_padded_video_and_image_batch_takes_qwens_positions():
    config = _config()
    video, image = _video_row(config), _image_row(config)
    width = max(len(video), len(image)) + 2
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, tokens in enumerate((video, image)):
        ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    grids = {
        "image_grid_thw": torch.tensor([[1, 2, 4], [1, 4, 4]]),
        "video_grid_thw": torch.tensor([[2, 4, 4]]),
    }
    positions, deltas = qwen_rope_index(
        _Host(config),
        ids,
        token_types(ids, config),
        second_per_grid_ts=torch.tensor([1.0]),
        attention_mask=mask,
        **grids,
    )
    v, i = config.video_token_id, config.image_token_id
    want_video = sglang_positions(video, i, v, [], [[2, 4, 4]], video_intervals=[4.0])  # tokens_per_second 4
    want_image = sglang_positions(image, i, v, [[1, 2, 4], [1, 4, 4]], [])
    assert torch.equal(positions[:, 0, width - len(video) :], want_video)
    assert torch.equal(positions[:, 1, width - len(image) :], want_image)
    assert not positions[:, 0, : width - len(video)].any() and not positions[:, 1, : width - len(image)].any()
    assert deltas.tolist() == [
        [int(want_video.max()) + 1 - len(video)],
        [int(want_image.max()) + 1 - len(image)],
    ]
    theirs, _ = transformers_rope_index()(
        _Host(config),
        ids,
        token_types(ids, config),
        second_per_grid_ts=torch.tensor([1.0]),
        attention_mask=mask,
        **grids,
    )
    after = width - len(video) + 12  # the video row's text after the video
    assert torch.equal(theirs[:, 0, after:] + 3, positions[:, 0, after:])
    assert torch.equal(theirs[:, 1], positions[:, 1])  # images: the two rules agree


def test_a_fractional_temporal_step_is_truncated_after_the_multiply():
    config = _config()
    config.vision_config.tokens_per_second = 2
    ids = torch.tensor([_video_row(config)])
    positions, _ = qwen_rope_index(
        _Host(config), ids, video_grid_thw=torch.tensor([[2, 4, 4]]), second_per_grid_ts=torch.tensor([0.5])
    )
    assert positions[0, 0, 4:12].tolist() == [4, 4, 4, 4, 5, 5, 5, 5]  # 0.5 s x 2 per second: 1 apart


def test_transformers_model_lays_a_video_row_at_qwens_positions():
    from transformers import Qwen2_5_VLForConditionalGeneration

    use_qwen_rope_rule()
    config = _config()
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    ids = torch.tensor([_video_row(config)])
    grid = torch.tensor([[2, 4, 4]])
    patch = (
        config.vision_config.in_channels
        * config.vision_config.temporal_patch_size
        * config.vision_config.patch_size**2
    )
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "pixel_values_videos": torch.randn(int(grid.prod()), patch),
        "video_grid_thw": grid,
        "second_per_grid_ts": torch.tensor([1.0]),
        "mm_token_type_ids": token_types(ids, config),
    }
    ours, _ = qwen_rope_index(
        _Host(config),
        ids,
        inputs["mm_token_type_ids"],
        video_grid_thw=grid,
        second_per_grid_ts=torch.tensor([1.0]),
    )
    theirs, _ = transformers_rope_index()(
        _Host(config),
        ids,
        inputs["mm_token_type_ids"],
        video_grid_thw=grid,
        second_per_grid_ts=torch.tensor([1.0]),
    )
    with torch.no_grad():
        plain = model(**inputs).logits
        given = model(**inputs, position_ids=ours).logits
        other = model(**inputs, position_ids=theirs).logits
    assert torch.allclose(plain, given, atol=1e-6)
    assert not torch.allclose(plain[:, 12:], other[:, 12:], atol=1e-4)
