"""The ``vllm`` strategy with images: a tiny Qwen2.5-VL on a real vLLM engine on CUDA (skipped
without vLLM, torchvision or a GPU).

- generate: prompts with images (roll's data path: ROLL-layout rows -> the image processor -> the
  Batch's ``multi_modal_data``) go to vLLM as one image token per image plus the PIL images
  (``engine_vision.vllm_prompts``); the Batch layout holds and the engine's sampled-token log-probs
  equal transformers' forward with the pixel values on the same weights (bf16 tolerance,
  tests/engine_gpu.py), which they would not if an image were dropped or misplaced;
- generate with videos: ROLL's Video-R1 rows with tiny generated videos go to vLLM as one video
  token per video plus the sampled frames, their metadata (sampling fps) and pixel area
  (``mm_processor_kwargs``), and the log-probs equal transformers' forward with
  ``pixel_values_videos`` (which would not hold if vLLM resampled or resized the frames, or placed
  them at other rope positions);
- load_weights with transformers 5's module names (``model.language_model.*``, ``model.visual.*``,
  what fsdp2_train and hf_infer send in a model update): the engine then samples like the new
  weights, and not before.

    pytest tests/test_vllm_vl_gpu.py -m gpu     # vLLM 0.24, torchvision, PyAV on PYTHONPATH, 1 GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("torchvision")  # Qwen2_5_VLProcessor's video processor, which vLLM loads
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

sys.path.insert(0, str(Path(__file__).parent))
from engine_gpu import make_strategy  # noqa: E402
from engine_vl_gpu import (  # noqa: E402
    check_generate,
    check_load_weights,
    save_vl_models,
    video_prompts,
    vl_prompts,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_vl_models(tmp_path_factory.mktemp("vllm_vl_gpu"))


@pytest.fixture(scope="module")
def engine(models):
    strategy = make_strategy(
        "vllm",
        models[1],
        gpu_memory_utilization=0.25,
        enforce_eager=True,
        engine_kwargs={"limit_mm_per_prompt": {"image": 1, "video": 1}},  # one per row: a small profile
    )
    yield strategy
    del strategy.llm
    torch.cuda.empty_cache()


def test_generate_with_images_matches_transformers(engine, models):
    root, a, _ = models
    check_generate(engine, vl_prompts(root, a), a, "generate with images")


def test_generate_with_videos_matches_transformers(engine, models):
    root, a, _ = models
    check_generate(engine, video_prompts(root, a), a, "generate with videos")


def test_load_weights_with_module_names_makes_the_engine_sample_like_the_new_model(engine, models):
    root, a, b = models
    check_load_weights(engine, vl_prompts(root, a), b)
