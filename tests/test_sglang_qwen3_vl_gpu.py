"""The ``sglang`` strategy with Qwen3-VL and Qwen3-VL-MoE rows on a real SGLang engine on CUDA
(skipped without SGLang, torchvision or a GPU): tests/tiny_qwen3_vl.py's tiny random models (16-pixel
patches, deepstack, interleaved mrope; the MoE checkpoint in Qwen's released layout, stacked and
transposed experts, as SGLang's loader reads it), saved first. Engine as tests/test_sglang_vl_gpu.py
starts it; one engine at a time (SGLang's ``Engine.shutdown`` kills every child of the process), so
the module's engine fixture is parametrized and pytest finishes one model's tests before the next.

- generate with images (Orsta-layout rows) and with videos (Video-R1 rows, each temporal patch's
  time in roll's prompt): the engine keeps roll's expanded prompt ids (its ``prompt_tokens`` are
  the row's length) and its sampled-token log-probs equal transformers' forward with the pixel
  values on the same weights (bf16 tolerance, tests/engine_gpu.py), which they would not if a
  frame were placed elsewhere, its time written otherwise, or a rope position differed;
- compute_log_probs on video rows: SGLang's input log-probs renormalized without the vision tokens
  equal transformers'.

The MoE model's checks bound each token's difference beyond how far one-step bf16 changes of the
routers move transformers' own log-prob of it (``assert_close_moe``: routing near ties may go either
way in any bf16 implementation; tests/test_routing_moves.py shows the bound on CPU).

    pytest -s -x tests/test_sglang_qwen3_vl_gpu.py -m gpu     # SGLang 0.5.16, torchvision, PyAV, 1 GPU

SGLang's logs (a scheduler's traceback included) also go to /tmp/roll_sglang_logs/qwen3_vl_<model>.log
(engine_vl_gpu.sglang_logs_to): a scheduler that dies makes the engine SIGKILL pytest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")
pytest.importorskip("torchvision")  # Qwen3VLProcessor's video processor, which SGLang loads
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

sys.path.insert(0, str(Path(__file__).parent))
from engine_gpu import assert_close, make_strategy  # noqa: E402
from engine_vl_gpu import (  # noqa: E402
    assert_close_beyond,
    assert_close_moe,
    check_generate,
    check_generate_moe,
    hf_sampled_logprobs,
    hf_vl,
    print_row_diffs,
    save_image_rows,
    sglang_logs_to,
    vl_prompts,
)
from engine_vl_gpu import video_prompts as shared_video_prompts  # noqa: E402
from tiny_qwen3_vl import QWEN3_VIDEO_ARGS, SGLANG_DEEPSTACK, build_tiny_qwen3_vl_dir, released_layout  # noqa: E402

from roll.core.batch import Batch  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.strategy.generation import prompt_token_lists  # noqa: E402

PROMPT_LENGTH = 700  # the tiny tokenizer spends ~530 tokens on Video-R1's template


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def setup(request, tmp_path_factory):
    """(root, model directory, its engine); the engine shut down before the next model's starts."""
    root = tmp_path_factory.mktemp("sglang_qwen3_vl_gpu")
    model = build_tiny_qwen3_vl_dir(
        root / "model", full_processor=True, std=0.1, moe=request.param, deepstack=SGLANG_DEEPSTACK
    )
    if request.param:
        released_layout(model)
    save_image_rows(root)
    with pytest.MonkeyPatch.context() as env:
        sglang_logs_to("qwen3_vl_moe" if request.param else "qwen3_vl_dense", env)
        strategy = make_strategy("sglang", model, mem_fraction_static=0.3, disable_cuda_graph=True)
        assert strategy.vision.timestamped
        yield root, model, strategy
        strategy.shutdown()
    torch.cuda.empty_cache()


def video_prompts(root: Path, model: Path) -> Batch:
    return shared_video_prompts(root, model, QWEN3_VIDEO_ARGS, PROMPT_LENGTH)


def check_prompt_lengths(strategy, prompts: Batch) -> None:
    """The engine runs each row's ids as roll gave them: its prompt is the row's length (SGLang's
    processing would write a video's times again, or expand a placeholder, if it re-ran the HF
    processor)."""
    ids = prompt_token_lists(prompts)
    outputs = strategy.engine.generate(
        input_ids=ids,
        sampling_params=[{"max_new_tokens": 1, "temperature": 0.0} for _ in ids],
        **strategy.vision.request_kwargs(prompts, ids, 1),
    )
    assert [o["meta_info"]["prompt_tokens"] for o in outputs] == [len(r) for r in ids]


def is_moe(strategy) -> bool:
    return strategy.vision.model_type == "qwen3_vl_moe"


def test_generate_with_images_matches_transformers(setup):
    root, model, strategy = setup
    prompts = vl_prompts(root, model)
    check_prompt_lengths(strategy, prompts)
    check = check_generate_moe if is_moe(strategy) else check_generate
    check(strategy, prompts, model, f"{strategy.vision.model_type} generate with images")


def test_generate_with_videos_matches_transformers(setup):
    root, model, strategy = setup
    prompts = video_prompts(root, model)
    check_prompt_lengths(strategy, prompts)
    check = check_generate_moe if is_moe(strategy) else check_generate
    check(strategy, prompts, model, f"{strategy.vision.model_type} generate with videos")


def test_compute_log_probs_of_video_rows_matches_transformers(setup):
    root, model, strategy = setup
    out = strategy.generate(video_prompts(root, model), SamplingParams(n=2, max_new_tokens=16, seed=11))
    scored = strategy.compute_log_probs(out)["log_probs"]
    mask = out["response_mask"]
    if is_moe(strategy):  # the engine's prefill and decode may each route a near tie either way
        moves = assert_close_moe(scored, hf_vl(model), out, "qwen3_vl_moe scoring video rows")
        assert_close_beyond(scored, out["infer_logprobs"], moves, mask, "scoring vs sampling log-probs")
    else:
        want = hf_sampled_logprobs(hf_vl(model), out)
        print_row_diffs(scored, want, out, "scoring video rows")
        assert_close(scored, want, mask, "scoring video rows")
        assert_close(scored, out["infer_logprobs"], mask, "scoring vs sampling log-probs")
