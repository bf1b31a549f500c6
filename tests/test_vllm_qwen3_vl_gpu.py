"""The ``vllm`` strategy with images on a tiny Qwen3-VL (tests/tiny_qwen3_vl.py: 16-pixel patches,
deepstack, interleaved mrope) on a real vLLM engine on CUDA (skipped without vLLM, torchvision or a
GPU): roll's data path builds the prompts (Orsta-layout rows -> the image processor -> the Batch's
``multi_modal_data``), vLLM takes one image token per image plus the PIL images
(``engine_vision.vllm_prompts``), and the engine's sampled-token log-probs equal transformers'
forward with the pixel values (bf16 tolerance, tests/engine_gpu.py).

The Qwen3-VL-MoE case loads the released layout (each layer's experts stacked and transposed), which
vLLM's loader transposes; roll's save writes that layout and its model update each expert's name.

Video rows (Video-R1's layout, each temporal patch's time in roll's prompt, roll.models.video_prompt):
vLLM gets each video as one placeholder and the frames with their metadata; the prompt ids vLLM
builds from them equal roll's row ids, and its sampled-token log-probs equal transformers'.

    pytest tests/test_vllm_qwen3_vl_gpu.py -m gpu     # vLLM, torchvision on PYTHONPATH, 1 GPU
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("torchvision")  # Qwen3VLProcessor's video processor, which vLLM loads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

sys.path.insert(0, str(Path(__file__).parent))
from engine_gpu import assert_close, make_strategy  # noqa: E402
from engine_vl_gpu import hf_sampled_logprobs, hf_vl, save_image_rows, vl_prompts  # noqa: E402
from tiny_qwen3_vl import QWEN3_VIDEO_ARGS, build_tiny_qwen3_vl_dir, released_layout  # noqa: E402
from tiny_vl import video_r1_rows  # noqa: E402

from roll.configs.role import DataArgs  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.strategy.engine_vision import vllm_prompts  # noqa: E402
from roll.distributed.strategy.generation import prompt_token_lists  # noqa: E402
from roll.models.vision import VisionProcessor  # noqa: E402
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402


def _engine(model: Path, limits: dict[str, int]):
    """One of this module's four engines, all alive in this process at once: a small share of the
    GPU each, and no sleep mode (vLLM's sleep-mode allocator serves one engine per process)."""
    return make_strategy(
        "vllm",
        model,
        gpu_memory_utilization=0.12,
        enforce_eager=True,
        sleep_level=0,
        engine_kwargs={"limit_mm_per_prompt": limits},
    )


# MoE first: the engines share this process's vLLM parallel state, which the first engine builds,
# and only a MoE model's build makes the expert-parallel group a MoE engine needs.
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_qwen3_vl_generate_with_images_matches_transformers(tmp_path: Path, moe: bool) -> None:
    """``moe``: Qwen3-VL-MoE, its checkpoint in the released layout (stacked, transposed experts)."""
    model = build_tiny_qwen3_vl_dir(tmp_path / "model", full_processor=True, std=0.1, moe=moe)
    if moe:
        released_layout(model)
    save_image_rows(tmp_path)
    engine = _engine(model, {"image": 1, "video": 0})
    prompts = vl_prompts(tmp_path, model)
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=3))
    assert torch.equal(out["prompts"][::2], prompts["prompts"]) and out["response_mask"].sum() > 0
    want = hf_sampled_logprobs(hf_vl(model), out)
    assert_close(out["infer_logprobs"], want, out["response_mask"], "Qwen3-VL generate with images")


# MoE first: the engines share this process's vLLM parallel state, which the first engine builds,
# and only a MoE model's build makes the expert-parallel group a MoE engine needs.
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_qwen3_vl_generate_with_videos_matches_transformers(tmp_path: Path, moe: bool) -> None:
    pytest.importorskip("av")  # the frames are decoded with PyAV
    model = build_tiny_qwen3_vl_dir(tmp_path / "model", full_processor=True, std=0.1, moe=moe)
    if moe:
        released_layout(model)
    processor = VisionProcessor.load(str(model))
    (tmp_path / "videos.json").write_text(json.dumps(video_r1_rows(tmp_path / "videos", 2)))
    args = DataArgs(file_name=[str(tmp_path / "videos.json")], row_layout="video_r1", **QWEN3_VIDEO_ARGS)
    rows = load_prompt_files(args, processor.tokenizer, 700, "data_args", processor)
    prompts = to_batch(rows.rows, processor.tokenizer.pad_token_id, 700, processor)
    engine = _engine(model, {"image": 0, "video": 1})
    # the prompt vLLM builds (its Qwen3-VL processing writes the timestamps) is roll's row
    ids = prompt_token_lists(prompts)
    requests = vllm_prompts(prompts, ids, *[getattr(engine.vision, k) for k in ("image", "video", "frames")])
    sampling = engine._vllm.SamplingParams(max_tokens=1)
    for row, output in zip(ids, engine.llm.generate(requests, sampling)):
        assert list(output.prompt_token_ids) == list(row)
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=3))
    assert torch.equal(out["prompts"][::2], prompts["prompts"]) and out["response_mask"].sum() > 0
    want = hf_sampled_logprobs(hf_vl(model), out)
    assert_close(out["infer_logprobs"], want, out["response_mask"], "Qwen3-VL generate with videos")
