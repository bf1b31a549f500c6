"""The ``sglang`` strategy with images: a tiny Qwen2.5-VL on a real SGLang engine on CUDA (skipped
without SGLang, torchvision or a GPU). Engine as tests/test_sglang_gpu.py starts it (triton
attention, pytorch sampler, no CUDA graphs; the vision tower on ``triton_attn``, roll's default).

- generate: roll's rows (ROLL-layout rows -> the image processor -> the Batch's expanded prompt ids
  and ``multi_modal_inputs``) go to SGLang as those ids plus one ``processor_output`` dict per row
  (``sglang_vision``); the engine's sampled-token log-probs equal transformers' forward with the
  pixel values on the same weights (bf16 tolerance, tests/engine_gpu.py), which they would not if
  an image were dropped, resized or placed at other rope positions;
- generate with videos: ROLL's Video-R1 rows, ``pixel_values_videos`` with their grid and
  ``second_per_grid_ts``, against transformers the same way;
- compute_log_probs on image rows: SGLang's input log-probs renormalized without the vision tokens
  equal transformers' (and the sampling log-probs);
- load_weights with transformers 5's module names (``model.language_model.*``, ``model.visual.*``)
  makes the engine sample like the new weights.

    pytest tests/test_sglang_vl_gpu.py -m gpu     # SGLang 0.5.16, torchvision, PyAV, 1 GPU
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")
pytest.importorskip(
    "torchvision"
)  # SGLang's Qwen-VL processor imports it; so does AutoProcessor's video part
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

sys.path.insert(0, str(Path(__file__).parent))
from engine_gpu import assert_close, make_strategy  # noqa: E402
from tiny_vl import VIDEO_ARGS, build_tiny_vl_dir, detection_rows, math_rows, video_r1_rows  # noqa: E402

from roll.configs.role import DataArgs  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.models.logprobs import response_log_probs  # noqa: E402
from roll.models.vision import VisionProcessor  # noqa: E402
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402

PROMPT_LENGTH = 64
VIDEO_PROMPT_LENGTH = 600  # the tiny tokenizer spends ~530 tokens on Video-R1's template


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_vl_gpu")
    a = build_tiny_vl_dir(root / "a", seed=0, full_processor=True, std=0.1)
    b = build_tiny_vl_dir(root / "b", seed=1, full_processor=True, std=0.1)
    rows = detection_rows(root / "images", 4) + math_rows(root / "images", 2)
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, a, b


@pytest.fixture(scope="module")
def engine(models):
    strategy = make_strategy("sglang", models[1], mem_fraction_static=0.3, disable_cuda_graph=True)
    yield strategy
    strategy.shutdown()
    torch.cuda.empty_cache()


def vl_prompts(root: Path, model_dir: Path):
    processor = VisionProcessor.load(str(model_dir))
    args = DataArgs(file_name=[str(root / "prompts.jsonl")], messages="prompt")
    rows = load_prompt_files(args, processor.tokenizer, PROMPT_LENGTH, "data_args", processor)
    assert len(rows) == 6 and not rows.bad_rows
    return to_batch(rows.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)


def video_prompts(root: Path, model_dir: Path):
    pytest.importorskip("av")  # the frames are decoded with PyAV
    processor = VisionProcessor.load(str(model_dir))
    (root / "videos.json").write_text(json.dumps(video_r1_rows(root / "videos", 2)))
    args = DataArgs(file_name=[str(root / "videos.json")], row_layout="video_r1", **VIDEO_ARGS)
    rows = load_prompt_files(args, processor.tokenizer, VIDEO_PROMPT_LENGTH, "data_args", processor)
    assert len(rows) == 2 and not rows.bad_rows
    return to_batch(rows.rows, processor.tokenizer.pad_token_id, VIDEO_PROMPT_LENGTH, processor)


def hf_vl(path: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


@torch.no_grad()
def hf_sampled_logprobs(model, out) -> torch.Tensor:
    return response_log_probs(model, out.to("cuda"), temperature=1.0)["log_probs"].cpu()


def test_generate_with_images_matches_transformers(engine, models):
    root, a, _ = models
    prompts = vl_prompts(root, a)
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=3))
    assert out["responses"].shape[0] == 2 * len(prompts)
    assert torch.equal(out["prompts"][::2], prompts["prompts"])  # roll's expanded ids stay in the batch
    assert out["response_mask"].sum() > 0
    want = hf_sampled_logprobs(hf_vl(a), out)
    assert_close(out["infer_logprobs"], want, out["response_mask"], "generate with images")


def test_compute_log_probs_of_image_rows_matches_transformers(engine, models):
    root, a, _ = models
    out = engine.generate(vl_prompts(root, a), SamplingParams(n=2, max_new_tokens=16, seed=11))
    scored = engine.compute_log_probs(out)["log_probs"]
    assert_close(scored, hf_sampled_logprobs(hf_vl(a), out), out["response_mask"], "scoring image rows")
    assert_close(scored, out["infer_logprobs"], out["response_mask"], "scoring vs sampling log-probs")


def test_generate_with_videos_matches_transformers(engine, models):
    root, a, _ = models
    prompts = video_prompts(root, a)
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=3))
    assert out["responses"].shape[0] == 2 * len(prompts)
    assert torch.equal(out["prompts"][::2], prompts["prompts"])
    assert out["response_mask"].sum() > 0
    want = hf_sampled_logprobs(hf_vl(a), out)
    assert_close(out["infer_logprobs"], want, out["response_mask"], "generate with videos")


def test_load_weights_with_module_names_makes_the_engine_sample_like_the_new_model(engine, models):
    root, a, b = models
    prompts = vl_prompts(root, a)
    new = hf_vl(b)
    params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=5)
    before = engine.generate(prompts, params)
    with pytest.raises(AssertionError):  # the old weights do not pass the tolerance
        assert_close(
            before["infer_logprobs"], hf_sampled_logprobs(new, before), before["response_mask"], "old"
        )
    names = [name for name, _ in new.state_dict().items()]
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.") for n in names)
    engine.load_weights((name, t) for name, t in new.state_dict().items())
    after = engine.generate(prompts, params)
    assert_close(
        after["infer_logprobs"], hf_sampled_logprobs(new, after), after["response_mask"], "new weights"
    )
