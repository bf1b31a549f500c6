"""Reward functions by name: ``rewards.<role>.reward_fn`` in the YAML picks one.

Rule rewards are plain functions ``fn(response: str, ground_truth: str, **reward_kwargs) -> float``
that run on CPU workers; one with a ``context`` keyword also gets the row's ``reward_context`` (a
dict from the data row, e.g. a detection row's options and image size; None where the row has none). Model rewards (``kind="model"``) score with the role's own inference
strategy (an LLM judge on hf_infer/vLLM/SGLang) and need ``strategy_args`` and ``device_mapping``.

To add one: write the function in a module of your own and add an entry here, e.g.
``"my_reward": RewardSpec("my_reward", "my_pkg.my_module:score", "rule")``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from roll.configs.errors import table_entry


@dataclass(frozen=True)
class RewardSpec:
    name: str
    target: str  # "module:function"
    kind: Literal["rule", "model"] = "rule"
    # Model rewards: "module:NAME" of the dict whose keys are the accepted ``reward_kwargs`` (rule
    # rewards take their function's keyword parameters).
    options: str | None = None
    # "module:function" ``(reward_kwargs, key_path)`` run before launch to check what the options
    # need of this machine (raises one ConfigError); None: nothing beyond the option names.
    check: str | None = None


_R = "roll.pipeline.rewards"
REWARD_FUNCTIONS: dict[str, RewardSpec] = {
    spec.name: spec
    for spec in (
        RewardSpec("math_rule", f"{_R}.math_rule:math_rule_reward"),
        RewardSpec("format", f"{_R}.format_reward:format_reward"),
        RewardSpec("llm_judge", f"{_R}.llm_judge:llm_judge_reward", "model", f"{_R}.llm_judge:JUDGE_KWARGS"),
        RewardSpec(
            "code_sandbox",
            f"{_R}.code_sandbox:code_sandbox_reward",
            check=f"{_R}.code_sandbox:check_code_sandbox_kwargs",
        ),
        RewardSpec("ifeval", f"{_R}.ifeval:ifeval_reward"),
        RewardSpec("multiple_choice", f"{_R}.multiple_choice:multiple_choice_reward"),
        RewardSpec("detection", f"{_R}.detection:detection_reward"),
        RewardSpec("video_r1", f"{_R}.video_r1:video_r1_reward"),
    )
}


def get_reward_spec(name: str, path: str = "reward_fn") -> RewardSpec:
    return table_entry(REWARD_FUNCTIONS, name, path, "reward")


def check_reward_machine(name: str, reward_kwargs: dict, path: str) -> None:
    """Run the reward's own pre-launch ``check`` (if any) on its ``reward_kwargs`` at key ``path``."""
    spec = REWARD_FUNCTIONS.get(name)
    if spec is not None and spec.check is not None:
        module_name, fn_name = spec.check.split(":")
        getattr(importlib.import_module(module_name), fn_name)(reward_kwargs, path)


def load_reward_fn(name: str) -> Callable[..., float]:
    module_name, fn_name = get_reward_spec(name).target.split(":")
    return getattr(importlib.import_module(module_name), fn_name)
