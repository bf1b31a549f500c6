"""``strategy_config.fsdp_size`` of fsdp2_train (HSDP) in configs: its range and the checks that name
it, the placement plan, the memory planner's share of the training state, and alibaba/ROLL's
``fsdp_size``."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.configs.roll_compat import translate_roll_keys
from roll.distributed.scheduler.placement import plan_placement
from roll.launch.checks import check_before_launch
from roll.models.random_checkpoint import preset_config
from roll.planner.model_shape import shape_from_config
from roll.planner.roles import role_memory

MINIMAL = Path(__file__).resolve().parent / "configs" / "good" / "minimal.yaml"
KEY = "actor_train.strategy_args.strategy_config.fsdp_size"
# The minimal file's actor_train on 8 devices: 8 samples per step in mini-batches of 1 x 1 x 8.
EIGHT = [
    "num_gpus_per_node=8",
    "actor_train.device_mapping=0-7",
    "actor_train.training_args.per_device_train_batch_size=1",
    "actor_train.training_args.gradient_accumulation_steps=1",
]


def refused(overrides: list[str], words: str, key: str = KEY) -> None:
    with pytest.raises(ConfigError) as info:
        check_before_launch(load_config(MINIMAL, overrides), files=False)
    assert info.value.path == key and words in info.value.message, str(info.value)
    assert "\n" not in str(info.value)


def test_shard_groups_keep_the_data_parallel_size_and_show_in_the_plan():
    config = load_config(
        MINIMAL, [*EIGHT, f"{KEY}=2", "actor_train.strategy_args.strategy_config.ulysses_size=2"]
    )
    check_before_launch(config, files=False)
    parallel = plan_placement(config).roles["actor_train"].parallel
    assert (parallel.dp, parallel.sp, parallel.fsdp) == (4, 2, 2)
    assert parallel.describe().endswith("SP=2 (Ulysses) FSDP=2 (HSDP)")
    whole = load_config(MINIMAL, [*EIGHT, f"{KEY}=8"])  # one group of every rank: plain FSDP
    assert plan_placement(whole).roles["actor_train"].parallel.fsdp is None
    assert load_config(MINIMAL).actor_train.strategy_args.strategy_config.fsdp_size is None


@pytest.mark.parametrize(
    "value, words",
    [
        ("0", "must be >= 1, got 0"),
        ("3", "3 does not divide the role's 2 devices into shard groups"),
        ("4", "4 does not divide the role's 2 devices"),
        ("two", "expected"),
    ],
)
def test_bad_fsdp_sizes_are_one_error_naming_the_key(value, words):
    refused([f"{KEY}={value}"], words)


def test_shard_groups_conflict_with_no_shard():
    refused(
        [f"{KEY}=2", "actor_train.strategy_args.strategy_config.sharding=no_shard"],
        "2 shards over groups of ranks but sharding is no_shard",
    )
    replicas = load_config(
        MINIMAL, [f"{KEY}=1", "actor_train.strategy_args.strategy_config.sharding=no_shard"]
    )
    assert replicas.actor_train.strategy_args.strategy_config.shard_size(2) == 1


# ----------------------------------------------------------------------------- planner


def predict(overrides: list[str]) -> dict[str, int]:
    shape = shape_from_config(preset_config("qwen2.5-7b").to_dict())
    config = load_config(MINIMAL, overrides)
    plan = plan_placement(config).roles["actor_train"]
    return role_memory("actor_train", config.actor_train, config, plan, shape, None, True).parts


def test_the_training_state_divides_by_the_shard_group_not_the_world():
    state = ("params", "grads", "optimizer")
    eight, groups_of_two, two = predict(EIGHT), predict([*EIGHT, f"{KEY}=2"]), predict([])
    assert {k: groups_of_two[k] for k in state} == {k: two[k] for k in state}
    assert groups_of_two["optimizer"] == 4 * eight["optimizer"]
    assert groups_of_two["grads"] == 4 * eight["grads"]
    replicas = predict([*EIGHT, f"{KEY}=1"])  # fsdp_size 1 is no_shard: full replicas
    no_shard = predict([*EIGHT, "actor_train.strategy_args.strategy_config.sharding=no_shard"])
    assert {k: replicas[k] for k in state} == {k: no_shard[k] for k in state}
    assert replicas["optimizer"] == 8 * eight["optimizer"]


# ---------------------------------------------------------------------- alibaba/ROLL keys


def _roll_file(fsdp_size: int, worker_cls: bool = True) -> dict:
    """A ROLL file (its roles carry ``worker_cls``) or, without, roll's own."""
    role = {
        "strategy_args": {"strategy_name": "fsdp2_infer", "strategy_config": {"fsdp_size": fsdp_size}},
        "device_mapping": "list(range(0,8))",
    }
    if worker_cls:
        role["worker_cls"] = "roll.pipeline.base_worker.ActorWorker"
    return {"reference": role}


@pytest.mark.parametrize(
    "size, mapped",
    [(4, {"fsdp_size": 4}), (1, {}), (-1, {}), (8, {}), (16, {})],
)
def test_roll_fsdp_size_below_the_devices_is_hsdp_else_all_devices(size, mapped, capsys):
    """ROLL: fsdp_size <= 1 or >= the world size shards over every device (roll's null)."""
    config = translate_roll_keys(_roll_file(size))["reference"]["strategy_args"]["strategy_config"]
    assert config == mapped
    if not mapped:
        assert f"reference.strategy_args.strategy_config.fsdp_size: {size} -> null" in capsys.readouterr().err


def test_fsdp_size_in_roll_own_files_is_kept_as_written():
    for size in (1, 8):  # 1: full replicas; 8 on 8 devices: one shard group, like null
        raw = translate_roll_keys(_roll_file(size, worker_cls=False))
        assert raw["reference"]["strategy_args"]["strategy_config"] == {"fsdp_size": size}


def test_roll_fsdp_size_loads_into_the_typed_option_and_a_bad_one_names_the_key(tmp_path):
    text = MINIMAL.read_text().replace(
        "strategy_args: {strategy_name: fsdp2_train}",
        "strategy_args: {strategy_name: fsdp2_train, strategy_config: {fsdp_size: 1, param_dtype: fp32}}\n"
        "  worker_cls: roll.pipeline.base_worker.ActorWorker",
    )
    assert "fsdp_size: 1" in text
    path = tmp_path / "roll_style.yaml"
    path.write_text(text)
    assert load_config(path).actor_train.strategy_args.strategy_config.fsdp_size is None  # ROLL's 1
    path.write_text(
        text.replace('device_mapping: "0-1"', 'device_mapping: "0-2"').replace("fsdp_size: 1", "fsdp_size: 2")
    )
    with pytest.raises(ConfigError) as info:
        check_before_launch(load_config(path, ["num_gpus_per_node=3"]), files=False)
    assert info.value.path == KEY and "2 does not divide the role's 3 devices" in info.value.message
