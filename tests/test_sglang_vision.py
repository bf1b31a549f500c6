"""The ``sglang`` strategy with a vision-language model (roll.distributed.strategy.sglang_vision),
against the fake ``sglang`` module of tests/test_vllm_sglang_strategies.py with an engine that
records the multimodal arguments of ``Engine.generate``:

- generate: each request carries its row's roll-expanded prompt ids and, for an image row, ONE
  ``processor_output`` dict with the row's pixel values and grid (several images in one dict); a text
  row an empty list; video rows a ``video_data`` dict; rows repeated ``n`` times in request order;
  every request biases the vision tokens out (string keys, as SGLang declares ``logit_bias``);
- ids that do not hold one run of expanded tokens per image are refused by row;
- scoring: image rows go with their images, and the input log-probs are renormalized without the
  vision tokens (what roll's forward computes, checked against log_softmax of masked logits);
- rope positions: SGLang's (Qwen's rule, tests/sglang_rope_rule.py) are the trainers'
  (``roll.models.qwen_rope_rule``) for a Qwen2.5-VL video row, where transformers 5.3+'s own rule
  puts the text after the video 3 positions earlier; for images the rules agree; requests send no
  positions;
- a vision-language model type roll has not run on SGLang is refused when the engine starts.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from sglang_rope_rule import sglang_positions, trainer_positions  # noqa: E402
from test_vllm_sglang_strategies import (  # noqa: E402
    FakeServerArgs,
    FakeSGLangEngine,
    canned_logprob,
    ctx,
    fake_engines,  # noqa: F401 - the fixture
    make_role,
    prompt_batch,
    sglang_strategy,
    tokenizer_dir,  # noqa: F401 - the fixture
)
from tiny_vl import build_tiny_vl_tokenizer, tiny_vl_config  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.strategy_configs import SGLangConfig  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.strategy.engine_requests import ScoringRequest  # noqa: E402
from roll.distributed.strategy.registry import load_strategy_class  # noqa: E402
from roll.distributed.strategy.sglang_vision import (  # noqa: E402
    SGLangVision,
    masked_input_logprobs,
    masked_logprob,
    sglang_vision,
    token_runs,
)
from roll.models.qwen_rope_rule import transformers_rope_index  # noqa: E402
from roll.models.vision import EXCLUDED_LOGIT, response_excluded_tokens  # noqa: E402

IMAGE, VIDEO, START = 50, 51, 52  # the tokens of SGLangVision tests that need no model directory
EXCLUDED_LP = -4.0  # the fake engine's log-prob of each excluded token at every input position


class FakeVLEngine(FakeSGLangEngine):
    """Records ``image_data``/``video_data``/``token_ids_logprob`` and answers the excluded tokens'
    input log-probs (``meta_info.input_token_ids_logprobs``, first entry None as SGLang's)."""

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, rid=None, **kwargs):
        media = {k: kwargs.pop(k) for k in ("image_data", "video_data", "token_ids_logprob") if k in kwargs}
        outs = super().generate(input_ids, sampling_params, return_logprob, rid, **kwargs)
        self.generate_calls[-1].update(media)
        for i, out in enumerate(outs):
            wanted = (media.get("token_ids_logprob") or [None] * len(outs))[i]
            if wanted:
                n = len(out["meta_info"]["input_token_logprobs"])
                out["meta_info"]["input_token_ids_logprobs"] = [None] + [
                    [(EXCLUDED_LP, t, None) for t in wanted] for _ in range(n - 1)
                ]
        return outs


@pytest.fixture
def vl_dir(tmp_path) -> Path:
    tok = build_tiny_vl_tokenizer()
    tok.save_pretrained(tmp_path)
    tiny_vl_config(tok).save_pretrained(tmp_path)
    return tmp_path


@dataclasses.dataclass
class FakeVLServerArgs(FakeServerArgs):
    mm_attention_backend: str | None = None


def vl_strategy(fake_engines, path: Path):  # noqa: F811 - the fixture's value
    fake_engines.sglang.Engine = FakeVLEngine
    sys.modules["sglang.srt.server_args"].ServerArgs = FakeVLServerArgs
    strategy = load_strategy_class("sglang")(make_role("sglang", SGLangConfig(), str(path)), ctx())
    strategy.initialize()
    return strategy, FakeVLEngine.instances[-1]


