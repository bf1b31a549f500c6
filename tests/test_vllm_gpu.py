"""The ``vllm`` strategy against a real vLLM engine on CUDA (skipped without vLLM or a GPU).

What each test checks, on the default example's model shape (tiny Qwen2, bf16):

- generate with n samples: the Batch layout (row ``i * n + j`` = sample j of prompt i) and the
  engine's sampled-token log-probs against transformers' forward on the same weights;
- sampling parameters: top_k=1 equals greedy, stop token ids end responses, min_new_tokens holds;
- prompt scoring (``compute_log_probs``) against transformers;
- seeds: one seed reproduces, another DP rank's seed differs;
- per-request ``generate_one`` and ``abort`` from another thread;
- ``sleep``/``wake_up`` frees the KV cache and weights and brings them back (same greedy output);
- ``load_weights`` (in-process, and by CUDA IPC into TP=2 workers) makes the engine score like the
  new weights;
- a model update through Ray from an fsdp2_train trainer: colocated (CUDA IPC) and, on 2 GPUs,
  disaggregated (NCCL), checksums equal and the probe within bf16 tolerance.

bf16 tolerance: see tests/engine_gpu.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
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
    prompt_batch,
    save_tiny_model,
)
from engine_gpu import make_strategy as make_engine_strategy  # noqa: E402

from roll.core.sampling import SamplingParams  # noqa: E402


def make_strategy(model_dir: Path, rank: int = 0, **cfg):
    return make_engine_strategy("vllm", model_dir, rank, **cfg)


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_gpu")
    return save_tiny_model(root / "a", seed=0), save_tiny_model(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(models):
    strategy = make_strategy(models[0], gpu_memory_utilization=0.25, enforce_eager=True, sleep_level=1)
    yield strategy
    del strategy.llm
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ tests


def test_generate_n_samples_layout_and_logprobs_match_hf(engine, models):
    check_generate_n_samples_layout_and_logprobs_match_hf(engine, models)


def test_sampling_params_top_k_stop_ids_and_min_tokens(engine, models):
    check_sampling_params_top_k_stop_ids_and_min_tokens(engine, models)


def test_compute_log_probs_matches_hf(engine, models):
    check_compute_log_probs_matches_hf(engine, models)


def test_seeds_reproduce_and_differ_per_dp_rank(engine, models):
    batch = prompt_batch(models[0])
    params = SamplingParams(n=2, max_new_tokens=16, seed=42, logprobs=False)
    a, b = engine.generate(batch, params), engine.generate(batch, params)
    assert torch.equal(a["responses"], b["responses"])
    # The worker offsets params.seed by its DP rank; another rank's seed gives other samples.
    other = engine.generate(batch, dataclasses.replace(params, seed=43))
    assert not torch.equal(a["responses"], other["responses"])


def test_generate_one_and_abort_from_another_thread(engine, models):
    check_generate_one_and_abort_from_another_thread(engine, models)


def test_sleep_frees_memory_and_wake_restores_outputs(engine, models):
    batch = prompt_batch(models[0])
    greedy = SamplingParams(n=1, max_new_tokens=16, temperature=0.0, logprobs=False)
    before = engine.generate(batch, greedy)
    awake = free_gib()
    engine.offload_states()
    asleep = free_gib()
    print(f"sleep(level=1) freed {asleep - awake:.2f} GiB")
    assert asleep - awake > 1.0, f"sleep freed only {asleep - awake:.2f} GiB"
    engine.reload_states()
    assert free_gib() < asleep - 1.0
    assert torch.equal(engine.generate(batch, greedy)["responses"], before["responses"])


def test_load_weights_in_process_changes_scores_to_the_new_model(engine, models):
    check_load_weights_changes_scores_to_the_new_model(engine, models)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_2_generates_scores_and_loads_by_ipc(models, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0,1"))
    tp = make_strategy(models[0], tensor_parallel_size=2, gpu_memory_utilization=0.25, enforce_eager=True)
    try:
        out = tp.generate(prompt_batch(models[0]), SamplingParams(n=2, max_new_tokens=20, seed=4))
        assert_close(
            out["infer_logprobs"], hf_logprobs(hf_model(models[0]), out), out["response_mask"], "TP2 generate"
        )
        new = hf_model(models[1])
        tp.load_weights((name, t) for name, t in new.state_dict().items())  # CUDA IPC into both workers
        assert_close(
            tp.compute_log_probs(out)["log_probs"], hf_logprobs(new, out), out["response_mask"], "TP2 load"
        )
    finally:
        del tp.llm
        torch.cuda.empty_cache()
