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

import threading
import time

import pytest
import torch

pytest.importorskip("sglang")
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
    make_strategy,
    prompt_batch,
    save_tiny_model,
)

from roll.distributed.strategy.base import SamplingParams  # noqa: E402

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
    assert_close(scored, hf_logprobs(hf_model(models[0]), out), out["response_mask"], "prompt scoring")
    assert_close(scored, out["infer_logprobs"], out["response_mask"], "scoring vs sampling log-probs")


def test_generate_one_and_abort_from_another_thread(engine, models):
    prompt = prompt_batch(models[0], PROMPTS[:1])["prompts"][0]
    ids = [int(t) for t in prompt if t != 0]
    done = engine.generate_one(ids, SamplingParams(n=2, max_new_tokens=8, seed=1))
    assert len(done) == 2 and all(c.finish_reason in ("stop", "length") for c in done)
    result = {}
    long = SamplingParams(n=3, max_new_tokens=4000, ignore_eos=True)  # stopped at the context

    def run() -> None:
        try:
            result["out"] = engine.generate_one(ids, long, request_id="job")
        except Exception as exc:  # re-raised below, on the test's thread
            result["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while not engine.registry.in_flight() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.abort(["job"]), "nothing was in flight to abort"
    worker.join(timeout=60)
    assert not worker.is_alive()
    if "error" in result:
        raise result["error"]
    assert [c.finish_reason for c in result["out"]] == ["abort"] * 3


def test_load_weights_changes_scores_to_the_new_model(engine, models):
    out = engine.generate(prompt_batch(models[0]), SamplingParams(n=2, max_new_tokens=20, seed=2))
    new = hf_model(models[1])
    want = hf_logprobs(new, out)
    with pytest.raises(AssertionError):  # the old weights do not pass the tolerance
        assert_close(engine.compute_log_probs(out)["log_probs"], want, out["response_mask"], "old weights")
    engine.load_weights((name, t) for name, t in new.state_dict().items())
    assert_close(engine.compute_log_probs(out)["log_probs"], want, out["response_mask"], "after load_weights")
    old = hf_model(models[0])
    engine.load_weights((name, t) for name, t in old.state_dict().items())
    assert_close(
        engine.compute_log_probs(out)["log_probs"], hf_logprobs(old, out), out["response_mask"], "restored"
    )


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
