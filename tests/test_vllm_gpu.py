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
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from engine_gpu import (  # noqa: E402
    PROMPTS,
    assert_close,
    free_gib,
    hf_logprobs,
    hf_model,
    prompt_batch,
    save_tiny_model,
)
from engine_gpu import make_strategy as make_engine_strategy  # noqa: E402

from roll.distributed.strategy.base import SamplingParams  # noqa: E402


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
    batch = prompt_batch(models[0])
    out = engine.generate(batch, SamplingParams(n=4, max_new_tokens=24, temperature=1.0, seed=3))
    assert out["responses"].shape == (len(PROMPTS) * 4, 24)
    assert torch.equal(out["prompts"], batch["prompts"].repeat_interleave(4, dim=0))
    lengths = out["response_mask"].sum(1)
    assert lengths.min() >= 1 and lengths.float().mean() > 4, lengths
    samples = out["responses"].view(len(PROMPTS), 4, -1)
    assert any(not torch.equal(samples[i, 0], samples[i, 1]) for i in range(len(PROMPTS)))
    assert_close(
        out["infer_logprobs"], hf_logprobs(hf_model(models[0]), out), out["response_mask"], "generate"
    )


def test_sampling_params_top_k_stop_ids_and_min_tokens(engine, models):
    batch = prompt_batch(models[0])
    greedy = engine.generate(batch, SamplingParams(n=1, max_new_tokens=16, temperature=0.0, logprobs=False))
    top1 = engine.generate(batch, SamplingParams(n=2, max_new_tokens=16, top_k=1, seed=5, logprobs=False))
    assert torch.equal(top1["responses"][::2], greedy["responses"])
    assert torch.equal(top1["responses"][1::2], greedy["responses"])
    # Stop on the token greedy decoding emits third in row 0: that row ends right there.
    stop = int(greedy["responses"][0, 2])
    stopped = engine.generate(
        batch, SamplingParams(n=1, max_new_tokens=16, temperature=0.0, stop_token_ids=[stop])
    )
    first = (greedy["responses"][0] == stop).nonzero()[0].item()
    assert stopped["response_mask"][0].sum().item() == first + 1
    longer = engine.generate(
        batch, SamplingParams(n=1, max_new_tokens=16, min_new_tokens=12, stop_token_ids=[stop], seed=1)
    )
    assert longer["response_mask"].sum(1).min().item() >= 12


def test_compute_log_probs_matches_hf(engine, models):
    out = engine.generate(prompt_batch(models[0]), SamplingParams(n=2, max_new_tokens=20, seed=11))
    scored = engine.compute_log_probs(out)["log_probs"]
    want = hf_logprobs(hf_model(models[0]), out)
    assert_close(scored, want, out["response_mask"], "prompt scoring")
    assert_close(scored, out["infer_logprobs"], out["response_mask"], "scoring vs sampling log-probs")


def test_seeds_reproduce_and_differ_per_dp_rank(engine, models):
    batch = prompt_batch(models[0])
    params = SamplingParams(n=2, max_new_tokens=16, seed=42, logprobs=False)
    a, b = engine.generate(batch, params), engine.generate(batch, params)
    assert torch.equal(a["responses"], b["responses"])
    # The worker offsets params.seed by its DP rank; another rank's seed gives other samples.
    other = engine.generate(batch, dataclasses.replace(params, seed=43))
    assert not torch.equal(a["responses"], other["responses"])


def test_generate_one_and_abort_from_another_thread(engine, models):
    prompt = prompt_batch(models[0], PROMPTS[:1])["prompts"][0]
    ids = [int(t) for t in prompt if t != 0]
    done = engine.generate_one(ids, SamplingParams(n=2, max_new_tokens=8, seed=1))
    assert len(done) == 2 and all(c.finish_reason in ("stop", "length") for c in done)
    result = {}
    long = SamplingParams(n=3, max_new_tokens=100_000, ignore_eos=True)
    worker = threading.Thread(
        target=lambda: result.update(out=engine.generate_one(ids, long, request_id="job"))
    )
    worker.start()
    time.sleep(1.0)
    assert engine.abort(["job"]), "nothing was in flight to abort"
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert [c.finish_reason for c in result["out"]] == ["abort"] * 3


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
    out = engine.generate(prompt_batch(models[0]), SamplingParams(n=2, max_new_tokens=20, seed=2))
    new = hf_model(models[1])
    want = hf_logprobs(new, out)
    with pytest.raises(AssertionError):  # the old weights do not pass the tolerance
        assert_close(engine.compute_log_probs(out)["log_probs"], want, out["response_mask"], "old weights")
    engine.load_weights((name, t) for name, t in new.state_dict().items())
    assert_close(engine.compute_log_probs(out)["log_probs"], want, out["response_mask"], "after load_weights")
    old = hf_model(models[0])
    engine.load_weights((name, t) for name, t in old.state_dict().items())  # back, for the other tests
    assert_close(
        engine.compute_log_probs(out)["log_probs"], hf_logprobs(old, out), out["response_mask"], "restored"
    )


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
