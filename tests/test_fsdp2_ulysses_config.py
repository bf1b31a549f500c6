"""``strategy_config.ulysses_size`` of fsdp2_train in configs: its range and the checks that name it,
the placement's data-parallel size, the memory planner's share of activations, and alibaba/ROLL's
``model_args.ulysses_size``."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import tiny_qwen2_config

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.configs.roll_compat import translate_roll_keys
from roll.distributed.scheduler.placement import plan_placement
from roll.launch.checks import check_before_launch
from roll.launch.files import check_ulysses_layout
from roll.models.random_checkpoint import preset_config
from roll.models.ulysses import check_heads
from roll.planner.memory import fsdp2_train
from roll.planner.model_shape import shape_from_config
from roll.planner.roles import role_memory

MINIMAL = Path(__file__).resolve().parent / "configs" / "good" / "minimal.yaml"
KEY = "actor_train.strategy_args.strategy_config.ulysses_size"


def refused(overrides: list[str], words: str, key: str = KEY) -> None:
    with pytest.raises(ConfigError) as info:
        check_before_launch(load_config(MINIMAL, overrides), files=False)
    assert info.value.path == key and words in info.value.message, str(info.value)
    assert "\n" not in str(info.value)


def test_ulysses_size_halves_the_data_parallel_ranks():
    config = load_config(MINIMAL, [f"{KEY}=2"])
    check_before_launch(config, files=False)
    parallel = plan_placement(config).roles["actor_train"].parallel
    assert (parallel.dp, parallel.sp) == (1, 2) and "SP=2 (Ulysses)" in parallel.describe()


@pytest.mark.parametrize(
    "value, words",
    [
        ("0", "must be >= 1, got 0"),
        ("3", "3 does not divide the role's 2 devices"),
        ("two", "expected"),
    ],
)
def test_bad_ulysses_sizes_are_one_error_naming_the_key(value, words):
    refused([f"{KEY}={value}"], words)


def test_heads_must_split_over_the_group_and_kv_heads_replicate_by_whole_factors():
    config = tiny_qwen2_config()  # 4 attention heads, 2 KV heads
    for size in (1, 2, 4):  # 4: each KV head replicated twice
        check_heads(config, size, KEY)
    with pytest.raises(ConfigError, match="3 does not divide the model's 4 attention heads") as info:
        check_heads(config, 3, KEY)
    assert info.value.path == KEY
    config.num_attention_heads, config.num_key_value_heads = 12, 3
    check_heads(config, 6, KEY)  # 3 KV heads, each replicated twice
    config.num_key_value_heads = 4
    with pytest.raises(ConfigError, match="6 neither divides the model's 4 KV heads"):
        check_heads(config, 6, KEY)


def test_the_pre_launch_check_reads_the_heads_from_config_json(tmp_path):
    tiny_qwen2_config().to_json_file(tmp_path / "config.json")  # 4 heads, 2 KV heads
    for size, ok in ((2, True), (4, True), (3, False)):  # 6 devices: every size divides them
        config = load_config(
            MINIMAL,
            [
                f"pretrain={tmp_path}",
                "actor_train.device_mapping=0-5",
                "num_gpus_per_node=6",
                f"{KEY}={size}",
            ],
        )
        if ok:
            check_ulysses_layout("actor_train", config.actor_train)
            continue
        with pytest.raises(ConfigError, match="3 does not divide the model's 4 attention heads") as info:
            check_ulysses_layout("actor_train", config.actor_train)
        assert info.value.path == KEY


# ----------------------------------------------------------------------------- planner


def test_ulysses_divides_the_activations_and_logits_of_a_rank():
    shape = shape_from_config(preset_config("qwen2.5-7b").to_dict())
    for recompute in (True, False):
        one = fsdp2_train(shape, 8, 2, 8192, recompute, sharded=True, mixed=True)
        four = fsdp2_train(shape, 8, 2, 8192, recompute, sharded=True, mixed=True, ulysses=4)
        assert four["activations"] == one["activations"] // 4
        assert four["logits"] < one["logits"] // 3
        assert {k: four[k] for k in ("params", "grads", "optimizer")} == {
            k: one[k] for k in ("params", "grads", "optimizer")
        }


def test_the_actor_train_prediction_reads_ulysses_size():
    shape = shape_from_config(preset_config("qwen2.5-7b").to_dict())

    def predict(overrides: list[str]) -> dict[str, int]:
        config = load_config(MINIMAL, overrides)
        plan = plan_placement(config).roles["actor_train"]
        return role_memory("actor_train", config.actor_train, config, plan, shape, None, True).parts

    plain, split = predict([]), predict([f"{KEY}=2"])
    assert split["activations"] == plain["activations"] // 2


# ---------------------------------------------------------------------- alibaba/ROLL keys


def _roll_file(train: str, ulysses: int | None, reference: str = "fsdp2_infer") -> dict:
    return {
        "actor_train": {"model_args": {"ulysses_size": ulysses}, "strategy_args": {"strategy_name": train}},
        "reference": {"model_args": {"ulysses_size": ulysses}, "strategy_args": {"strategy_name": reference}},
        "rewards": {"math": {"worker_cls": "x.MathRuleRewardWorker"}},
    }


def test_roll_ulysses_size_on_fsdp2_roles_maps_onto_strategy_config(capsys):
    raw = translate_roll_keys(_roll_file("fsdp2_train", 2))
    for role in ("actor_train", "reference"):  # fsdp2_infer is fsdp2_train in roll
        assert raw[role]["model_args"] == {}
        assert raw[role]["strategy_args"]["strategy_config"] == {"ulysses_size": 2}
    assert (
        "actor_train.model_args.ulysses_size: 2 -> strategy_config.ulysses_size: 2" in capsys.readouterr().err
    )


def test_roll_ulysses_size_loads_into_the_typed_option(tmp_path):
    text = MINIMAL.read_text().replace(
        'model_args: {model_name_or_path: "${pretrain}", dtype: fp32}\n  training_args',
        'model_args: {model_name_or_path: "${pretrain}", dtype: fp32, ulysses_size: 2}\n  training_args',
    )
    assert "ulysses_size: 2" in text
    path = tmp_path / "roll_style.yaml"
    path.write_text(text)
    assert load_config(path).actor_train.strategy_args.strategy_config.ulysses_size == 2


def test_roll_ulysses_size_of_one_is_dropped_and_on_megatron_refused():
    raw = translate_roll_keys(_roll_file("megatron_train", 1, reference="megatron_infer"))
    assert (
        raw["actor_train"]["model_args"] == {}
        and "strategy_config" not in raw["actor_train"]["strategy_args"]
    )
    with pytest.raises(ConfigError, match="context_parallel_size") as info:
        translate_roll_keys(_roll_file("megatron_train", 2, reference="megatron_infer"))
    message = str(info.value)
    assert (
        "actor_train.model_args.ulysses_size=2" in message
        and "reference.model_args.ulysses_size=2" in message
    )
