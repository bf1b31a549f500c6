"""The default example's generated task, tokenizer, tiny model and accuracy evaluation (the warm start
itself is the SFT pipeline: tests/test_sft_pipeline.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples.tasks.arithmetic import Problem, column_steps, make_splits, sft_rows, write_task
from roll.models.tiny import TinyModelSpec, build_tiny_qwen2, build_tokenizer, save_model_and_tokenizer
from roll.pipeline.rewards.math_rule import math_rule_reward
from roll.pipeline.sft.evaluate import accuracy, generate_responses

torch.set_num_threads(1)
SMALL = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=2)


def evaluate_step(step: str) -> bool:
    """Whether a column step such as ``6-1-1=4`` is true arithmetic."""
    lhs, rhs = step.split("=")
    terms = re.findall(r"[+-]?\d+", lhs)
    return sum(int(t) for t in terms) == int(rhs)


@pytest.fixture(scope="module")
def splits():
    return make_splits({"val": 100, "train": 300, "sft": 400}, seed=7)


@pytest.fixture(scope="module")
def tokenizer(splits):
    texts = [f"user\n{p.question}" for p in splits["sft"]] + [
        f"assistant\n{p.solution}" for p in splits["sft"]
    ]
    return build_tokenizer(texts, vocab_size=400)


def test_generator_is_deterministic_and_splits_are_disjoint(splits):
    again = make_splits({"val": 100, "train": 300, "sft": 400}, seed=7)
    assert all(splits[k] == again[k] for k in splits)
    assert make_splits({"val": 100, "train": 300, "sft": 400}, seed=8)["val"] != splits["val"]
    keys = {name: {(p.op, p.a, p.b) for p in problems} for name, problems in splits.items()}
    assert (
        not keys["val"] & keys["train"] and not keys["val"] & keys["sft"] and not keys["train"] & keys["sft"]
    )
    assert len(keys["val"]) == 100  # validation problems are distinct


def test_answers_and_worked_solutions_are_correct(splits):
    for problem in [p for ps in splits.values() for p in ps]:
        assert problem.answer == (problem.a + problem.b if problem.op == "+" else problem.a - problem.b) >= 0
        assert str(problem.a) in problem.question and str(problem.b) in problem.question
        assert all(evaluate_step(s) for s in column_steps(problem.op, problem.a, problem.b))
        assert math_rule_reward(problem.solution, str(problem.answer)) == 1.0
    assert Problem("", "+", 37, 48).solution == "37+48: 7+8=15, 3+4+1=8, \\boxed{85}"
    assert Problem("", "-", 61, 19).solution == "61-19: 11-9=2, 6-1-1=4, \\boxed{42}"
    assert column_steps("-", 503, 208) == ["13-8=5", "10-1-0=9", "5-1-2=2"]


def test_write_task_files(tmp_path):
    paths = write_task(tmp_path, seed=1, n_sft=300, n_train=50, n_val=20, direct_fraction=0.5)
    rows = {
        name: [json.loads(line) for line in path.read_text().splitlines()] for name, path in paths.items()
    }
    assert [len(rows[n]) for n in ("sft", "train", "val")] == [300, 50, 20]
    val = rows["val"][0]
    assert val["tag"] == "arithmetic" and val["messages"][0]["role"] == "user"
    assert str(int(val["ground_truth"])) == val["ground_truth"]
    direct = [r for r in rows["sft"] if r["target"] != r["solution"]]
    assert 0.4 < len(direct) / 300 < 0.6
    assert all(r["target"] == f"\\boxed{{{r['ground_truth']}}}" for r in direct)
    assert write_task(tmp_path / "again", seed=1, n_sft=300, n_train=50, n_val=20)["sft"].read_text() == (
        paths["sft"].read_text()
    )
    assert sft_rows([], 0.5, 0) == []


def test_tokenizer_round_trip_and_chat_template(tokenizer, tmp_path):
    for text in ["Ava has 37 marbles.", "37+48: 7+8=15, 3+4+1=8, \\boxed{85}", "unseen: ünïcode 😀 \t\n x"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    digits = tokenizer.convert_ids_to_tokens(tokenizer("12345")["input_ids"])
    assert digits == ["1", "2", "3", "4", "5"]  # one token per digit, as in Qwen2
    messages = [{"role": "user", "content": "Ava has 37 marbles."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nAva has 37 marbles.<|im_end|>\n<|im_start|>assistant\n"
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        "<|endoftext|>",
    )
    assert len(tokenizer) <= 400

    model = build_tiny_qwen2(tokenizer, SMALL, seed=0)
    save_model_and_tokenizer(model, tokenizer, tmp_path / "m")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == prompt
    sample = "Zoe had 90 coins. \\boxed{103} <|im_end|>"
    assert loaded(sample)["input_ids"] == tokenizer(sample)["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert reloaded.config.model_type == "qwen2" and reloaded.config.vocab_size == len(tokenizer)
    assert reloaded.generation_config.eos_token_id == tokenizer.eos_token_id
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))


def test_generation_accuracy_matches_the_rule_reward(splits, tokenizer):
    model = build_tiny_qwen2(tokenizer, SMALL, seed=0)
    val = [
        {"messages": [{"role": "user", "content": p.question}], "ground_truth": str(p.answer)}
        for p in splits["val"][:8]
    ]
    greedy = generate_responses(model, tokenizer, [r["messages"] for r in val], 12, temperature=0.0)
    assert len(greedy) == 8 and all(len(tokenizer(r)["input_ids"]) <= 12 for r in greedy)
    expected = sum(math_rule_reward(g, r["ground_truth"]) for g, r in zip(greedy, val)) / 8
    assert accuracy(model, tokenizer, val, 0.0, 12) == expected
    assert accuracy(model, tokenizer, val, 1.0, 12, reward_fn=lambda response, truth: 1.0) == 1.0
