"""Every registry row names what its class implements, and the check holds: strategy classes
against the Protocols of ``roll/distributed/strategy/base.py`` (checked on the class, so vLLM and
SGLang rows are checked without the engines installed), reward functions against the call the
reward worker makes."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import pytest
import torch

from roll.configs import strategies
from roll.configs.strategies import STRATEGIES, StrategySpec
from roll.configs.strategy_configs import HFInferConfig
from roll.distributed.strategy import registry
from roll.distributed.strategy.base import (
    OPTIONAL_PROTOCOLS,
    HFWeightSource,
    InferenceStrategy,
    ModelStrategy,
    TrainStrategy,
    check_protocol,
)
from roll.distributed.strategy.registry import check_strategy_class, required_protocols
from roll.pipeline.rewards.registry import REWARD_FUNCTIONS, load_reward_fn


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_row_implements_its_protocols(name):
    spec = STRATEGIES[name]
    cls = check_strategy_class(name)
    for protocol in required_protocols(spec):
        assert check_protocol(cls, protocol) == [], protocol.__name__
    assert required_protocols(spec)[0] is (TrainStrategy if spec.side == "train" else InferenceStrategy)


def test_every_strategy_has_the_methods_every_worker_calls():
    for name in STRATEGIES:
        assert check_protocol(check_strategy_class(name), ModelStrategy) == [], name


class _Incomplete:
    """A would-be inference strategy without ``generate`` and with a wrong ``load_weights``."""

    def __init__(self, role_config, ctx): ...
    def initialize(self) -> None: ...
    def dp_layout(self) -> tuple[int, int, bool]: ...
    def compute_log_probs(self, batch): ...
    def offload_states(self) -> None: ...
    def reload_states(self) -> None: ...
    def load_weights(self, tensors, strict) -> None: ...
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def test_a_row_whose_class_does_not_conform_is_refused(monkeypatch):
    bad = StrategySpec("bad", HFInferConfig, f"{__name__}:_Incomplete", "infer", "hf_inference")
    monkeypatch.setattr(strategies, "STRATEGIES", {"bad": bad})
    registry.check_strategy_class.cache_clear()
    try:
        with pytest.raises(TypeError) as info:
            check_strategy_class("bad")
    finally:
        registry.check_strategy_class.cache_clear()
    message = str(info.value)
    assert message.startswith(f"strategy 'bad' ({__name__}:_Incomplete): ")
    assert "InferenceStrategy.generate() is missing" in message
    assert (
        "InferenceStrategy.load_weights(): parameters ['tensors', 'strict'] do not start with ['named_tensors']"
        in message
    )
    assert "implements ['HFWeightSource'] without declaring them" in message


def test_signatures_may_add_parameters_with_defaults_only():
    class Extra:
        def iter_hf_weights(self, gather: bool = True): ...

    class Required:
        def iter_hf_weights(self, gather): ...

    assert check_protocol(Extra, HFWeightSource) == []
    assert check_protocol(Required, HFWeightSource) == [
        "iter_hf_weights(): extra parameters ['gather'] need defaults"
    ]


def test_optional_protocols_are_runtime_checkable():
    for protocol in OPTIONAL_PROTOCOLS:
        assert isinstance(object(), protocol) is False


@pytest.mark.parametrize("name", sorted(REWARD_FUNCTIONS))
def test_every_reward_row_takes_the_call_the_reward_worker_makes(name):
    """Rule rewards: ``fn(response, ground_truth, **reward_kwargs)`` with keyword-only options that
    have defaults; model rewards: ``fn(strategy, batch, role_config)``."""
    params = list(inspect.signature(load_reward_fn(name)).parameters.values())
    if REWARD_FUNCTIONS[name].kind == "model":
        assert [p.name for p in params] == ["strategy", "batch", "role_config"]
        return
    assert [p.name for p in params[:2]] == ["response", "ground_truth"]
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in params[2:]), params
