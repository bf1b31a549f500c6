"""Video prompt rows on CPU: ROLL's Video-R1 layout read, frames sampled and resized as Qwen's
fetch_video does, the processor's video fields (Qwen2-VL's temporal patch layout), hf_infer
generating and scoring with videos, the prompts vLLM is sent, and the errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("av")  # PyAV decodes the videos (the [vision] extra)

sys.path.insert(0, str(Path(__file__).parent))
from test_vision_batch import _hf_infer  # noqa: E402
from tiny_vl import VIDEO_ARGS, build_tiny_vl_dir, video_r1_rows, write_video  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.role import DataArgs  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.strategy.engine_vision import vision_tokens, vllm_prompts  # noqa: E402
from roll.distributed.strategy.generation import prompt_token_lists  # noqa: E402
from roll.models.vision import MULTI_MODAL_INPUTS, VisionProcessor, forward_kwargs, token_types  # noqa: E402
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402
from roll.pipeline.rlvr.data.video import VideoOptions, frame_plan, smart_resize  # noqa: E402

PROMPT_LENGTH = 600  # the tiny tokenizer spends ~530 tokens on Video-R1's template


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_rows")
    model = build_tiny_vl_dir(root / "model", seed=0, std=0.1)
    return root, model, VisionProcessor.load(str(model))


def load(root: Path, processor, rows: list[dict], **args):
    path = root / "video_r1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data_args = DataArgs(file_name=[str(path)], row_layout="video_r1", **{**VIDEO_ARGS, **args})
    return load_prompt_files(
        data_args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", processor
    )


def video_batch(setup, n: int = 2):
    root, _, processor = setup
    dataset = load(root, processor, video_r1_rows(root / "videos", n))
    return to_batch(dataset.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)


@pytest.mark.parametrize(
    "total, rate, options, indices, fps",
    [
        (8, 4.0, VideoOptions(fps=2.0), (0, 2, 5, 7), 2.0),  # 8 / 4 * 2 = 4 frames
        (100, 25.0, VideoOptions(fps=2.0), (0, 14, 28, 42, 57, 71, 85, 99), 2.0),  # 8 frames
        (100, 25.0, VideoOptions(fps=2.0, max_frames=5), (0, 33, 66, 99), 1.0),  # at most 5: even, 4
        (3, 1.0, VideoOptions(), (0, 2), 2 / 3),  # at least 4 frames, but only 3: 2 (even)
    ],
)
def test_frame_plan_samples_evenly_at_the_rate(total, rate, options, indices, fps):
    plan = frame_plan(total, rate, 56, 56, options)
    assert plan.indices == indices
    assert plan.fps == pytest.approx(fps)


def test_smart_resize_keeps_multiples_of_28_within_the_bounds():
    assert smart_resize(100, 60, 3136, 4 * 3136) == (112, 56)  # rounded, 6272 pixels within bounds
    assert smart_resize(560, 560, 3136, 4 * 3136) == (112, 112)  # scaled down to the max
    assert smart_resize(20, 20, 4 * 3136, 16 * 3136) == (112, 112)  # scaled up to the min
    # a video's max is min(video_max_pixels, total_pixels / frames * 2): 4 frames * 3136 -> 56 x 56
    plan = frame_plan(8, 4.0, 112, 112, VideoOptions(fps=2.0, min_pixels=1, total_pixels=2 * 3136))
    assert (plan.height, plan.width) == (56, 56)


def test_video_inputs_pair_consecutive_frames_in_the_image_processors_patch_layout(setup):
    from PIL import Image

    processor = setup[2]
    a, b = (Image.new("RGB", (56, 56), c) for c in ((200, 10, 10), (10, 10, 200)))
    same = processor.video_inputs([[a, a]], [2.0])
    image = processor.image_inputs([a], (56 * 56, 56 * 56))
    assert torch.equal(same["pixel_values_videos"], image["pixel_values"])  # an image is 2 equal frames
    assert same["video_grid_thw"].tolist() == [[1, 4, 4]]
    two = processor.video_inputs([[a, b, b, a]], [4.0])
    assert two["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert two["second_per_grid_ts"].tolist() == [0.5]  # 2 frames per patch at 4 frames a second
    patches = two["pixel_values_videos"].reshape(2, 16, 3, 2, 14, 14)  # [t, patches, C, tp, p, p]
    frame = {
        k: processor.image_inputs([im], (3136, 3136))["pixel_values"].reshape(16, 3, 2, 14, 14)[:, :, 0]
        for k, im in (("a", a), ("b", b))
    }
    for t, (first, second) in enumerate((("a", "b"), ("b", "a"))):
        assert torch.equal(patches[t, :, :, 0], frame[first])
        assert torch.equal(patches[t, :, :, 1], frame[second])
    assert processor.video_tokens(4, 56, 56) == 8


def test_video_r1_rows_read_with_the_question_template_and_their_type(setup):
    batch = video_batch(setup)
    processor = setup[2]
    assert list(batch["tag"]) == ["video", "video"]  # modality_type
    assert batch["ground_truth"][1] == "<answer>B</answer>"  # solution
    assert batch["reward_context"][0] == {"problem_type": "multiple choice"}
    text = processor.tokenizer.decode(batch["prompts"][0][batch["prompt_mask"][0].bool()])
    assert "<|vision_start|>" + "<|video_pad|>" * 8 + "<|vision_end|>" in text.replace(" ", "")
    mm = batch[MULTI_MODAL_INPUTS][0]
    assert mm["video_grid_thw"].tolist() == [[2, 4, 4]]  # 4 frames at 2 fps of the 8 at 4 fps
    assert mm["pixel_values_videos"].shape == (32, 3 * 2 * 14 * 14)
    assert mm["second_per_grid_ts"].tolist() == [1.0]
    engine = batch["multi_modal_data"][0]
    assert engine["video"][0].shape == (4, 56, 56, 3)
    assert engine["mm_processor_kwargs"] == {
        "video_metadata": [{"total_num_frames": 4, "fps": 2.0, "frames_indices": [0, 1, 2, 3]}],
        "min_pixels": 3136,
        "max_pixels": 3136,
    }
    assert (
        engine["video"][0][0, 28, 28, 0] > 150 and engine["video"][0][-1, 28, 28, 2] > 150
    )  # red, then blue


def test_the_engines_video_metadata_gives_transformers_processor_roll_s_second_per_grid_ts(setup):
    """vLLM runs transformers' Qwen2.5-VL processor on the frames with the row's
    ``mm_processor_kwargs``; its ``second_per_grid_ts`` is temporal_patch_size over the metadata's
    ``sampled_fps``, which must be the row's fps (without metadata transformers takes 24 fps)."""
    from transformers.video_utils import VideoMetadata, make_batched_metadata

    batch = video_batch(setup)
    processor = setup[2]
    for mm, engine in zip(batch[MULTI_MODAL_INPUTS], batch["multi_modal_data"], strict=True):
        metadata = [VideoMetadata(**m) for m in engine["mm_processor_kwargs"]["video_metadata"]]
        got = [processor.temporal_patch_size / m.sampled_fps for m in metadata]
        assert got == mm["second_per_grid_ts"].tolist() == [1.0]
        assert [m.total_num_frames for m in metadata] == [len(v) for v in engine["video"]]
        assert make_batched_metadata(engine["video"], None)[0].sampled_fps == 24  # what vLLM got before


