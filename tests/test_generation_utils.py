"""The engine-neutral generation helpers every inference strategy builds its output with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from roll.core.batch import Batch
from roll.distributed.strategy.generation import (
    build_generation_batch,
    prompt_token_lists,
    sampling_temperature,
)

PAD = 0


def prompt_batch() -> Batch:
    prompts = torch.tensor([[PAD, PAD, 5, 6], [7, 8, 9, 10], [PAD, PAD, PAD, 11]])
    mask = (prompts != PAD).long()
    return Batch.from_dict(
        {"prompts": prompts, "prompt_mask": mask, "prompt_id": torch.tensor([100, 101, 102])},
        {"tag": ["math", "code", "math"], "ground_truth": ["1", "2", "3"]},
        {"step": 7},
    )


def test_prompt_token_lists_strips_left_padding():
    assert prompt_token_lists(prompt_batch()) == [[5, 6], [7, 8, 9, 10], [11]]


def test_build_generation_batch_orders_samples_prompt_major():
    responses = [[20 + i, 30 + i] for i in range(6)]
    out = build_generation_batch(prompt_batch(), responses, None, n=2, pad_token_id=PAD, response_length=3)
    assert len(out) == 6
    # row i*n + j is sample j of prompt i
    assert out["prompts"].tolist() == prompt_batch()["prompts"].repeat_interleave(2, 0).tolist()
    assert out["responses"][:, :2].tolist() == responses
    assert out.non_tensors["tag"].tolist() == ["math", "math", "code", "code", "math", "math"]
    assert out.non_tensors["ground_truth"].tolist() == ["1", "1", "2", "2", "3", "3"]
    assert out["prompt_id"].tolist() == [100, 100, 101, 101, 102, 102]
    assert out.meta["step"] == 7


def test_build_generation_batch_fields_and_masks():
    responses = [[21, 22, 1], [23], [24, 25, 26, 27, 28], []]
    logps = [[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6, -0.7, -0.8, -0.9], []]
    batch = prompt_batch().index([0, 2])
    out = build_generation_batch(batch, responses, logps, n=2, pad_token_id=PAD, response_length=4)
    assert set(out.tensors) == {
        "prompts",
        "prompt_mask",
        "responses",
        "response_mask",
        "input_ids",
        "attention_mask",
        "position_ids",
        "infer_logprobs",
        "prompt_id",
    }
    assert out["responses"].tolist() == [[21, 22, 1, PAD], [23, PAD, PAD, PAD], [24, 25, 26, 27], [PAD] * 4]
    assert out["response_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    expected_logp = [[-0.1, -0.2, -0.3, 0.0], [-0.4, 0, 0, 0], [-0.5, -0.6, -0.7, -0.8], [0.0] * 4]
    assert torch.allclose(out["infer_logprobs"], torch.tensor(expected_logp))
    assert out["infer_logprobs"].dtype == torch.float32
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["attention_mask"], torch.cat([out["prompt_mask"], out["response_mask"]], 1))
    # prompt [PAD, PAD, 5, 6] + response [21, 22, 1, PAD]
    assert out["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 4]
    # prompt [PAD, PAD, PAD, 11] + empty response
    assert out["position_ids"][3].tolist() == [0] * 8
    assert out["input_ids"].dtype == torch.long and out["attention_mask"].dtype == torch.long


def test_build_generation_batch_replaces_prompt_side_copies_of_generated_fields():
    batch = prompt_batch()
    batch.tensors["input_ids"] = batch["prompts"].clone()  # a prompt-only copy from the dataset
    out = build_generation_batch(batch, [[4]] * 3, None, n=1, pad_token_id=PAD, response_length=2)
    assert out["input_ids"].shape == (3, 6)
    assert "infer_logprobs" not in out


@pytest.mark.parametrize("temperature, expected", [(0.7, 0.7), (1.0, 1.0), (0.0, 1.0)])
def test_build_generation_batch_records_scoring_temperature(temperature, expected):
    out = build_generation_batch(prompt_batch(), [[4]] * 3, None, 1, PAD, 2, temperature=temperature)
    assert out.meta["temperature"] == expected == sampling_temperature(temperature)


def test_build_generation_batch_rejects_wrong_counts():
    with pytest.raises(ValueError, match="3 prompts x 2 samples = 6"):
        build_generation_batch(prompt_batch(), [[1]] * 5, None, 2, PAD, 4)
    with pytest.raises(ValueError, match="response 1: 2 tokens but 1 log-probs"):
        build_generation_batch(prompt_batch(), [[1], [2, 3], [4]], [[0.0], [0.0], [0.0]], 1, PAD, 4)
    with pytest.raises(ValueError, match="log-prob lists"):
        build_generation_batch(prompt_batch(), [[1]] * 3, [[0.0]] * 2, 1, PAD, 4)


def test_build_generation_batch_splits_back_by_rows():
    out = build_generation_batch(prompt_batch(), [[9, 9]] * 12, None, 4, PAD, 3)
    parts = out.chunk(3)
    for i, part in enumerate(parts):
        assert part.non_tensors["tag"].tolist() == [prompt_batch().non_tensors["tag"][i]] * 4
        assert isinstance(part.non_tensors["tag"], np.ndarray)
