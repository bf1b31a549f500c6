"""RunConfig: the run-level keys RLVR and SFT configs share are declared once and checked alike."""

from __future__ import annotations

import dataclasses

import pytest

from roll.configs.build import build_dataclass
from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.run_config import RunConfig
from roll.configs.sft_config import SFTPipelineConfig

PIPELINES = [RLVRConfig, SFTPipelineConfig]
ROLE = {"model_args": {"model_name_or_path": "m"}}


def minimal(cls: type) -> dict:
    return {"actor_train": ROLE, "actor_infer": ROLE} if cls is RLVRConfig else {"actor_train": ROLE}


@pytest.mark.parametrize("cls", PIPELINES)
def test_run_level_keys_are_declared_once_in_run_config(cls):
    assert issubclass(cls, RunConfig)
    shared = {f.name for f in dataclasses.fields(RunConfig)}
    own = set(cls.__annotations__)
    assert own & shared == {"exp_name"}  # only the default run name differs per pipeline
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for base in dataclasses.fields(RunConfig):
        if base.name != "exp_name":
            assert fields[base.name] is base


def test_each_pipeline_names_its_runs():
    assert build_dataclass(RLVRConfig, minimal(RLVRConfig)).exp_name == "rlvr"
    assert build_dataclass(SFTPipelineConfig, minimal(SFTPipelineConfig)).exp_name == "sft"


@pytest.mark.parametrize("cls", PIPELINES)
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("seed", -1, "seed: must be in \\[0, 4294967295\\], got -1"),
        ("max_steps", 0, "max_steps: must be >= 1, got 0"),
        ("checkpoint_config", {"max_to_keep": 0}, "checkpoint_config.max_to_keep: must be >= 1, got 0"),
    ],
)
def test_a_shared_key_out_of_range_is_the_same_error_in_both(cls, key, value, message):
    with pytest.raises(ConfigError, match=message):
        build_dataclass(cls, minimal(cls) | {key: value})


@pytest.mark.parametrize("cls", PIPELINES)
def test_the_trainer_role_is_required(cls):
    data = minimal(cls)
    del data["actor_train"]
    with pytest.raises(ConfigError, match="actor_train: is required"):
        build_dataclass(cls, data)
