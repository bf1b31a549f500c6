"""The SFT pipeline: chat encoding with loss on assistant tokens, bad data, and a short CPU run
that validates, checkpoints, resumes bit-identically and exports a Hugging Face model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch
import yaml
from transformers import AutoModelForCausalLM

from roll.configs.errors import ConfigError
from roll.configs.sft_config import load_sft_config
from roll.launch.checks import check_sft_config
from roll.models.tiny import TinyModelSpec, build_tiny_qwen2, build_tokenizer, save_model_and_tokenizer
from roll.pipeline.sft.chat_data import encode_chat, load_chat_files, to_sft_batch
from roll.pipeline.sft.pipeline import run_sft_pipeline
from roll.pipeline.sft.stages import sft_loss
from roll.utils.tracking import read_metrics

SMALL = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
QUESTIONS = [f"What is {a} plus {b}?" for a in range(1, 9) for b in range(1, 5)]


def chat(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer([f"user\n{q}" for q in QUESTIONS] + ["assistant\nThe sum is 12."], vocab_size=300)


def write_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_single_turn_trains_on_the_answer_and_eos_only(tokenizer):
    messages = chat("What is 1 plus 2?", "3")
    example = encode_chat(tokenizer, messages, "f:1")
    prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer("3", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert example.input_ids == prompt_ids + answer_ids
    assert example.loss_mask == [0] * len(prompt_ids) + [1] * len(answer_ids)


def test_multi_turn_masks_user_turns_between_answers(tokenizer):
    messages = chat("What is 1 plus 2?", "3") + chat("What is 2 plus 2?", "4")
    example = encode_chat(tokenizer, messages, "f:1")
    trained = [t for t, m in zip(example.input_ids, example.loss_mask) if m]
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "34"]
    assert trained == [digits[0], tokenizer.eos_token_id, digits[1], tokenizer.eos_token_id]
    user2 = tokenizer("What is 2 plus 2?", add_special_tokens=False)["input_ids"]
    start = example.loss_mask.index(1) + 2
    assert example.input_ids[start:].count(user2[0]) and not any(example.loss_mask[start : start + 5])

    batch = to_sft_batch([example, encode_chat(tokenizer, chat("Hi", "1"), "f:2")], tokenizer.pad_token_id)
    assert batch["loss_mask"].sum() == 6 and batch["response_mask"].sum() > batch["loss_mask"].sum()
    log_probs = torch.full(batch["responses"].shape, -2.0)
    loss, _ = sft_loss({"log_probs": log_probs}, batch)
    assert loss.item() == pytest.approx(2.0)


def test_bad_rows_name_the_file_and_line(tokenizer, tmp_path):
    no_answer = write_rows(
        tmp_path / "a.jsonl", [{"messages": chat("Hi", "1")}, {"messages": chat("Hi", "1")[:1]}]
    )
    with pytest.raises(ConfigError, match=r"a.jsonl:2: .*no assistant turn"):
        load_chat_files([str(no_answer)], tokenizer, 64, "data.train_files")
    long_prompt = write_rows(tmp_path / "b.jsonl", [{"messages": chat("What is 1 plus 2? " * 20, "3")}])
    with pytest.raises(ConfigError, match=r"b.jsonl:1: every assistant token lies past max_length 16"):
        load_chat_files([str(long_prompt)], tokenizer, 16, "data.train_files")
    missing = write_rows(tmp_path / "c.jsonl", [{"messages": chat("Hi", "")[:1], "answer": 3}])
    with pytest.raises(
        ConfigError, match=r"c.jsonl:1: expected a string under 'answer' \(data.response_key\)"
    ):
        load_chat_files([str(missing)], tokenizer, 64, "data.train_files", response_key="answer")


def config_dict(tmp: Path, model: Path, out: Path, **top) -> dict:
    raw = yaml.safe_load(Path("examples/config/sft_config.yaml").read_text())
    raw.pop("generation_eval")
    raw.update(
        {"output_dir": str(out), "max_steps": 4, "eval_steps": 2, "save_steps": 2, "track_with": "none"}
    )
    raw.update(top)
    raw["data"] = {"train_files": [str(tmp / "train.jsonl")], "val_files": [str(tmp / "val.jsonl")]}
    raw["actor_train"]["model_args"]["model_name_or_path"] = str(model)
    raw["actor_train"]["training_args"].update(per_device_train_batch_size=4, warmup_steps=1)
    return raw


def load(tmp: Path, name: str, raw: dict):
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_sft_config(path)
    check_sft_config(config)  # as the launcher does before any worker starts
    return config


def test_config_errors_name_the_key(tokenizer, tmp_path):
    raw = config_dict(tmp_path, tmp_path, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"data.train_files.0: .*train.jsonl: no such file"):
        load(tmp_path, "c", raw)
    raw["data"]["shuffle"] = True
    with pytest.raises(ConfigError, match=r"data.shuffle: unknown key"):
        load(tmp_path, "c", raw)
    del raw["data"]["shuffle"]
    write_rows(tmp_path / "train.jsonl", [{"messages": chat("Hi", "1")}])
    write_rows(tmp_path / "val.jsonl", [{"messages": chat("Hi", "1")}])
    with pytest.raises(ConfigError, match=r"actor_train.model_args.model_name_or_path: .*no config.json"):
        load(tmp_path, "c", raw)


@pytest.mark.slow
def test_sft_run_validates_checkpoints_resumes_and_exports(tokenizer, tmp_path):
    model = tmp_path / "model"
    save_model_and_tokenizer(build_tiny_qwen2(tokenizer, SMALL, seed=0), tokenizer, model)
    rows = [
        {"messages": chat(q, f"The sum is {sum(int(x) for x in q[8:-1].split(' plus '))}.")}
        for q in QUESTIONS
    ]
    write_rows(tmp_path / "train.jsonl", rows[:24])
    write_rows(tmp_path / "val.jsonl", rows[24:])
    try:
        full = run_sft_pipeline(load(tmp_path, "full", config_dict(tmp_path, model, tmp_path / "full")))
        metrics = read_metrics(full / "metrics.jsonl")
        assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]
        assert metrics[4]["val/loss"] < metrics[0]["val/loss"]
        assert (full / "checkpoints" / "step_2" / "actor_train").is_dir()
        exported = AutoModelForCausalLM.from_pretrained(full / "hf_model")

        step_2 = str(full / "checkpoints" / "step_2")
        resumed_cfg = config_dict(tmp_path, model, tmp_path / "resumed", resume_from_checkpoint=step_2)
        resumed = run_sft_pipeline(load(tmp_path, "resumed", resumed_cfg))
    finally:
        ray.shutdown()
    again = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in again] == [3, 4]
    for a, b in zip(again, metrics[3:]):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
            k: v for k, v in b.items() if not k.startswith("time/")
        }
    reloaded = AutoModelForCausalLM.from_pretrained(resumed / "hf_model")
    for (name, a), b in zip(exported.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_sft_run_with_megatron_tp2(tokenizer, tmp_path, shimmed_ray):
    model = tmp_path / "model"
    save_model_and_tokenizer(build_tiny_qwen2(tokenizer, SMALL, seed=0), tokenizer, model)
    rows = [
        {"messages": chat(q, f"The sum is {sum(int(x) for x in q[8:-1].split(' plus '))}.")}
        for q in QUESTIONS
    ]
    write_rows(tmp_path / "train.jsonl", rows[:24])
    write_rows(tmp_path / "val.jsonl", rows[24:])
    raw = config_dict(tmp_path, model, tmp_path / "mega", save_steps=0)
    raw["actor_train"]["strategy_args"] = {
        "strategy_name": "megatron_train",
        "strategy_config": {"tensor_model_parallel_size": 2},
    }
    run_dir = run_sft_pipeline(load(tmp_path, "mega", raw))
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]
    assert metrics[4]["val/loss"] < metrics[0]["val/loss"]
    AutoModelForCausalLM.from_pretrained(run_dir / "hf_model")


RECIPES = {
    "qwen3-235B-A22B-sft_megatron_32gpus": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=4096,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            num_hidden_layers=94,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=1536,
            intermediate_size=12288,
            vocab_size=151936,
        ),
    ),
    "mixtral-8x7B-sft_megatron_8gpus": (
        "MixtralConfig",
        dict(
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_hidden_layers=32,
            num_local_experts=8,
            intermediate_size=14336,
            vocab_size=32000,
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_configs_plan_and_fit_their_model(name, capsys):
    import transformers

    from roll.launch.sft import main
    from roll.models.megatron.model_fit import check_model_fits

    assert main(["--config_name", name, "--dry_run"]) == 0
    assert "megatron_train" in capsys.readouterr().out
    config = load_sft_config(Path("examples/config") / f"{name}.yaml")
    cls, shape = RECIPES[name]
    check_model_fits(getattr(transformers, cls)(**shape), config.actor_train.strategy_args.strategy_config)
