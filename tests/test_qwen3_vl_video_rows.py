"""Qwen3-VL video rows on CPU (tests/tiny_qwen3_vl.py): Video-R1 rows whose prompt holds each
temporal patch's time (roll.models.video_prompt), their ids against transformers' Qwen3VLProcessor
(the whole processor where torchvision is installed), the pixel layout against Qwen3-VL's video
processor's patchify, hf_infer generating and scoring with them, transformers' rope index taking
each patch as its own grid, and the vLLM requests (each video back to one placeholder, the frames
with their metadata)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("av")  # PyAV decodes the videos (the [vision] extra)

sys.path.insert(0, str(Path(__file__).parent))
from test_vision_batch import _hf_infer  # noqa: E402
from tiny_qwen3_vl import QWEN3_VIDEO_ARGS, build_tiny_qwen3_vl_dir  # noqa: E402
from tiny_vl import video_r1_rows  # noqa: E402

from roll.configs.role import DataArgs  # noqa: E402
from roll.core.batch import object_array  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.strategy.engine_vision import vision_tokens, vllm_prompts  # noqa: E402
from roll.distributed.strategy.generation import prompt_token_lists  # noqa: E402
from roll.models.video_prompt import collapse_timestamped_videos  # noqa: E402
from roll.models.vision import MULTI_MODAL_INPUTS, VisionProcessor, forward_kwargs, token_types  # noqa: E402
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402

PROMPT_LENGTH = 700
PAD, START, END = "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
# The tiny row's video as Qwen3-VL's processor writes it (tiny_qwen3_vl.QWEN3_VIDEO_ARGS).
VIDEO_TEXT = f"{START}<0.2 seconds>{START}{PAD * 4}{END}<1.5 seconds>{START}{PAD * 4}{END}{END}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl_video")
    model = build_tiny_qwen3_vl_dir(root / "model", std=0.1)
    return root, model, VisionProcessor.load(str(model))


def load(root: Path, processor, n: int = 2):
    path = root / "video_r1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in video_r1_rows(root / "videos", n)))
    data_args = DataArgs(file_name=[str(path)], row_layout="video_r1", **QWEN3_VIDEO_ARGS)
    return load_prompt_files(
        data_args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", processor
    )


def video_batch(setup, n: int = 2):
    root, _, processor = setup
    rows = load(root, processor, n).rows
    return to_batch(rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)


def test_the_prompt_holds_each_temporal_patchs_time_and_tokens(setup):
    root, _, processor = setup
    assert processor.timestamped_videos and processor.patch_size == 16
    row = load(root, processor, 1).rows[0]
    plan = row.video_plans[0]
    assert (plan.indices, plan.height, plan.width, plan.rate, plan.total) == ((0, 2, 5, 7), 64, 64, 4.0, 8)
    text = processor.tokenizer.decode(row.prompt_ids)
    assert VIDEO_TEXT in text  # frames 0, 2 -> (0 + 0.5) / 2 s; frames 5, 7 -> (1.25 + 1.75) / 2 s
    assert f"{START}{PAD}{END}" in row.prompt_text  # the template's placeholder, before expansion
    expanded = row.prompt_text.replace(f"{START}{PAD}{END}", VIDEO_TEXT)
    assert row.prompt_ids == processor.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    assert processor.tokenizer.unk_token_id not in row.prompt_ids


def test_the_ids_and_pixels_equal_transformers_processors(setup):
    """The whole Qwen3VLProcessor (its video processor needs torchvision) on the same frames."""
    pytest.importorskip("torchvision")
    import numpy as np
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    root, _, processor = setup
    model = build_tiny_qwen3_vl_dir(root / "full", std=0.1, full_processor=True)
    hf = AutoProcessor.from_pretrained(model)
    assert type(hf).__name__ == "Qwen3VLProcessor"
    row = load(root, processor, 1).rows[0]
    mm = video_batch(setup, 1)[MULTI_MODAL_INPUTS][0]
    frames, meta = to_batch([row], 0, PROMPT_LENGTH, processor)["multi_modal_data"][0]["video"][0]
    out = hf(
        text=[row.prompt_text],
        videos=[np.ascontiguousarray(frames)],
        video_metadata=[
            VideoMetadata(
                total_num_frames=meta["total_num_frames"],
                fps=meta["fps"],
                frames_indices=meta["frames_indices"],
            )
        ],  # fmt: skip
        do_sample_frames=False,
        do_resize=False,
        return_tensors="pt",
    )
    ids = torch.tensor([row.prompt_ids])
    assert torch.equal(out["input_ids"], ids)
    assert torch.equal(out["mm_token_type_ids"].to(torch.int32), token_types(ids, _config(setup)))
    assert torch.equal(out["video_grid_thw"], mm["video_grid_thw"])
    assert torch.allclose(out["pixel_values_videos"], mm["pixel_values_videos"], atol=1e-5)


def _config(setup):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(setup[1])


def test_pixels_are_qwen3_vl_video_processors_patch_layout(setup):
    """Consecutive frames paired into one temporal patch, patches in merge order: the layout of
    transformers' Qwen3VLVideoProcessor.patchify (normalised as the image processor does)."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    processor = setup[2]
    gen = np.random.default_rng(0)
    frames = [Image.fromarray(gen.integers(0, 255, (64, 96, 3), dtype=np.uint8)) for _ in range(4)]
    got = processor.video_inputs([frames], [2.0])
    assert "second_per_grid_ts" not in got  # Qwen3-VL's times are in the prompt
    ip = processor.image_processor
    video = torch.tensor(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2).double()
    mean, std = torch.tensor(ip.image_mean).view(3, 1, 1), torch.tensor(ip.image_std).view(3, 1, 1)
    video = ((video * ip.rescale_factor - mean) / std).float()[None]
    want, t, h, w = Qwen3VLVideoProcessor().patchify(
        video, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    assert got["video_grid_thw"].tolist() == [[t, h, w]] == [[2, 4, 6]]
    assert torch.allclose(got["pixel_values_videos"], want[0], atol=1e-5)


def test_rope_index_takes_each_temporal_patch_as_its_own_grid(setup):
    _, model, _ = setup
    batch = video_batch(setup, 1)
    ids = batch["prompts"]
    net = _hf_infer(model, "reference", 1).model
    kwargs = forward_kwargs(batch, "cpu", ids, net)
    assert set(kwargs) == {"pixel_values_videos", "video_grid_thw", "mm_token_type_ids"}
    positions, _ = net.model.get_rope_index(
        ids,
        kwargs["mm_token_type_ids"],
        video_grid_thw=kwargs["video_grid_thw"],
        attention_mask=batch["prompt_mask"],
    )
    video = (kwargs["mm_token_type_ids"][0] == 2).nonzero().flatten().tolist()
    first, second = video[:4], video[4:]
    assert second[0] - first[-1] > 1  # "<1.5 seconds>" and the vision end / start between them
    # each patch starts at its text position on all axes (a 2 x 2 grid of one frame): not patch 1 of one grid
    for patch in (first, second):
        at = positions[:, 0, patch]
        assert at[0].tolist() == [at[0, 0].item()] * 4
        assert (at[1] - at[1, 0]).tolist() == [0, 0, 1, 1] and (at[2] - at[2, 0]).tolist() == [0, 1, 0, 1]
    assert positions[0, 0, second[0]] == positions[0, 0, second[0] - 1] + 1


def test_hf_infer_generates_and_scores_with_videos(setup):
    _, model, _ = setup
    strategy = _hf_infer(model, "actor_infer", 2)
    batch = video_batch(setup)
    out = strategy.generate(
        batch, SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seed=0, logprobs=True)
    )
    scored = strategy.compute_log_probs(out)["log_probs"]
    mask = out["response_mask"].bool()
    assert torch.allclose(scored[mask], out["infer_logprobs"][mask], atol=1e-4)
    blind = out.select()
    blind.non_tensors[MULTI_MODAL_INPUTS] = object_array(
        [
            {**r, "pixel_values_videos": torch.zeros_like(r["pixel_values_videos"])}
            for r in out[MULTI_MODAL_INPUTS]
        ]
    )
    other = strategy.compute_log_probs(blind)["log_probs"]
    assert not torch.allclose(other[mask], scored[mask], atol=1e-3)  # the frames reach the model


