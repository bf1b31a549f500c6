"""SGLang 0.5.16's Qwen2.5-VL tower layout (full attention across a video's temporal patches,
tests/sglang_vision_tower.py) on transformers' tower, on CPU: it moves video rows' log-probs by about
what SGLang's video rows sat off the trainers on an H200 (mean 0.02) and image rows not at all, and
that layout given each video's grid split per temporal patch (``sglang_frames``, what roll's SGLang
schedulers run) is the reference tower."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("av")  # the video rows' frames are decoded with PyAV

sys.path.insert(0, str(Path(__file__).parent))
from engine_vl_gpu import save_image_rows, video_prompts, vl_prompts  # noqa: E402
from sglang_vision_tower import tower_attends_across_frames  # noqa: E402
from tiny_vl import build_tiny_vl_dir  # noqa: E402

from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402
from roll.distributed.strategy.sglang_frames import attend_within_frames  # noqa: E402
from roll.models.logprobs import response_log_probs  # noqa: E402


def _moved(model, prompts) -> torch.Tensor:
    """|log-prob change| of 16 random response tokens per row when the tower attends across frames."""
    gen = torch.Generator().manual_seed(0)
    responses = torch.randint(5, 200, (len(prompts), 16), generator=gen).tolist()
    batch = build_generation_batch(prompts, responses, None, 1, 0, 16)
    with torch.no_grad():
        own = response_log_probs(model, batch)["log_probs"]
        with tower_attends_across_frames():
            across = response_log_probs(model, batch)["log_probs"]
    return (own - across).abs()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(root, the tiny Qwen2.5-VL's directory, the model in fp32, its two Video-R1 rows)."""
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("tower")
    model_dir = build_tiny_vl_dir(root / "vl", seed=0, std=0.1)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return root, model_dir, model, video_prompts(root, model_dir)


def test_the_tower_across_frames_moves_video_rows_only(tiny):
    root, model_dir, model, videos = tiny
    assert all(mm["video_grid_thw"][0, 0] > 1 for mm in videos["multi_modal_inputs"])
    moved = _moved(model, videos)
    assert 0.005 < moved.mean() < 0.1, moved.mean()
    save_image_rows(root)
    assert _moved(model, vl_prompts(root, model_dir)).max() == 0


def test_the_tower_across_frames_on_a_split_grid_is_the_reference_tower(tiny, monkeypatch):
    _, _, model, videos = tiny
    tower = model.model.visual
    mm = videos["multi_modal_inputs"][0]
    pixels, grid = mm["pixel_values_videos"], mm["video_grid_thw"]
    assert grid[0, 0] > 1
    with torch.no_grad():
        reference = tower(pixels, grid_thw=grid).pooler_output
        with tower_attends_across_frames():
            across = tower(pixels, grid_thw=grid).pooler_output
            monkeypatch.setattr(type(tower), "forward", type(tower).forward)  # restored after the test
            attend_within_frames(type(tower))
            split = tower(pixels, grid_thw=grid).pooler_output
    assert (across - reference).abs().max() > 1e-3
    torch.testing.assert_close(split, reference, rtol=1e-5, atol=1e-5)
