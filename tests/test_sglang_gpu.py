"""The ``sglang`` strategy against a real SGLang engine on CUDA (skipped without SGLang or a GPU).

The same checks as tests/test_vllm_gpu.py, on the default example's model shape (tiny Qwen2,
bf16), with the engine's default kernels here (triton attention, pytorch sampler):

- generate with n samples: the Batch layout and the sampled-token log-probs against transformers;
- sampling parameters: top_k=1 equals greedy, stop token ids end responses, min_new_tokens holds;
- prompt scoring (``compute_log_probs``) against transformers;
- seeds and TP=2: tests/test_sglang_gpu_engines.py (their own engines; SGLang's shutdown kills
  every child process of the process, so one engine lives at a time);
- per-request ``generate_one`` and ``abort`` from another thread;
- ``release_memory_occupation`` frees the KV cache and weights; after ``resume`` and a model
  update the engine scores like the new weights;
- ``load_weights`` (``update_weights_from_tensor``) makes the engine score like new weights;

bf16 tolerance: see tests/engine_gpu.py.
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
    check_compute_log_probs_matches_hf,
    check_generate_n_samples_layout_and_logprobs_match_hf,
    check_generate_one_and_abort_from_another_thread,
    check_load_weights_changes_scores_to_the_new_model,
    check_sampling_params_top_k_stop_ids_and_min_tokens,
    free_gib,
    hf_logprobs,
    hf_model,
    make_strategy,
    prompt_batch,
    save_tiny_model,
)

from roll.core.sampling import SamplingParams  # noqa: E402

ENGINE = dict(disable_cuda_graph=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_gpu")
    return save_tiny_model(root / "a", seed=0), save_tiny_model(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(models):
    strategy = make_strategy("sglang", models[0], mem_fraction_static=0.3, **ENGINE)
    yield strategy
    strategy.shutdown()
    torch.cuda.empty_cache()


def test_generate_n_samples_layout_and_logprobs_match_hf(engine, models):
    check_generate_n_samples_layout_and_logprobs_match_hf(engine, models)


def test_sampling_params_top_k_stop_ids_and_min_tokens(engine, models):
    check_sampling_params_top_k_stop_ids_and_min_tokens(engine, models)


def test_compute_log_probs_matches_hf(engine, models):
    check_compute_log_probs_matches_hf(engine, models)


def test_generate_one_and_abort_from_another_thread(engine, models):
    check_generate_one_and_abort_from_another_thread(engine, models)


def test_load_weights_changes_scores_to_the_new_model(engine, models):
    check_load_weights_changes_scores_to_the_new_model(engine, models)


def test_release_frees_memory_and_a_model_update_brings_the_weights_back(engine, models):
    out = engine.generate(prompt_batch(models[0]), SamplingParams(n=1, max_new_tokens=16, seed=7))
    awake = free_gib()
    engine.offload_states()
    released = free_gib()
    print(f"release_memory_occupation freed {released - awake:.2f} GiB")
    assert released - awake > 1.0, f"release freed only {released - awake:.2f} GiB"
    engine.reload_states()  # weights' memory back (contents stale until the update)
    with pytest.raises(RuntimeError, match="no real weights"):
        engine.compute_log_probs(out)
    old = hf_model(models[0])
    engine.load_weights((name, t) for name, t in old.state_dict().items())
    engine.finish_model_update(version=1)
    assert free_gib() < released - 1.0
    assert_close(
        engine.compute_log_probs(out)["log_probs"],
        hf_logprobs(old, out),
        out["response_mask"],
        "after resume",
    )