def grid(*shapes: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor(shapes, dtype=torch.long)


def images(*shapes: tuple[int, int, int]) -> dict:
    """A row's multi_modal_inputs: pixel values [patches, 6] numbered so each image's rows differ."""
    g = grid(*shapes)
    patches = int(g.prod(dim=1).sum())
    return {
        "pixel_values": torch.arange(patches * 6, dtype=torch.float32).view(patches, 6),
        "image_grid_thw": g,
    }


# ------------------------------------------------------------------------------ request building


def test_token_runs():
    assert token_runs([1, IMAGE, IMAGE, 2, IMAGE, 3, IMAGE, IMAGE, IMAGE], IMAGE) == [2, 1, 3]
    assert token_runs([1, 2], IMAGE) == []


def test_request_kwargs_image_rows_text_rows_several_images_and_n_samples():
    vision = SGLangVision(IMAGE, VIDEO, merge_size=2, excluded=(IMAGE, VIDEO, START))
    rows = [
        [7, START, IMAGE, IMAGE, 8, START, IMAGE, 9],  # two images: 2 and 1 tokens
        [7, 8, 9],  # text
        [START, IMAGE, IMAGE, IMAGE, IMAGE, 9],  # one image of 4 tokens
    ]
    batch = prompt_batch(rows, width=8)
    two, four = images((1, 2, 4), (1, 2, 2)), images((1, 4, 4))
    batch.non_tensors["multi_modal_inputs"] = np.array([two, None, four], dtype=object)
    kwargs = vision.request_kwargs(batch, rows, n=2)
    assert set(kwargs) == {"image_data"}
    data = kwargs["image_data"]
    assert len(data) == 6 and data[2] == data[3] == []  # the text row's requests
    assert data[0] is not data[1] and data[0][0] is data[1][0]  # one list per request, one dict per row
    for request, row in ((0, two), (4, four)):
        (item,) = data[request]
        assert item["format"] == "processor_output" and set(item) == {
            "format",
            "pixel_values",
            "image_grid_thw",
        }
        assert item["pixel_values"] is row["pixel_values"] and item["image_grid_thw"] is row["image_grid_thw"]
    assert vision.request_kwargs(prompt_batch([[7, 8]]), [[7, 8]], n=2) == {}


def test_request_kwargs_video_rows():
    vision = SGLangVision(IMAGE, VIDEO, merge_size=2)
    rows = [[START, VIDEO, VIDEO, VIDEO, VIDEO, 9], [START, IMAGE, 9]]
    batch = prompt_batch(rows, width=6)
    video = {
        "pixel_values_videos": torch.ones(16, 6),
        "video_grid_thw": grid((2, 2, 4)),
        "second_per_grid_ts": torch.tensor([1.0]),
    }
    batch.non_tensors["multi_modal_inputs"] = np.array([video, images((1, 2, 2))], dtype=object)
    kwargs = vision.request_kwargs(batch, rows, n=1)
    assert kwargs["image_data"][0] == [] and len(kwargs["image_data"][1]) == 1
    assert kwargs["video_data"][1] is None
    (item,) = kwargs["video_data"][0]
    assert item["format"] == "processor_output"
    assert set(item) == {"format", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"}


@pytest.mark.parametrize(
    "ids, match",
    [
        (
            [START, IMAGE, 9],
            r"row 0: the prompt's image token runs are \[1\] long; its 1 images .* take \[2\]",
        ),
        ([START, IMAGE, IMAGE, 9, IMAGE, IMAGE], r"runs are \[2, 2\] long; its 1 images"),
        ([7, 8, 9], r"runs are \[\] long"),
    ],
)
def test_ids_without_one_expanded_run_per_image_are_refused(ids, match):
    """SGLang keeps the ids as given and places each image at a run of image tokens: ids collapsed
    (one token per image, as vLLM takes them) or with an extra run would misplace the images."""
    vision = SGLangVision(IMAGE, VIDEO, merge_size=2)
    batch = prompt_batch([ids], width=6)
    batch.non_tensors["multi_modal_inputs"] = np.array([images((1, 2, 4))], dtype=object)
    with pytest.raises(ValueError, match=match):
        vision.request_kwargs(batch, [ids], n=1)


# ------------------------------------------------------------------------------ rope positions


class _TransformersRule:
    """transformers' own Qwen2.5-VL ``get_rope_index`` (5.3+), for ``rope_index_positions``."""

    get_rope_index = transformers_rope_index()
    get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids


def test_a_qwen2_5_vl_video_row_is_scored_at_the_positions_sglang_samples_at(vl_dir):
    """The tiny model's video (2 temporal patches of 2 x 2 merged patches, 1 s each,
    ``tokens_per_second`` 4: temporal positions 4 apart). SGLang computes the positions by Qwen's
    rule: the text after the video starts one past its largest position, the temporal 8. So do the
    trainers (``roll.models.qwen_rope_rule``); transformers 5.3+'s own rule would start it 3 earlier.
    The request sends no positions."""
    from roll.models.rope_index import rope_index_positions

    config = tiny_vl_config(build_tiny_vl_tokenizer())
    vision = sglang_vision(str(vl_dir))
    start, end, video = config.vision_start_token_id, config.vision_end_token_id, config.video_token_id
    ids = [5, 5, 5, start, *[video] * 8, end, 6, 6, 6, 6]
    inputs = {
        "pixel_values_videos": torch.ones(32, 6),
        "video_grid_thw": grid((2, 4, 4)),
        "second_per_grid_ts": torch.tensor([1.0]),
    }
    image, item = vision.row_data(ids, inputs, 0)
    assert image is None and set(item) == {"format", *inputs}
    hf_config = AutoConfig.from_pretrained(vl_dir)
    assert hf_config.vision_config.tokens_per_second == 4
    text, after = list(range(4)), [9, 10, 11, 12, 13]  # vision end and the text after
    ours = trainer_positions(hf_config, ids, inputs)
    assert ours.tolist() == [
        text + [4, 4, 4, 4, 8, 8, 8, 8] + after,
        text + [4, 4, 5, 5, 4, 4, 5, 5] + after,
        text + [4, 5, 4, 5, 4, 5, 4, 5] + after,
    ]
    theirs = sglang_positions(ids, config.image_token_id, video, [], [[2, 4, 4]], video_intervals=[4.0])
    assert torch.equal(theirs, ours)
    transformers_rule = rope_index_positions(
        _TransformersRule,
        torch.tensor([ids]),
        hf_config,
        image_grid_thw=None,
        video_grid_thw=inputs["video_grid_thw"],
        second_per_grid_ts=inputs["second_per_grid_ts"],
    )[:, 0]
    assert torch.equal(transformers_rule[:, 12:] + 3, ours[:, 12:])


def test_image_rows_get_the_same_positions_from_both_rules(vl_dir):
    config = tiny_vl_config(build_tiny_vl_tokenizer())
    vision = sglang_vision(str(vl_dir))
    image, start, end = config.image_token_id, config.vision_start_token_id, config.vision_end_token_id
    ids = [5, start, *[image] * 2, end, 6, start, *[image] * 4, end, 7, 8]
    inputs = images((1, 2, 4), (1, 4, 4))
    item, video = vision.row_data(ids, inputs, 0)
    assert video is None and set(item) == {"format", *inputs}
    want = sglang_positions(ids, image, config.video_token_id, [[1, 2, 4], [1, 4, 4]], [])
    assert torch.equal(trainer_positions(AutoConfig.from_pretrained(vl_dir), ids, inputs), want)


# ----------------------------------------------------------------------------- the strategy


def test_generate_sends_expanded_ids_and_each_rows_images(fake_engines, vl_dir):  # noqa: F811
    strategy, engine = vl_strategy(fake_engines, vl_dir)
    config = tiny_vl_config(build_tiny_vl_tokenizer())
    image, start = config.image_token_id, config.vision_start_token_id
    rows = [[5, start, image, image, 6], [7, 8], [start, image, 9]]
    batch = prompt_batch(rows, width=5)
    row0, row2 = images((1, 2, 4)), images((1, 2, 2))
    batch.non_tensors["multi_modal_inputs"] = np.array([row0, None, row2], dtype=object)
    out = strategy.generate(batch, SamplingParams(n=2, max_new_tokens=3, seed=1))
    (call,) = engine.generate_calls
    assert call["input_ids"] == [r for r in rows for _ in range(2)]  # roll's expanded ids, as they are
    assert [len(d) for d in call["image_data"]] == [1, 1, 0, 0, 1, 1] and "video_data" not in call
    assert call["image_data"][0][0]["pixel_values"] is row0["pixel_values"]
    assert call["image_data"][5][0]["image_grid_thw"] is row2["image_grid_thw"]
    assert set(call["image_data"][0][0]) == {"format", *row0}  # SGLang computes the positions
    bias = {str(t): -1.0e4 for t in response_excluded_tokens(config)}
    assert len(bias) == 3 and all(sp["logit_bias"] == bias for sp in call["sampling_params"])
    assert torch.equal(out["prompts"][::2], batch["prompts"])
    assert out["responses"].shape[0] == 6
    # SGLang would pick FlashAttention-3 for the vision tower on Hopper: roll follows attention_backend
    assert engine.kwargs["mm_attention_backend"] == "triton_attn"


def test_text_model_requests_are_unchanged(fake_engines, tokenizer_dir):  # noqa: F811
    strategy, engine = sglang_strategy(tokenizer_dir)
    strategy.generate(prompt_batch([[5, 6], [7]]), SamplingParams(n=1, max_new_tokens=2))
    call = engine.generate_calls[-1]
    assert "image_data" not in call and all("logit_bias" not in sp for sp in call["sampling_params"])
    assert "mm_attention_backend" not in engine.kwargs


@pytest.mark.parametrize(
    "cfg, want",
    [
        ({}, "triton_attn"),
        ({"attention_backend": "fa3"}, "fa3"),
        ({"attention_backend": "flashinfer"}, None),
        ({"engine_kwargs": {"mm_attention_backend": "sdpa"}}, "sdpa"),
    ],
)
def test_vision_tower_attention_follows_attention_backend(vl_dir, cfg, want):
    from roll.distributed.strategy.engine_options import sglang_engine_options

    config = SGLangConfig(**cfg)
    options = sglang_engine_options(config, make_role("sglang", config, str(vl_dir)), "actor_infer", 1)
    assert options.kwargs.get("mm_attention_backend") == want


def test_scoring_sends_images_and_renormalizes_without_the_vision_tokens(fake_engines, vl_dir):  # noqa: F811
    strategy, engine = vl_strategy(fake_engines, vl_dir)
    config = tiny_vl_config(build_tiny_vl_tokenizer())
    image, start = config.image_token_id, config.vision_start_token_id
    batch = prompt_batch([[5, start, image, image, 6], [7, 8]], width=5)
    batch.non_tensors["multi_modal_inputs"] = np.array([images((1, 2, 4)), None], dtype=object)
    out = strategy.generate(batch, SamplingParams(n=1, max_new_tokens=3, seed=1))
    scored = strategy.compute_log_probs(out)["log_probs"]
    call = engine.generate_calls[-1]
    excluded = response_excluded_tokens(config)
    assert call["token_ids_logprob"] == [excluded, excluded]
    assert len(call["image_data"][0]) == 1 and call["image_data"][1] == []
    assert call["input_ids"][0][:5] == [5, start, image, image, 6]
    shift = math.log1p(-len(excluded) * math.exp(EXCLUDED_LP))
    for row in range(2):
        length = int(out["response_mask"][row].sum())
        want = [canned_logprob(t) - shift for t in out["responses"][row, :length].tolist()]
        assert scored[row, :length].tolist() == pytest.approx(want, abs=1e-6)


def test_masked_logprob_is_log_softmax_of_logits_without_the_excluded_tokens():
    torch.manual_seed(0)
    logits = torch.randn(5, 12, dtype=torch.float64) * 3
    excluded = [2, 7, 9]
    want = torch.log_softmax(logits.index_fill(-1, torch.tensor(excluded), EXCLUDED_LOGIT), dim=-1)
    raw = torch.log_softmax(logits, dim=-1)
    for row in range(5):
        for token in (0, 4, 11):
            got = masked_logprob(raw[row, token].item(), raw[row, excluded].tolist())
            assert got == pytest.approx(want[row, token].item(), abs=1e-9)


def test_masked_input_logprobs_reads_the_positions_from_the_end():
    req = ScoringRequest([1, 2, 3, 4, 5], start=3, count=2)
    entries = [None, [(-1.0, 9, None)], [(-2.0, 9, None)], [(-3.0, 9, None)]]  # from logprob_start_len 1
    got = masked_input_logprobs({"meta_info": {"input_token_ids_logprobs": entries}}, req, [-0.5, -0.6], [9])
    assert got == pytest.approx([-0.5 - math.log1p(-math.exp(-2.0)), -0.6 - math.log1p(-math.exp(-3.0))])
    with pytest.raises(RuntimeError, match="not of"):
        masked_input_logprobs({"meta_info": {"input_token_ids_logprobs": entries}}, req, [0.0, 0.0], [8])
    with pytest.raises(RuntimeError, match="token_ids_logprob"):
        masked_input_logprobs({"meta_info": {}}, req, [0.0, 0.0], [9])


# ------------------------------------------------------------------------------ model types


def test_a_model_type_not_run_on_sglang_is_refused_when_the_engine_starts(tmp_path):
    tok = build_tiny_vl_tokenizer()
    config = tiny_vl_config(tok).to_dict()
    (tmp_path / "config.json").write_text(__import__("json").dumps({**config, "model_type": "qwen3_5"}))
    with pytest.raises(
        ConfigError,
        match="sglang runs vision-language model_type qwen2_5_vl, qwen3_vl, qwen3_vl_moe in roll, not 'qwen3_5'",
    ):
        sglang_vision(str(tmp_path))
    assert sglang_vision(None) == SGLangVision()


def test_tiny_qwen2_5_vl_tokens(vl_dir):
    config = tiny_vl_config(build_tiny_vl_tokenizer())
    vision = sglang_vision(str(vl_dir))
    assert (vision.image, vision.video, vision.merge_size) == (
        config.image_token_id,
        config.video_token_id,
        2,
    )
    assert vision.excluded == tuple(response_excluded_tokens(config))
