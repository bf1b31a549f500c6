"""``strategy_config.ep_size`` / ``efsdp_size`` of fsdp2_train (expert parallelism) in configs: ranges
and the checks that name them, the placement plan, the model checks (before launch and at model
load), the memory planner's share of the experts, and alibaba/ROLL's keys."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from test_fsdp2_expert_parallel import tiny_moe_config
from test_fsdp2_hsdp_config import EIGHT, MINIMAL
from test_fsdp2_strategy import make_strategy
from tiny_models import build_tiny_model_dir, save_random_model

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.configs.roll_compat import translate_roll_keys
from roll.distributed.scheduler.placement import plan_placement
from roll.launch.checks import check_before_launch
from roll.launch.files import check_expert_layout
from roll.models.random_checkpoint import preset_config
from roll.planner.model_shape import shape_from_config
from roll.planner.roles import role_memory

CONFIG = "actor_train.strategy_args.strategy_config"
KEY = f"{CONFIG}.ep_size"


def refused(overrides: list[str], words: str, key: str = KEY) -> None:
    with pytest.raises(ConfigError) as info:
        check_before_launch(load_config(MINIMAL, overrides), files=False)
    assert info.value.path == key and words in info.value.message, str(info.value)
    assert "\n" not in str(info.value)


def test_expert_groups_show_in_the_plan_and_default_to_off():
    config = load_config(MINIMAL, [*EIGHT, f"{KEY}=4", f"{CONFIG}.ulysses_size=2"])
    check_before_launch(config, files=False)
    parallel = plan_placement(config).roles["actor_train"].parallel
    assert (parallel.ep, parallel.dp, parallel.sp) == (4, 4, 2)
    assert "EP=4 DP=4 SP=2 (Ulysses)" in parallel.describe()
    options = load_config(MINIMAL).actor_train.strategy_args.strategy_config
    assert (options.ep_size, options.efsdp_size) == (1, None)
    assert (
        load_config(MINIMAL, [*EIGHT, f"{KEY}=4"]).actor_train.strategy_args.strategy_config.expert_fsdp_size(
            8
        )
        == 2
    )


@pytest.mark.parametrize(
    "overrides, words, key",
    [
        ([f"{KEY}=0"], "must be >= 1, got 0", KEY),
        ([f"{KEY}=3"], "3 does not divide the role's 2 devices into expert-parallel groups", KEY),
        (
            [*EIGHT, f"{KEY}=2", f"{CONFIG}.efsdp_size=2"],
            "2 x ep_size 2 must equal the role's 8 devices",
            f"{CONFIG}.efsdp_size",
        ),
        ([f"{CONFIG}.efsdp_size=1"], "1 needs ep_size > 1", f"{CONFIG}.efsdp_size"),
    ],
)
def test_bad_expert_layouts_are_one_error_naming_the_key(overrides, words, key):
    refused(overrides, words, key)


@pytest.mark.parametrize(
    "override, clash",
    [
        (f"{CONFIG}.fsdp_size=1", "fsdp_size"),
        (f"{CONFIG}.sharding=no_shard", "sharding"),
        (f"{CONFIG}.cpu_offload=true", "cpu_offload"),
    ],
)
def test_layouts_expert_parallelism_does_not_run_with_are_refused(override, clash):
    with pytest.raises(ConfigError) as info:
        load_config(MINIMAL, [f"{KEY}=2", override])
    assert "ep_size: 2 runs only with sharding: full_shard" in str(info.value)
    assert f"change {clash} or set ep_size: 1" in str(info.value) and "\n" not in str(info.value)


def test_the_model_is_checked_before_launch(tmp_path):
    dense = build_tiny_model_dir(tmp_path / "dense")
    moe = save_random_model(tiny_moe_config(), tmp_path / "moe")
    for model, ep, words in (
        (dense, 2, "this model is dense"),
        (moe, 8, "8 does not divide the model's 4 experts"),
    ):
        config = load_config(
            MINIMAL,
            [f"pretrain={model}", "num_gpus_per_node=8", "actor_train.device_mapping=0-7", f"{KEY}={ep}"],
        )
        with pytest.raises(ConfigError) as info:
            check_expert_layout("actor_train", config.actor_train)
        assert info.value.path == KEY and words in info.value.message
    fits = load_config(MINIMAL, [f"pretrain={moe}", f"{KEY}=2"])
    check_expert_layout("actor_train", fits.actor_train)


@pytest.mark.parametrize(
    "dense, ep, words",
    [(True, 2, "this model is dense"), (False, 3, "3 does not divide the model's 4 experts")],
)
def test_the_worker_refuses_a_model_ep_size_does_not_fit(tmp_path, dense, ep, words):
    model = build_tiny_model_dir(tmp_path) if dense else save_random_model(tiny_moe_config(), tmp_path)
    owns_group = not dist.is_initialized()
    try:
        with pytest.raises(ConfigError) as info:
            make_strategy(model, 0, 1, ep_size=ep)
        assert (
            info.value.path == KEY.replace(CONFIG, "actor_train.strategy_args.strategy_config")
            and words in info.value.message
        )
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- planner


def predict(overrides: list[str]) -> dict[str, int]:
    shape = shape_from_config(preset_config("qwen3-30b-a3b").to_dict())
    config = load_config(MINIMAL, [*EIGHT, *overrides])
    plan = plan_placement(config).roles["actor_train"]
    return role_memory("actor_train", config.actor_train, config, plan, shape, None, True).parts


def test_a_rank_gathers_one_ep_th_of_each_layers_experts():
    """Sharded state: 1/8 of everything either way (efsdp 1 x ep 8, or FSDP over 8); the two
    gathered (fp32 here) layers hold 1/8 of their experts."""
    shape = shape_from_config(preset_config("qwen3-30b-a3b").to_dict())
    plain, ep = predict([]), predict([f"{KEY}=8"])
    for key in ("grads", "optimizer"):
        assert abs(plain[key] - ep[key]) <= 64, key
    layer_experts = shape.expert_params() // shape.layers
    assert plain["params"] - ep["params"] == pytest.approx(2 * 4 * layer_experts * 7 / 8, rel=1e-6)  # fp32


# ---------------------------------------------------------------------- alibaba/ROLL keys


def _roll_file(config: dict) -> dict:
    role = {
        "worker_cls": "roll.pipeline.base_worker.ActorWorker",
        "strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": config},
        "device_mapping": "list(range(0,8))",
    }
    return {"actor_train": role}


@pytest.mark.parametrize(
    "config, mapped",
    [
        ({"ep_size": 8, "efsdp_size": 1}, {"ep_size": 8, "efsdp_size": 1}),
        ({"ep_size": 4}, {"ep_size": 4}),
        ({"ep_size": 1, "efsdp_size": -1}, {}),
        ({"ep_size": -1}, {}),
        ({"efsdp_size": 4}, {}),  # no expert parallelism: nothing to shard
    ],
)
def test_roll_expert_keys_are_roll_keys(config, mapped):
    assert (
        translate_roll_keys(_roll_file(config))["actor_train"]["strategy_args"]["strategy_config"] == mapped
    )
