"""The ``sglang`` strategy with images: a tiny Qwen2.5-VL on a real SGLang engine on CUDA (skipped
without SGLang, torchvision or a GPU). Engine as tests/test_sglang_gpu.py starts it (triton
attention, pytorch sampler, no CUDA graphs; the vision tower on ``triton_attn``, roll's default).

- generate: roll's rows (ROLL-layout rows -> the image processor -> the Batch's expanded prompt ids
  and ``multi_modal_inputs``) go to SGLang as those ids plus one ``processor_output`` dict per row
  (``sglang_vision``); the engine's sampled-token log-probs equal transformers' forward with the
  pixel values on the same weights (bf16 tolerance, tests/engine_gpu.py), which they would not if
  an image were dropped, resized or placed at other rope positions;
- generate with videos: ROLL's Video-R1 rows, ``pixel_values_videos`` with their grid and
  ``second_per_grid_ts``, against transformers' forward: SGLang lays the rope positions by Qwen's
  rule, as the trainers do, and its tower attends within each temporal patch because roll's
  schedulers split each video's grid per patch (``sglang_frames``; SGLang 0.5.16 alone attends
  across them, tests/sglang_vision_tower.py, and its video rows sat 0.020-0.023 off on an H200);
- compute_log_probs on image rows: SGLang's input log-probs renormalized without the vision tokens
  equal transformers' (and the sampling log-probs);
- load_weights with transformers 5's module names (``model.language_model.*``, ``model.visual.*``)
  makes the engine sample like the new weights (sglang_weight_names renames them; the engine runs
  without SGLang's vision-embedding cache).

Each row's mean and max |diff| is printed, with its media, before each check asserts.

    pytest -s -x tests/test_sglang_vl_gpu.py -m gpu     # SGLang 0.5.16, torchvision, PyAV, 1 GPU

SGLang's logs (a scheduler's traceback included) also go to /tmp/roll_sglang_logs/qwen2_5_vl.log
(engine_vl_gpu.sglang_logs_to): a scheduler that dies makes the engine SIGKILL pytest.
"""

from __future__ import annotations

import contextlib
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
from engine_vl_gpu import (  # noqa: E402
    check_generate,
    check_load_weights,
    hf_sampled_logprobs,
    hf_vl,
    print_row_diffs,
    save_vl_models,
    sglang_logs_to,
    video_prompts,
    vl_prompts,
)
from sglang_vision_tower import tower_attends_across_frames  # noqa: E402

from roll.core.batch import Batch  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.strategy.sglang_frames import run_scheduler_within_frames  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_vl_models(tmp_path_factory.mktemp("sglang_vl_gpu"))


@pytest.fixture(scope="module")
def engine(models):
    with pytest.MonkeyPatch.context() as env:
        sglang_logs_to("qwen2_5_vl", env)
        strategy = make_strategy("sglang", models[1], mem_fraction_static=0.3, disable_cuda_graph=True)
        yield strategy
        strategy.shutdown()
    torch.cuda.empty_cache()


def test_generate_with_images_matches_transformers(engine, models):
    root, a, _ = models
    check_generate(engine, vl_prompts(root, a), a, "generate with images")


def test_compute_log_probs_of_image_rows_matches_transformers(engine, models):
    root, a, _ = models
    out = engine.generate(vl_prompts(root, a), SamplingParams(n=2, max_new_tokens=16, seed=11))
    scored = engine.compute_log_probs(out)["log_probs"]
    want = hf_sampled_logprobs(hf_vl(a), out)
    print_row_diffs(scored, want, out, "scoring image rows")
    assert_close(scored, want, out["response_mask"], "scoring image rows")
    assert_close(scored, out["infer_logprobs"], out["response_mask"], "scoring vs sampling log-probs")


def test_generate_with_videos_matches_transformers(engine, models):
    """Positions, frames, pixels and the tower's per-temporal-patch attention, at the usual
    tolerance; the distances to other rules and to SGLang's own tower layout are printed first."""
    assert type(engine.engine).run_scheduler_process_func is run_scheduler_within_frames
    root, a, _ = models
    prompts = video_prompts(root, a)
    print_rule_diffs(engine, prompts, a)
    check_generate(engine, prompts, a, "generate with videos")


def print_rule_diffs(engine, prompts, model_dir) -> None:
    """Which reference the engine's video log-probs are nearest to (printed only): transformers'
    forward by Qwen's rule (what the trainers use), by transformers' own rule, by Qwen's rule with
    every temporal position 0, and by Qwen's rule with the tower laid out as SGLang 0.5.16's own."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    from roll.models.qwen_rope_rule import qwen_rope_index, transformers_rope_index
    from roll.models.vision import MULTI_MODAL_INPUTS

    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=3))
    model, mask = hf_vl(model_dir), out["response_mask"].bool()
    flat_inputs = [
        {**m, "second_per_grid_ts": m["second_per_grid_ts"] * 0} if m and "second_per_grid_ts" in m else m
        for m in out[MULTI_MODAL_INPUTS]
    ]
    flat = Batch(dict(out.tensors), {**out.non_tensors, MULTI_MODAL_INPUTS: flat_inputs}, dict(out.meta))
    cls = modeling_qwen2_5_vl.Qwen2_5_VLModel
    for label, rule, batch, tower in (
        ("Qwen's rule", qwen_rope_index, out, contextlib.nullcontext),
        ("transformers' rule", transformers_rope_index(), out, contextlib.nullcontext),
        ("temporal positions 0", qwen_rope_index, flat, contextlib.nullcontext),
        ("Qwen's rule, the tower across frames", qwen_rope_index, out, tower_attends_across_frames),
    ):
        cls.get_rope_index = rule
        try:
            with tower():
                want = hf_sampled_logprobs(model, batch)
            diff = (out["infer_logprobs"].float() - want.float()).abs()[mask]
        finally:
            cls.get_rope_index = qwen_rope_index
        print(f"videos vs transformers by {label}: mean |diff| {diff.mean():.4f}, max {diff.max():.4f}")


def test_load_weights_with_module_names_makes_the_engine_sample_like_the_new_model(engine, models):
    root, a, b = models
    check_load_weights(engine, vl_prompts(root, a), b)
