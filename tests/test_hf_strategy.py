"""hf_infer on a tiny Qwen2 saved to disk and loaded back through roll.models.loading."""

from __future__ import annotations

import pytest
import torch
from tiny_models import PAD_ID, build_tiny_model, build_tiny_model_dir, encode_prompts
from transformers import TopKLogitsWarper, TopPLogitsWarper

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.registry import load_strategy_class
from roll.models.logprobs import response_logits

torch.set_num_threads(1)
PROMPTS = ["1 + 2 =", "what is 3?", "x", "so 4 * 5 ="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


def make_strategy(path, infer_batch_size: int = 2, model_type: str | None = None, seed: int = 42):
    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=str(path), dtype="fp32", model_type=model_type),
        strategy_args=StrategyArgs("hf_infer"),
        infer_batch_size=infer_batch_size,
    )
    strategy = load_strategy_class("hf_infer")(
        role, WorkerContext("actor_infer", 0, 1, 0, torch.device("cpu"), seed)
    )
    strategy.initialize()
    return strategy


@pytest.fixture(scope="module")
def strategy(model_dir):
    return make_strategy(model_dir)


def prompt_batch(texts=PROMPTS, length: int = 12) -> Batch:
    prompts, mask = encode_prompts(texts, length)
    return Batch.from_dict({"prompts": prompts, "prompt_mask": mask}, {"idx": list(range(len(texts)))})


def test_generate_layout_and_sample_order(strategy):
    batch = prompt_batch()
    out = strategy.generate(batch, SamplingParams(n=3, max_new_tokens=6))
    rows, width = len(PROMPTS) * 3, 6
    assert out["responses"].shape == (rows, width)
    assert (
        out["input_ids"].shape
        == out["attention_mask"].shape
        == out["position_ids"].shape
        == (rows, 12 + width)
    )
    assert out.non_tensors["idx"].tolist() == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert torch.equal(out["prompts"], batch["prompts"].repeat_interleave(3, 0))
    assert torch.equal(out["attention_mask"], torch.cat([out["prompt_mask"], out["response_mask"]], 1))
    expected_pos = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(out["position_ids"], expected_pos)
    assert out.meta["temperature"] == 1.0
    # Samples of one prompt differ (random tiny model, 272 tokens).
    assert not torch.equal(out["responses"][0], out["responses"][1])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_logprobs_match_compute_log_probs(strategy, temperature):
    out = strategy.generate(prompt_batch(), SamplingParams(n=2, max_new_tokens=8, temperature=temperature))
    assert out.meta["temperature"] == temperature
    scored = strategy.compute_log_probs(out)
    mask = out["response_mask"].bool()
    assert torch.allclose(scored["log_probs"], out["infer_logprobs"], atol=1e-5, rtol=0)
    assert (out["infer_logprobs"][~mask] == 0).all() and (scored["log_probs"][~mask] == 0).all()
    assert (scored["entropy"][mask] > 0).all()


def test_topk_topp_logprobs_are_those_of_the_truncated_distribution(strategy):
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.8, top_k=5, top_p=0.9)
    out = strategy.generate(prompt_batch(), params)
    with torch.no_grad():
        logits = response_logits(strategy.model, out) / 0.8  # [B, R, V]
    flat = logits.reshape(-1, logits.shape[-1])
    ids = out["input_ids"].repeat_interleave(out["responses"].shape[1], 0)  # processors ignore them here
    warped = TopPLogitsWarper(0.9)(ids, TopKLogitsWarper(5)(ids, flat.clone()))
    expected = (
        torch.log_softmax(warped, -1)
        .gather(-1, out["responses"].reshape(-1, 1))
        .reshape(out["responses"].shape)
    )
    mask = out["response_mask"].bool()
    assert torch.allclose(out["infer_logprobs"][mask], expected[mask], atol=1e-5)
    assert (torch.isfinite(expected[mask])).all()  # every sampled token survived top-k/top-p
    full = strategy.compute_log_probs(out)["log_probs"]
    assert (out["infer_logprobs"][mask] > full[mask]).all()  # renormalised over fewer tokens


def test_greedy_is_deterministic_and_same_for_all_samples(strategy):
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.0)
    first = strategy.generate(prompt_batch(), params)
    second = strategy.generate(prompt_batch(), params)
    assert torch.equal(first["responses"], second["responses"])
    assert torch.equal(first["responses"][0::2], first["responses"][1::2])
    assert first.meta["temperature"] == 1.0
    scored = strategy.compute_log_probs(first)
    assert torch.allclose(scored["log_probs"], first["infer_logprobs"], atol=1e-5, rtol=0)


def test_sampling_is_reproducible_from_the_seed(model_dir, strategy):
    params = SamplingParams(n=2, max_new_tokens=6)
    again = make_strategy(model_dir)
    fresh = make_strategy(model_dir)
    first, second = fresh.generate(prompt_batch(), params), fresh.generate(prompt_batch(), params)
    assert not torch.equal(first["responses"], second["responses"])  # the stream advances
    assert torch.equal(again.generate(prompt_batch(), params)["responses"], first["responses"])
    seeded = SamplingParams(n=2, max_new_tokens=6, seed=7)
    assert torch.equal(
        strategy.generate(prompt_batch(), seeded)["responses"],
        again.generate(prompt_batch(), seeded)["responses"],
    )


def test_micro_batch_size_does_not_change_greedy_outputs_or_logprobs(model_dir, strategy):
    params = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    one = make_strategy(model_dir, infer_batch_size=1)
    a, b = strategy.generate(prompt_batch(), params), one.generate(prompt_batch(), params)
    assert torch.equal(a["responses"], b["responses"])
    assert torch.allclose(
        strategy.compute_log_probs(a)["log_probs"], one.compute_log_probs(a)["log_probs"], atol=1e-5
    )


