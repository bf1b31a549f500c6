"""Qwen3-VL video rows on the Megatron strategies, two gloo ranks on CPU (fp32), the tiny model
(tests/tiny_qwen3_vl.py): Video-R1 rows (each temporal patch's time in the prompt,
roll.models.video_prompt), an image row and a text row in one batch.

- log-probs equal transformers' Qwen3VLForConditionalGeneration's (its rope index with the videos'
  grids, deepstack at the video and image tokens) on megatron_train DP=2, TP=2 + SP and PP=2;
- a train step on them moves the vision tower and the language model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")
pytest.importorskip("av")  # PyAV decodes the videos (the [vision] extra)

from test_megatron_vl_cpu import check_log_probs, check_train_step  # noqa: E402
from tiny_qwen3_vl import QWEN3_VIDEO_ARGS, build_tiny_qwen3_vl_dir  # noqa: E402
from tiny_vl import detection_rows, video_r1_rows  # noqa: E402
from two_rank_training import megatron_rank, run_two_ranks  # noqa: E402
from vl_cases import VIDEO_PROMPT_LENGTH, _with_responses, hf_log_probs  # noqa: E402

from roll.configs.role import DataArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.models.vision import MULTI_MODAL_INPUTS, VisionProcessor  # noqa: E402
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402


def qwen3_vl_video_batch(model: Path, scratch: Path) -> Batch:
    """Two Video-R1 rows (two temporal patches of 4 tokens each), a detection row and a text row,
    interleaved, with random responses."""
    processor = VisionProcessor.load(str(model))
    videos = scratch / "video_r1.jsonl"
    videos.write_text("".join(json.dumps(r) + "\n" for r in video_r1_rows(scratch / "videos", 2)))
    others = detection_rows(scratch / "images", 1)
    others.append(
        {"data_source": "text", "prompt": [{"role": "user", "content": "Red?"}], "ground_truth": "red"}
    )
    images = scratch / "other_rows.jsonl"
    images.write_text("".join(json.dumps(r) + "\n" for r in others))
    loaded = []
    for args in (
        DataArgs(file_name=[str(videos)], row_layout="video_r1", **QWEN3_VIDEO_ARGS),
        DataArgs(file_name=[str(images)], messages="prompt"),
    ):
        loaded += load_prompt_files(
            args, processor.tokenizer, VIDEO_PROMPT_LENGTH, "actor_train.data_args", processor
        ).rows
    order = [0, 2, 1, 3]  # video, image, video, text: the rows' grids interleave
    rows = [loaded[i] for i in order]
    prompts = to_batch(rows, processor.tokenizer.pad_token_id, VIDEO_PROMPT_LENGTH, processor)
    out = _with_responses(prompts, processor, 0)
    assert [bool(r and "pixel_values_videos" in r) for r in out[MULTI_MODAL_INPUTS]] == [
        True,
        False,
        True,
        False,
    ]
    return out


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        for name in ("dp2", "tp2_sp", "pp2"):
            bad += check_log_probs(path, Path(scratch), name)
            dist.barrier()
        bad += check_train_step(path, Path(scratch), False, "tp2_sp")
        dist.barrier()


def test_megatron_qwen3_vl_scores_and_trains_video_rows(tmp_path: Path) -> None:
    model = build_tiny_qwen3_vl_dir(tmp_path / "model", std=0.1)
    batch = qwen3_vl_video_batch(model, tmp_path)
    torch.save(batch, tmp_path / "batch.pt")
    want = hf_log_probs(model, batch)
    torch.save(want, tmp_path / "want.pt")
    no_video = torch.load(tmp_path / "batch.pt", weights_only=False)
    no_video.non_tensors[MULTI_MODAL_INPUTS][0] = {
        k: torch.zeros_like(v) if k == "pixel_values_videos" else v
        for k, v in no_video[MULTI_MODAL_INPUTS][0].items()
    }
    assert not torch.allclose(hf_log_probs(model, no_video)[0], want[0], atol=1e-3)  # the frames count
    bad = run_two_ranks(_worker, (str(model), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)
