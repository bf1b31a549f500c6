"""roll.models (loading, log-probs, value model, HF checkpoint writer) and roll.utils.lr_schedule."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import build_tiny_model, build_tiny_model_dir, encode_prompts
from transformers import AutoModelForCausalLM

from roll.configs.errors import ConfigError
from roll.configs.role import ModelArgs, TrainingArgs
from roll.core.batch import Batch
from roll.distributed.strategy.generation import build_generation_batch
from roll.models import logprobs as logprobs_module
from roll.models.hf_checkpoint import write_hf_checkpoint
from roll.models.loading import load_model, resolve_attn_implementation
from roll.models.logprobs import entropy_from_logits, log_probs_from_logits, response_log_probs
from roll.models.tokenizer import load_tokenizer
from roll.models.value_model import ValueModel, response_values
from roll.models.weights import tied_duplicate_names
from roll.utils.lr_schedule import build_lr_lambda, total_optimizer_steps

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


def sample_batch(rows: int = 3, width: int = 5) -> Batch:
    prompts, mask = encode_prompts(["1 + 2 =", "what is 3?", "x"][:rows], 8)
    gen = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 250, (width - i,), generator=gen).tolist() for i in range(rows)]
    return build_generation_batch(
        Batch.from_dict({"prompts": prompts, "prompt_mask": mask}), responses, None, 1, 0, width
    )


# ----------------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("chunk_elements", [1 << 26, 7])  # 7 elements: one row per chunk
def test_log_probs_and_entropy_match_log_softmax(monkeypatch, chunk_elements):
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", chunk_elements)
    logits = torch.randn(2, 3, 11, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3))
    reference = torch.log_softmax(logits.float(), -1)
    got = log_probs_from_logits(logits, labels)
    assert got.dtype == torch.float32
    assert torch.allclose(got, reference.gather(-1, labels[..., None]).squeeze(-1), atol=1e-6)
    entropy = -(reference.exp() * reference).sum(-1)
    assert torch.allclose(entropy_from_logits(logits), entropy, atol=1e-5)
    got.sum().backward()  # differentiable through the chunks
    assert logits.grad is not None and logits.grad.shape == logits.shape


def test_response_log_probs_use_column_p_plus_t_minus_1(model_dir):
    model = load_model(ModelArgs(model_name_or_path=str(model_dir), dtype="fp32")).eval()
    batch = sample_batch()
    width, prompt_width = batch["responses"].shape[1], batch["prompts"].shape[1]
    with torch.no_grad():
        out = response_log_probs(model, batch, temperature=0.5)
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    for row in range(len(batch)):
        for t in range(width):
            if not batch["response_mask"][row, t]:
                assert out["log_probs"][row, t] == 0 and out["entropy"][row, t] == 0
                continue
            column = torch.log_softmax(logits[row, prompt_width + t - 1] / 0.5, -1)
            assert torch.allclose(out["log_probs"][row, t], column[batch["responses"][row, t]], atol=1e-5)


# ------------------------------------------------------------------------------------- loading
def test_attn_implementation_names():
    assert resolve_attn_implementation(ModelArgs()) == "sdpa"
    assert resolve_attn_implementation(ModelArgs(flash_attn="fa2")) == "flash_attention_2"
    assert resolve_attn_implementation(ModelArgs(attn_implementation="eager", flash_attn="fa2")) == "eager"
    with pytest.raises(ConfigError, match="model_args.flash_attn"):
        resolve_attn_implementation(ModelArgs(flash_attn="fa9"))


def test_load_errors_name_the_directory(tmp_path):
    with pytest.raises(ConfigError, match="model_name_or_path: is not set"):
        load_model(ModelArgs())
    with pytest.raises(ConfigError, match=str(tmp_path / "missing")):
        load_model(ModelArgs(model_name_or_path=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match=str(tmp_path / "nope")):
        load_tokenizer(str(tmp_path / "nope"))


def test_load_model_dtype_and_checkpointing(model_dir):
    model = load_model(ModelArgs(model_name_or_path=str(model_dir), dtype="bf16"), training=True)
    assert model.dtype == torch.bfloat16 and model.is_gradient_checkpointing
    model = load_model(
        ModelArgs(model_name_or_path=str(model_dir), disable_gradient_checkpointing=True), training=True
    )
    assert not model.is_gradient_checkpointing
    tokenizer = load_tokenizer(str(model_dir))
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.padding_side) == (0, 1, "left")


def test_value_model_head_is_seeded_and_round_trips(model_dir, tmp_path):
    args = ModelArgs(model_name_or_path=str(model_dir), dtype="fp32", model_type="value")
    a, b, c = load_model(args, seed=1), load_model(args, seed=1), load_model(args, seed=2)
    assert isinstance(a, ValueModel)
    assert torch.equal(a.value_head.weight, b.value_head.weight)
    assert not torch.equal(a.value_head.weight, c.value_head.weight)
    assert "value_head.weight" in a.state_dict() and "model.embed_tokens.weight" in a.state_dict()
    batch = sample_batch()
    values = response_values(a, batch)
    assert values.shape == batch["responses"].shape and values.dtype == torch.float32
    with torch.no_grad():
        a.value_head.bias.fill_(0.25)
    write_hf_checkpoint(
        tmp_path / "critic", iter(a.state_dict().items()), a.config, tokenizer_dir=str(model_dir)
    )
    reloaded = ValueModel.from_pretrained(str(tmp_path / "critic"), seed=5, dtype=torch.float32)
    assert torch.equal(reloaded.value_head.bias, a.value_head.bias)
    assert torch.allclose(response_values(reloaded, batch), response_values(a, batch), atol=1e-6)


# --------------------------------------------------------------------------- HF checkpoint writer
@pytest.mark.parametrize("tied", [True, False])
def test_write_hf_checkpoint_shards_and_loads_as_is(tmp_path, tied):
    model = build_tiny_model(seed=3, tie_word_embeddings=tied).eval()
    skip = tied_duplicate_names(model)
    assert skip == ({"lm_head.weight"} if tied else set())
    write_hf_checkpoint(
        tmp_path,
        iter(model.state_dict().items()),
        model.config,
        model.generation_config,
        max_shard_bytes=20_000,
        skip=skip,
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / f).is_file() for f in files)
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(3, 200, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


# ------------------------------------------------------------------------------------ LR schedule
def test_lr_schedules():
    constant = build_lr_lambda(TrainingArgs(warmup_steps=4), None)
    assert [constant(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = build_lr_lambda(TrainingArgs(lr_scheduler_type="linear", min_lr_ratio=0.1), 10)
    assert linear(0) == 1.0 and math.isclose(linear(5), 0.55) and math.isclose(linear(10), 0.1)
    assert math.isclose(linear(50), 0.1)
    cosine = build_lr_lambda(TrainingArgs(lr_scheduler_type="cosine", warmup_ratio=0.2), 10)
    assert cosine(0) == 0.5 and cosine(1) == 1.0 and math.isclose(cosine(2), 1.0)
    assert math.isclose(cosine(6), 0.5) and math.isclose(cosine(10), 0.0, abs_tol=1e-12)
    with pytest.raises(ValueError, match="needs the total number of optimizer steps"):
        build_lr_lambda(TrainingArgs(lr_scheduler_type="cosine"), None)


def test_total_optimizer_steps():
    run = type("P", (), {"rollout_batch_size": 8, "num_return_sequences_in_group": 4, "ppo_epochs": 2})()
    run.max_steps = 5
    args = TrainingArgs(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert total_optimizer_steps(run, args, dp_size=2) == 5 * 2 * (32 // 8)
    run.rollout_batch_size = 1  # fewer samples than a mini-batch: still one optimizer step per epoch
    assert total_optimizer_steps(run, args, dp_size=2) == 5 * 2


def test_copy_into_casts_and_checks_everything_before_copying():
    from roll.models.weights import copy_into

    targets = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    assert copy_into(targets, [("a", torch.ones(2, 3, dtype=torch.float64)), ("b", torch.arange(4.0))]) == 2
    assert torch.equal(targets["a"], torch.ones(2, 3)) and targets["b"].tolist() == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="unknown tensor 'c'"):
        copy_into(targets, [("a", torch.full((2, 3), 7.0)), ("c", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"'b' has shape \(5,\), the model expects \(4,\)"):
        copy_into(targets, [("a", torch.full((2, 3), 7.0)), ("b", torch.zeros(5))])
    assert torch.equal(targets["a"], torch.ones(2, 3))  # a bad bucket changes nothing