def test_stop_token_and_stop_string_cut_the_response(strategy):
    greedy = SamplingParams(n=1, max_new_tokens=8, temperature=0.0)
    batch = prompt_batch(PROMPTS[:1])
    full = strategy.generate(batch, greedy)["responses"][0].tolist()
    stop_token = full[2]
    cut = full[: full.index(stop_token) + 1]
    out = strategy.generate(batch, SamplingParams(**{**vars(greedy), "stop_token_ids": [stop_token]}))
    assert out["response_mask"][0].sum() == len(cut)
    assert out["responses"][0, : len(cut)].tolist() == cut
    assert (out["responses"][0, len(cut) :] == PAD_ID).all()

    text = strategy.tokenizer.decode(full[:3])
    stop = text[-1]  # the character completed by the third token
    first_hit = next(k for k in range(1, 9) if stop in strategy.tokenizer.decode(full[:k]))
    out = strategy.generate(batch, SamplingParams(**{**vars(greedy), "stop": [stop]}))
    assert out["response_mask"][0].sum() == first_hit
    assert out["responses"][0, :first_hit].tolist() == full[:first_hit]


def test_min_new_tokens_holds_back_stop_tokens(strategy):
    greedy = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    batch = prompt_batch(PROMPTS[:1])
    first = strategy.generate(batch, greedy)["responses"][0, 0].item()
    stopped = strategy.generate(batch, SamplingParams(**{**vars(greedy), "stop_token_ids": [first]}))
    assert stopped["response_mask"][0].sum() == 1
    held = strategy.generate(
        batch, SamplingParams(**{**vars(greedy), "stop_token_ids": [first], "min_new_tokens": 3})
    )
    tokens = held["responses"][0][held["response_mask"][0].bool()].tolist()
    assert len(tokens) >= 3 and first not in tokens[:3]


def test_offload_and_reload_keep_outputs(model_dir):
    strategy = make_strategy(model_dir)
    out = strategy.generate(prompt_batch(), SamplingParams(n=1, max_new_tokens=5, temperature=0.0))
    before = strategy.compute_log_probs(out)["log_probs"]
    strategy.offload_states()
    strategy.reload_states()
    assert torch.equal(strategy.compute_log_probs(out)["log_probs"], before)


def test_load_weights_round_trip_and_errors(tmp_path, strategy):
    other_dir = build_tiny_model_dir(tmp_path / "other", seed=1)
    target = make_strategy(strategy.role_config.model_args.model_name_or_path)
    reference = make_strategy(other_dir)
    out = target.generate(prompt_batch(), SamplingParams(n=1, max_new_tokens=5))
    assert not torch.allclose(
        target.compute_log_probs(out)["log_probs"], reference.compute_log_probs(out)["log_probs"]
    )
    source = build_tiny_model(seed=1).to(torch.bfloat16)  # any dtype: cast on copy
    target.load_weights(iter(reference.model.state_dict().items()))
    assert torch.equal(
        target.compute_log_probs(out)["log_probs"], reference.compute_log_probs(out)["log_probs"]
    )
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        target.load_weights(iter([("model.layers.9.mlp.up_proj.weight", torch.zeros(64, 32))]))
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(31,\).*\(32,\)"):
        target.load_weights(iter([("model.norm.weight", torch.zeros(31))]))
    target.load_weights(iter(source.state_dict().items()))
    assert target.model.model.norm.weight.dtype == torch.float32


def test_value_model_gives_values_and_cannot_generate(model_dir):
    critic = make_strategy(model_dir, model_type="value")
    out = make_strategy(model_dir).generate(prompt_batch(), SamplingParams(n=1, max_new_tokens=4))
    values = critic.compute_values(out)
    assert values.shape == out["responses"].shape
    assert (values[out["response_mask"] == 0] == 0).all()
    with pytest.raises(ValueError, match="a value model has values, not log-probs"):
        critic.compute_log_probs(out)
    with pytest.raises(ValueError, match="value model cannot generate"):
        critic.generate(prompt_batch(), SamplingParams())


def test_response_length_of_the_pipeline_pads_every_batch(model_dir, strategy):
    from dataclasses import replace

    ctx = replace(strategy.ctx, response_length=10)
    wide = load_strategy_class("hf_infer")(strategy.role_config, ctx)
    wide.initialize()
    out = wide.generate(prompt_batch(), SamplingParams(n=1, max_new_tokens=32))
    assert out["responses"].shape == (len(PROMPTS), 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generate_offload_and_reload_on_gpu(model_dir):
    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=str(model_dir), dtype="fp32"),
        strategy_args=StrategyArgs("hf_infer"),
        infer_batch_size=2,
    )
    strategy = load_strategy_class("hf_infer")(
        role, WorkerContext("actor_infer", 0, 1, 0, torch.device("cuda:0"))
    )
    strategy.initialize()
    out = strategy.generate(prompt_batch(), SamplingParams(n=2, max_new_tokens=8, temperature=0.9))
    assert out["responses"].device.type == "cpu"
    before = strategy.compute_log_probs(out)["log_probs"]
    assert torch.allclose(before, out["infer_logprobs"], atol=1e-4)
    strategy.offload_states()
    assert all(p.device.type == "cpu" for p in strategy.model.parameters())
    strategy.reload_states()
    assert all(p.is_cuda for p in strategy.model.parameters())
    assert torch.allclose(strategy.compute_log_probs(out)["log_probs"], before, atol=1e-6)
