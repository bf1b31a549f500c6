"""The ``sglang`` strategy on CUDA with engines of its own (skipped without SGLang or a GPU):
deterministic inference for request seeds, and TP=2 on 2 GPUs. Each test starts and shuts down
its engine; SGLang's ``Engine.shutdown`` kills every child process of the test process, so no
other engine may live beside it (tests/test_sglang_gpu.py shuts its engine down at module end).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from engine_gpu import (  # noqa: E402
    assert_close,
    hf_logprobs,
    hf_model,
    make_strategy,
    prompt_batch,
    save_tiny_model,
)

from roll.core.sampling import SamplingParams  # noqa: E402

ENGINE = dict(disable_cuda_graph=True, mem_fraction_static=0.3)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_gpu_engines")
    return save_tiny_model(root / "a", seed=0), save_tiny_model(root / "b", seed=1)


def test_request_seeds_reproduce_with_deterministic_inference(models):
    deterministic = make_strategy("sglang", models[0], enable_deterministic_inference=True, **ENGINE)
    try:
        batch = prompt_batch(models[0])
        params = SamplingParams(n=2, max_new_tokens=16, seed=42, logprobs=False)
        a, b = deterministic.generate(batch, params), deterministic.generate(batch, params)
        assert torch.equal(a["responses"], b["responses"])
        other = deterministic.generate(batch, SamplingParams(n=2, max_new_tokens=16, seed=43, logprobs=False))
        assert not torch.equal(a["responses"], other["responses"])
    finally:
        deterministic.shutdown()


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_2_generates_scores_and_loads(models):
    tp = make_strategy("sglang", models[0], tensor_parallel_size=2, **ENGINE)
    try:
        out = tp.generate(prompt_batch(models[0]), SamplingParams(n=2, max_new_tokens=20, seed=4))
        assert_close(
            out["infer_logprobs"], hf_logprobs(hf_model(models[0]), out), out["response_mask"], "TP2 generate"
        )
        new = hf_model(models[1])
        tp.load_weights((name, t) for name, t in new.state_dict().items())
        assert_close(
            tp.compute_log_probs(out)["log_probs"], hf_logprobs(new, out), out["response_mask"], "TP2 load"
        )
    finally:
        tp.shutdown()
