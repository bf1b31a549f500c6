"""The strategy table (roll.configs.strategies): one row per strategy that every reader uses, and
``StrategyArgs.strategy_config`` always the row's options object."""

from __future__ import annotations

import dataclasses

import pytest

from roll.configs.errors import ConfigError
from roll.configs.role import StrategyArgs
from roll.configs.strategies import STRATEGIES, get_strategy_spec
from roll.configs.strategy_configs import FSDP2Config, HFInferConfig, MegatronConfig, VLLMConfig
from roll.distributed.strategy import base
from roll.planner.roles import MEMORY_MODELS


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_row_names_what_its_readers_look_up(name):
    spec = STRATEGIES[name]
    assert spec.name == name
    assert dataclasses.is_dataclass(spec.options)
    assert spec.memory_model in MEMORY_MODELS
    assert all(getattr(base, protocol) in base.OPTIONAL_PROTOCOLS for protocol in spec.protocols)
    assert spec.roll_compat is None or callable(spec.roll_compat)
    module, _, cls = spec.target.partition(":")
    assert module.startswith("roll.distributed.strategy.") and cls


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        get_strategy_spec("vlm", "actor_infer.strategy_args.strategy_name")
    assert info.value.path == "actor_infer.strategy_args.strategy_name"
    assert "unknown strategy 'vlm' (did you mean 'vllm'?)" in info.value.message
    assert ", ".join(sorted(STRATEGIES)) in info.value.message


def test_strategy_config_is_the_options_object_once_built():
    assert StrategyArgs("fsdp2_train", {"sharding": "no_shard"}).strategy_config == FSDP2Config(
        sharding="no_shard"
    )
    assert StrategyArgs("hf_infer").strategy_config == HFInferConfig()
    vllm = VLLMConfig(tensor_parallel_size=2)
    assert StrategyArgs("vllm", vllm).strategy_config is vllm
    # megatron_train and megatron_infer share their options class
    assert isinstance(StrategyArgs("megatron_infer", MegatronConfig()).strategy_config, MegatronConfig)


def test_strategy_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"^strategy_config\.bogus: unknown key"):
        StrategyArgs("vllm", {"bogus": 1})
    with pytest.raises(ConfigError, match=r"^strategy_config: strategy 'vllm' takes VLLMConfig options"):
        StrategyArgs("vllm", FSDP2Config())
    with pytest.raises(ConfigError, match=r"^strategy_name: unknown strategy 'nope'"):
        StrategyArgs("nope")