def test_hf_infer_generates_and_scores_with_videos(setup):
    _, model, _ = setup
    strategy = _hf_infer(model, "actor_infer", 2)
    out = strategy.generate(
        video_batch(setup), SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seed=0, logprobs=True)
    )
    scored = strategy.compute_log_probs(out)["log_probs"]
    mask = out["response_mask"].bool()
    assert torch.allclose(scored[mask], out["infer_logprobs"][mask], atol=1e-4)


def test_the_forward_gets_3d_rope_positions_from_the_token_types(setup):
    _, model, processor = setup
    batch = video_batch(setup, 1)
    ids = batch["prompts"]
    hf_model = _hf_infer(model, "reference", 1).model
    config = hf_model.config
    types = token_types(ids, config)
    assert int((types == 2).sum()) == 8 and int((types == 1).sum()) == 0
    kwargs = forward_kwargs(batch, "cpu", ids, hf_model)
    assert torch.equal(kwargs["mm_token_type_ids"], types)
    assert set(kwargs) == {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids"}
    from transformers import AutoModelForImageTextToText

    net = AutoModelForImageTextToText.from_pretrained(str(model))
    mask = batch["prompt_mask"]
    with torch.no_grad():
        positions, _ = net.model.get_rope_index(
            ids,
            video_grid_thw=kwargs["video_grid_thw"],
            attention_mask=mask,
            second_per_grid_ts=kwargs["second_per_grid_ts"],
            mm_token_type_ids=types,
        )
    start = int(types[0].nonzero()[0])
    # the 8 video tokens: the second temporal patch 1 s later (second_per_grid_ts) at tokens_per_second
    # positions a second; h and w a 2 x 2 grid
    step = int(net.config.vision_config.tokens_per_second)
    assert (positions[0, 0, start : start + 8] - positions[0, 0, start]).tolist() == [0] * 4 + [step] * 4
    assert (positions[1, 0, start : start + 4] - positions[1, 0, start]).tolist() == [0, 0, 1, 1]


def test_vllm_prompts_collapse_video_tokens_and_carry_the_frames(setup):
    _, model, processor = setup
    batch = video_batch(setup)
    image, video = vision_tokens(str(model)).image, vision_tokens(str(model)).video
    assert video == processor.video_token_id
    ids = prompt_token_lists(batch)
    for row, request in zip(ids, vllm_prompts(batch, ids, image, video)):
        assert request["prompt_token_ids"].count(video) == 1
        assert len(request["prompt_token_ids"]) == len(row) - 7
        assert request["multi_modal_data"]["video"][0].shape == (4, 56, 56, 3)
        assert request["mm_processor_kwargs"]["video_metadata"][0]["fps"] == 2.0
    with pytest.raises(ValueError, match="0 video token runs for 1 videos"):
        vllm_prompts(batch, ids, image, None)


def test_a_row_of_several_videos_gets_cache_ids_of_the_row_as_a_whole():
    """vLLM processes only the videos its cache misses, with the row's whole metadata list: a row
    of several videos sends ids that make its videos hit or miss together (one per video, the same
    for the same frames, other when any frame differs); a row of one video sends none."""
    import numpy as np

    from roll.core.batch import Batch

    image, video = 5, 6
    frames = [np.full((4, 56, 56, 3), c, dtype=np.uint8) for c in (10, 20, 30)]

    def row(videos):
        kwargs = {
            "video_metadata": [{"total_num_frames": 4, "fps": 2.0, "frames_indices": [0, 1, 2, 3]}]
            * len(videos)
        }
        return {"video": videos, "mm_processor_kwargs": kwargs}

    rows = [
        row([frames[0], frames[1]]),
        row([frames[0], frames[2]]),
        row([frames[0], frames[1]]),
        row([frames[2]]),
    ]
    ids = [
        [1, video, video, 2, video, video],
        [1, video, video, 2, video, video],
        [1, video, video, 2, video, video],
        [1, video, video],
    ]
    batch = Batch.from_dict({"prompts": torch.zeros(4, 6, dtype=torch.long)}, {"multi_modal_data": rows})
    sent = vllm_prompts(batch, ids, image, video)
    first, second, again, single = (p.get("multi_modal_uuids") for p in sent)
    assert len(first["video"]) == 2 and len(set(first["video"])) == 2
    assert again == first and not set(first["video"]) & set(second["video"])
    assert single is None


def test_bad_video_rows(setup, tmp_path):
    _, _, processor = setup
    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "broken.mp4").write_bytes(b"not a video")
    rows = video_r1_rows(tmp_path / "videos", 1)
    with pytest.raises(ConfigError, match=r"video_r1.jsonl:1: video 0 .*broken.mp4.* cannot be read"):
        load(tmp_path, processor, [{**rows[0], "video": "videos/broken.mp4"}])
    bad = [{**rows[0], "problem_type": "essay"}, {k: v for k, v in rows[0].items() if k != "solution"}]
    dataset = load(tmp_path, processor, bad + rows)
    assert [str(b).split(": ", 1)[1] for b in dataset.bad_rows] == [
        "wrong value: problem_type 'essay'; one of multiple choice, numerical, OCR, free-form, regression",
        "missing field: 'solution' (a Video-R1 row's answer)",
    ]
    with pytest.raises(ConfigError, match="the row has videos but the model is not a vision-language model"):
        data_args = DataArgs(file_name=[str(tmp_path / "video_r1.jsonl")], row_layout="video_r1")
        load_prompt_files(data_args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", None)


def test_video_folder_is_searched_first(setup, tmp_path):
    _, _, processor = setup
    write_video(tmp_path / "store" / "clips" / "c.mp4", [(0, 0, 0)] * 4)
    row = {**video_r1_rows(tmp_path / "videos", 1)[0], "video": "clips/c.mp4"}
    dataset = load(tmp_path, processor, [row], video_folder=str(tmp_path / "store"))
    assert dataset.rows[0].videos == ["clips/c.mp4"]
    assert to_batch(dataset.rows, 0, PROMPT_LENGTH, processor)[MULTI_MODAL_INPUTS][0][
        "video_grid_thw"
    ].tolist() == [[2, 4, 4]]
