"""The ``sglang`` strategy's requests for Qwen3-VL and Qwen3-VL-MoE rows (tests/tiny_qwen3_vl.py),
against the fake ``sglang`` of tests/test_sglang_vision.py: everything up to ``Engine.generate``.

SGLang 0.5.16 keeps ``input_ids`` as given when every image and video of a request is one
``processor_output`` dict; its Qwen3-VL processing then places a video at its runs of video tokens
(one offset per temporal patch, grouped back into the video by ``video_grid_thw``'s t) and counts
each ``<|vision_start|><|video_pad|>`` as one ``[1, h, w]`` grid of its rope index. So what is
checked here is what SGLang reads:

- video rows (Video-R1 layout): each request's ids are the Batch's prompt ids, which the trainers
  score, with every temporal patch's time as roll wrote it; its ``video_data`` is one dict of the
  row's own ``pixel_values_videos`` and ``video_grid_thw`` (no ``second_per_grid_ts``: Qwen3-VL's
  times are in the prompt); the ids hold one vision start + run of ``h * w / 4`` video tokens per
  temporal patch;
- image rows: one dict with all of a row's images, a run of ``t * h * w / 4`` image tokens each;
- no dict holds rope positions: the trainers' positions of these rows are what SGLang's own rule
  computes (tests/sglang_rope_rule.py): a video's patches each a ``[1, h, w]`` grid;
- a video written as one run (Qwen2.5-VL's layout) is refused for Qwen3-VL, and the other way round;
- both model types start the engine (``StrategySpec.vision_model_types``) with ``timestamped`` set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("av")  # PyAV decodes the videos (the [vision] extra)

sys.path.insert(0, str(Path(__file__).parent))
from engine_vl_gpu import save_image_rows, vl_prompts  # noqa: E402
from sglang_rope_rule import sglang_positions, trainer_positions  # noqa: E402
from test_sglang_vision import vl_strategy  # noqa: E402
from test_vllm_sglang_strategies import fake_engines, prompt_batch  # noqa: E402, F401 - the fixture
from tiny_qwen3_vl import QWEN3_VIDEO_ARGS, SGLANG_DEEPSTACK, build_tiny_qwen3_vl_dir  # noqa: E402
from tiny_vl import video_r1_rows  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from roll.configs.role import DataArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.strategy.generation import prompt_token_lists  # noqa: E402
from roll.distributed.strategy.sglang_vision import SGLangVision, sglang_vision, token_runs  # noqa: E402
from roll.models.vision import MULTI_MODAL_INPUTS, VisionProcessor  # noqa: E402
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402

PROMPT_LENGTH = 700
IMAGE, VIDEO, START = 50, 51, 52  # the tokens of SGLangVision tests that need no model directory


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def model(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sglang_qwen3_vl")
    return build_tiny_qwen3_vl_dir(root / "model", moe=request.param, deepstack=SGLANG_DEEPSTACK)


def video_batch(model: Path, n: int = 2) -> Batch:
    processor = VisionProcessor.load(str(model))
    path = model.parent / "video_r1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in video_r1_rows(model.parent / "videos", n)))
    args = DataArgs(file_name=[str(path)], row_layout="video_r1", **QWEN3_VIDEO_ARGS)
    rows = load_prompt_files(args, processor.tokenizer, PROMPT_LENGTH, "data_args", processor)
    assert len(rows) == n and not rows.bad_rows
    return to_batch(rows.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)


def patch_runs(ids: list[int], start: int, token: int) -> list[int]:
    """The runs of ``token`` that follow a vision start (what SGLang's rope index counts)."""
    return [len(r) for r in _runs_after(ids, start, token)]


def _runs_after(ids, start, token):
    out, i = [], 0
    while i < len(ids) - 1:
        if ids[i] == start and ids[i + 1] == token:
            j = i + 1
            while j < len(ids) and ids[j] == token:
                j += 1
            out.append(ids[i + 1 : j])
            i = j
        else:
            i += 1
    return out


def test_video_requests_are_the_trainers_ids_with_their_times_and_one_dict_per_row(fake_engines, model):  # noqa: F811
    strategy, engine = vl_strategy(fake_engines, model)
    vision = strategy.vision
    assert vision.timestamped and vision.merge_size == 2
    batch = video_batch(model)
    out = strategy.generate(batch, SamplingParams(n=2, max_new_tokens=3, seed=1))
    (call,) = engine.generate_calls
    rows = prompt_token_lists(batch)  # the Batch's prompt ids: what the trainers' forward reads
    assert call["input_ids"] == [r for r in rows for _ in range(2)] and "image_data" not in call
    assert torch.equal(out["prompts"][::2], batch["prompts"])
    tokenizer = VisionProcessor.load(str(model)).tokenizer
    start = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    for i, row in enumerate(rows):
        inputs = batch[MULTI_MODAL_INPUTS][i]
        text = tokenizer.decode(row)
        assert "<0.2 seconds><|vision_start|>" in text and "<1.5 seconds><|vision_start|>" in text
        for request in (2 * i, 2 * i + 1):
            (item,) = call["video_data"][request]
            assert set(item) == {"format", "pixel_values_videos", "video_grid_thw"}  # SGLang's positions
            assert item["format"] == "processor_output"
            assert item["pixel_values_videos"] is inputs["pixel_values_videos"]
            assert item["video_grid_thw"] is inputs["video_grid_thw"]
        # SGLang's offsets (runs of video tokens) and rope index (vision start + video token): one
        # per temporal patch, t of them per video, h * w / 4 tokens each
        ((t, h, w),) = inputs["video_grid_thw"].tolist()
        assert t == 2 and token_runs(row, vision.video) == [h * w // 4] * t
        assert patch_runs(row, start, vision.video) == [h * w // 4] * t
        assert inputs["pixel_values_videos"].shape[0] == t * h * w  # what SGLang splits by the grid
        want = sglang_positions(row, vision.image, vision.video, [], [[t, h, w]], split_videos=True)
        ours = trainer_positions(AutoConfig.from_pretrained(model), row, inputs)
        assert torch.equal(ours, want)  # the trainers' positions are SGLang's here


def test_scoring_video_rows_sends_their_videos(fake_engines, model):  # noqa: F811
    strategy, engine = vl_strategy(fake_engines, model)
    batch = video_batch(model, 1)
    out = strategy.generate(batch, SamplingParams(n=1, max_new_tokens=3, seed=1))
    strategy.compute_log_probs(out)
    call = engine.generate_calls[-1]
    assert call["input_ids"][0][: len(prompt_token_lists(batch)[0])] == prompt_token_lists(batch)[0]
    (item,) = call["video_data"][0]
    assert item["video_grid_thw"] is batch[MULTI_MODAL_INPUTS][0]["video_grid_thw"]
    assert call["token_ids_logprob"][0] == list(strategy.vision.excluded)


def test_image_requests_hold_each_rows_images_at_their_runs(fake_engines, model):  # noqa: F811
    strategy, engine = vl_strategy(fake_engines, model)
    save_image_rows(model.parent)
    batch = vl_prompts(model.parent, model)
    strategy.generate(batch, SamplingParams(n=1, max_new_tokens=3, seed=1))
    (call,) = engine.generate_calls
    assert call["input_ids"] == prompt_token_lists(batch) and "video_data" not in call
    for row, data, inputs in zip(call["input_ids"], call["image_data"], batch[MULTI_MODAL_INPUTS]):
        (item,) = data
        assert set(item) == {"format", "pixel_values", "image_grid_thw"}
        assert item["pixel_values"] is inputs["pixel_values"]
        grid = inputs["image_grid_thw"]
        want = sglang_positions(row, strategy.vision.image, strategy.vision.video, grid.tolist(), [])
        assert torch.equal(trainer_positions(AutoConfig.from_pretrained(model), row, inputs), want)
        assert token_runs(row, strategy.vision.image) == (grid.prod(dim=1) // 4).tolist()


def test_expected_runs_one_per_temporal_patch():
    grid = torch.tensor([[2, 4, 6], [3, 2, 2]])
    assert SGLangVision(merge_size=2).expected_runs(grid, timestamped=True) == [6, 6, 1, 1, 1]
    assert SGLangVision(merge_size=2).expected_runs(grid, timestamped=False) == [12, 3]


V8, V4 = [VIDEO] * 8, [VIDEO] * 4


@pytest.mark.parametrize(
    "timestamped, ids, match",
    [
        (True, [START, *V8, 9], r"video token runs are \[8\] long; .* take \[4, 4\]"),
        (False, [START, 7, START, *V4, 8, START, *V4, 8, 8], r"runs are \[4, 4\] long; .* take \[8\]"),
    ],
)
def test_a_video_in_the_other_layout_is_refused(timestamped, ids, match):
    """Qwen3-VL's video as one run (Qwen2.5-VL's layout) would put both patches in one SGLang
    offset and one rope grid; Qwen2.5-VL's video split per patch would do the reverse."""
    vision = SGLangVision(IMAGE, VIDEO, merge_size=2, timestamped=timestamped)
    batch = prompt_batch([ids], width=len(ids))
    video = {"pixel_values_videos": torch.ones(32, 6), "video_grid_thw": torch.tensor([[2, 4, 4]])}
    batch.non_tensors["multi_modal_inputs"] = np.array([video], dtype=object)
    with pytest.raises(ValueError, match=match):
        vision.request_kwargs(batch, [ids], n=1)


def test_both_model_types_start_with_their_tokens(model):
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] in ("qwen3_vl", "qwen3_vl_moe")
    vision = sglang_vision(str(model))
    assert (vision.image, vision.video, vision.timestamped) == (
        config["image_token_id"],
        config["video_token_id"],
        True,
    )
    assert set(vision.excluded) >= {config["image_token_id"], config["video_token_id"]}


def test_a_moe_without_three_deepstack_layers_is_refused_for_sglang(tmp_path):
    """SGLang 0.5.16's Qwen3-VL-MoE adds deepstack after 3 decoder layers whatever the config says
    (sglang_vision.SGLANG_MOE_DEEPSTACK): a checkpoint with 2 is refused, naming the key; the dense
    model reads its count and is not."""
    from roll.configs.errors import ConfigError
    from roll.distributed.strategy.sglang_vision import check_sglang_deepstack

    moe = build_tiny_qwen3_vl_dir(tmp_path / "moe", moe=True, deepstack=(0, 1))
    with pytest.raises(ConfigError, match=r"deepstack_visual_indexes is \[0, 1\].*3 deepstack"):
        sglang_vision(str(moe))
    dense = json.loads(
        (build_tiny_qwen3_vl_dir(tmp_path / "dense", deepstack=(0, 1)) / "config.json").read_text()
    )
    check_sglang_deepstack(dense)
    assert sglang_vision(str(tmp_path / "dense")).timestamped
