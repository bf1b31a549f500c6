"""LoRA keys in configs: ranges and cross-key rules of ``model_args.lora_*``, the pre-launch check of
which role and strategy may carry them, the memory planner's LoRA state, and alibaba/ROLL's keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import tiny_qwen2_config
from transformers import Qwen2ForCausalLM

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.configs.roll_compat import translate_roll_keys
from roll.distributed.scheduler.placement import plan_placement
from roll.launch.checks import check_before_launch
from roll.models.loading import decoder_layers
from roll.models.lora import apply_lora
from roll.models.random_checkpoint import preset_config
from roll.planner.memory import Split, fsdp2_train, megatron_train
from roll.planner.model_shape import shape_from_config
from roll.planner.roles import role_memory

MINIMAL = Path(__file__).resolve().parent / "configs" / "good" / "minimal.yaml"
LORA = ["actor_train.model_args.lora_rank=8", "actor_train.model_args.lora_target=q_proj,v_proj"]


def refused(overrides: list[str], key: str, words: str, launch: bool = False) -> None:
    with pytest.raises(ConfigError) as info:
        config = load_config(MINIMAL, overrides)
        if launch:
            check_before_launch(config, files=False)
    assert info.value.path == key and words in info.value.message, str(info.value)
    assert "\n" not in str(info.value)


def test_roll_s_comma_string_and_a_list_load_alike():
    comma = load_config(MINIMAL, LORA).actor_train.model_args
    listed = load_config(MINIMAL, [LORA[0], "actor_train.model_args.lora_target=[q_proj, v_proj]"])
    assert comma.lora_target == listed.actor_train.model_args.lora_target == ["q_proj", "v_proj"]
    assert comma.lora_alpha is None and comma.lora_dropout == 0.0
    check_before_launch(load_config(MINIMAL, LORA), files=False)


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("lora_rank=0", "lora_rank", "must be >= 1, got 0"),
        ("lora_alpha=0", "lora_alpha", "must be > 0"),
        ("lora_dropout=1.0", "lora_dropout", "must be in [0, 1), got 1.0"),
    ],
)
def test_lora_values_out_of_range(override, key, words):
    overrides = [o for o in LORA if not o.startswith(f"actor_train.model_args.{override.split('=')[0]}")]
    refused([*overrides, f"actor_train.model_args.{override}"], f"actor_train.model_args.{key}", words)


def test_lora_keys_without_a_rank_or_a_rank_without_targets():
    refused([LORA[1]], "actor_train.model_args.lora_target", "lora_rank is not")
    refused([LORA[0]], "actor_train.model_args.lora_target", "is required with lora_rank")


MEGATRON = "actor_train.strategy_args.strategy_name=megatron_train"


def test_lora_on_megatron_train_passes_and_an_unknown_target_is_one_error():
    check_before_launch(load_config(MINIMAL, [*LORA, MEGATRON]), files=False)
    check_before_launch(
        load_config(MINIMAL, [LORA[0], MEGATRON, "actor_train.model_args.lora_target=all-linear"]),
        files=False,
    )
    refused(
        [LORA[0], MEGATRON, "actor_train.model_args.lora_target=q_proj,lm_head"],
        "actor_train.model_args.lora_target",
        "'lm_head' is no linear module megatron_train can adapt; it takes q_proj, k_proj, v_proj, o_proj",
        launch=True,
    )


def test_lora_on_an_inference_role_of_roll_s_own_file_says_to_remove_it():
    refused(
        ["actor_infer.model_args.lora_rank=8", "actor_infer.model_args.lora_target=q_proj"],
        "actor_infer.model_args.lora_target",
        "receives the trainer's merged weights",
        launch=True,
    )


# ----------------------------------------------------------------------------- planner


def test_lora_params_count_the_adapters_of_the_hf_model():
    config = tiny_qwen2_config(tie_word_embeddings=False)
    shape = shape_from_config(config.to_dict())
    for targets in (["q_proj", "v_proj"], ["o_proj", "down_proj"], ["all-linear"]):
        model = Qwen2ForCausalLM(config)
        apply_lora(model, targets, rank=4, alpha=4.0, layers=decoder_layers(model))
        adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert shape.lora_params(targets, 4) == adapters, targets


def test_lora_optimizer_memory_is_a_small_fraction_of_full_training():
    shape = shape_from_config(preset_config("qwen2.5-7b").to_dict())
    lora = shape.lora_params(["o_proj", "q_proj", "k_proj", "v_proj"], 32)
    full = fsdp2_train(shape, 8, 2, 4096, True, sharded=True, mixed=True)
    adapters = fsdp2_train(shape, 8, 2, 4096, True, sharded=True, mixed=True, lora=lora)
    # 20.2 M adapter parameters against 7.6 B: optimizer state and grads ~377 x smaller.
    assert adapters["optimizer"] * 300 < full["optimizer"] and adapters["grads"] * 300 < full["grads"]
    assert adapters["params"] == full["params"] + 4 * lora // 8  # base + fp32 adapters, sharded


def test_the_actor_train_prediction_counts_only_adapters_as_trained():
    shape = shape_from_config(preset_config("qwen2.5-7b").to_dict())

    def predict(overrides: list[str]) -> dict[str, int]:
        config = load_config(MINIMAL, overrides)
        plan = plan_placement(config).roles["actor_train"]
        return role_memory("actor_train", config.actor_train, config, plan, shape, None, True).parts

    full, lora = predict([]), predict(LORA)
    assert lora["optimizer"] * 300 < full["optimizer"] and lora["grads"] * 300 < full["grads"]
    assert lora["params"] > full["params"] and lora["activations"] == full["activations"]


def test_megatron_lora_prediction_counts_only_adapters_as_trained():
    shape = shape_from_config(preset_config("qwen2.5-7b").to_dict())
    split = Split(tp=2, vocab_multiple=128)
    lora = shape.megatron_lora_params(["all-linear"], 64, tp=2)
    full = megatron_train(shape, split, 1, 2, 4096, False, False)
    adapters = megatron_train(shape, split, 1, 2, 4096, False, False, lora=lora)
    # ~81 M adapter parameters per TP rank against ~3.8 B: grads and Adam state ~45 x smaller.
    assert adapters["optimizer"] * 40 < full["optimizer"] and adapters["grads"] * 40 < full["grads"]
    assert adapters["params"] == full["params"] + 2 * lora  # bf16 base + bf16 adapters
    # A partial q/k/v target adapts the whole fused linear_qkv, so it counts like q, k and v.
    assert shape.megatron_lora_params(["q_proj"], 8) == shape.megatron_lora_params(
        ["q_proj", "k_proj", "v_proj"], 8
    )


def test_the_megatron_actor_train_prediction_counts_only_adapters_as_trained():
    shape = shape_from_config(preset_config("qwen2.5-7b").to_dict())

    def predict(overrides: list[str]) -> dict[str, int]:
        config = load_config(MINIMAL, [MEGATRON, *overrides])
        plan = plan_placement(config).roles["actor_train"]
        return role_memory("actor_train", config.actor_train, config, plan, shape, None, True).parts

    full, lora = predict([]), predict(LORA)
    assert lora["optimizer"] * 300 < full["optimizer"] and lora["grads"] * 300 < full["grads"]
    # The base weights as before plus the adapters; no full-model optimizer step afterwards.
    assert lora["params"] > full["params"] and lora["activations"] < full["activations"]


# ---------------------------------------------------------------------- alibaba/ROLL keys


def _roll_file(train: str, infer: str = "vllm", **top) -> dict:
    lora = {"lora_target": "o_proj,q_proj", "lora_rank": 32, "lora_alpha": 32}
    return {
        **top,
        "actor_train": {"model_args": dict(lora), "strategy_args": {"strategy_name": train}},
        "actor_infer": {"model_args": dict(lora), "strategy_args": {"strategy_name": infer}},
        "reference": {"model_args": {"lora_rank": None}, "strategy_args": {"strategy_name": "hf_infer"}},
        "rewards": {"math": {"worker_cls": "x.MathRuleRewardWorker"}},
    }


def test_roll_lora_on_fsdp2_maps_and_the_engine_copy_is_dropped(capsys):
    raw = translate_roll_keys(_roll_file("fsdp2_train", lora_rank=32, lora_target="o_proj,q_proj"))
    assert raw["actor_train"]["model_args"] == {
        "lora_target": "o_proj,q_proj",
        "lora_rank": 32,
        "lora_alpha": 32,
    }
    assert raw["actor_infer"]["model_args"] == {} and raw["reference"]["model_args"] == {}
    assert "lora_rank" not in raw and "lora_target" not in raw
    err = capsys.readouterr().err
    assert (
        "actor_infer.model_args: lora_target, lora_rank, lora_alpha dropped; actor_infer (vllm) receives"
        in err
    )


def test_roll_lora_on_megatron_maps_and_the_engine_copy_is_dropped(capsys):
    raw = translate_roll_keys(_roll_file("megatron_train", infer="megatron_infer", lora_rank=32))
    assert raw["actor_train"]["model_args"] == {
        "lora_target": "o_proj,q_proj",
        "lora_rank": 32,
        "lora_alpha": 32,
    }
    assert raw["actor_infer"]["model_args"] == {} and "lora_rank" not in raw
    err = capsys.readouterr().err
    assert "actor_infer (megatron_infer) receives the trainer's merged weights" in err
    assert "MoE expert MLPs keep no adapters (ROLL's all-linear adapts them too)" in err


def test_roll_top_level_lora_keys_no_role_uses_are_refused():
    with pytest.raises(ConfigError) as info:
        translate_roll_keys({"lora_rank": 32})
    assert "lora_rank=32 (ROLL's top-level LoRA keys only feed ${} references" in str(info.value)