def test_vllm_requests_hold_one_placeholder_per_video_and_the_frames_metadata(setup):
    _, model, processor = setup
    batch = video_batch(setup)
    tokens = vision_tokens(str(model))
    start, end = tokens.frames
    assert (start, end) == tuple(processor.tokenizer.convert_tokens_to_ids([START, END]))
    ids = prompt_token_lists(batch)
    for row, request in zip(
        load(setup[0], processor).rows, vllm_prompts(batch, ids, tokens.image, tokens.video, tokens.frames)
    ):
        # The template's placeholder inside the video's outer start and end: vLLM 0.24's Qwen3-VL
        # processing replaces the inner start-video-end, so the expanded prompt is roll's row.
        template = processor.tokenizer(row.prompt_text, add_special_tokens=False)["input_ids"]
        at = template.index(tokens.video)
        want = template[:at] + [start, tokens.video, end] + template[at + 1 :]
        assert template[at - 1 : at + 2] == [start, tokens.video, end]
        assert request["prompt_token_ids"] == want
        ((frames, metadata),) = request["multi_modal_data"]["video"]
        assert frames.shape == (4, 64, 64, 3)
        assert metadata == {
            "fps": 4.0,
            "frames_indices": [0, 2, 5, 7],
            "total_num_frames": 8,
            "duration": 2.0,
            "do_sample_frames": False,
        }
        assert request["mm_processor_kwargs"] == {"do_resize": False}
    with pytest.raises(ValueError, match="2 video token runs for 1 videos"):
        vllm_prompts(batch, ids, tokens.image, tokens.video)  # without the frames' marks


def test_collapse_keeps_other_layouts():
    v, s, e, t = 9, 7, 8, 5  # video, start, end, a time token
    one = [1, s, t, t, s, v, v, e, t, s, v, v, e, e, 2]
    assert collapse_timestamped_videos(one, v, s, e) == [1, s, s, v, e, e, 2]
    two = one[:-1] + [3, s, t, s, v, e, e]
    assert collapse_timestamped_videos(two, v, s, e) == [1, s, s, v, e, e, 3, s, s, v, e, e]
    for kept in ([s, v, v, e], [s, t, s, v, e], [s, t, e, e], [s, t, s, e, e]):  # Qwen2-VL's; cut; no tokens
        assert collapse_timestamped_videos(kept, v, s, e) == kept
