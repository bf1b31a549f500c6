"""The model-update probe's verdicts: corruption (non-finite, weights that differ) is an error,
a numerical train/infer difference a metric and, above the dtype's threshold, a warning; an
error only where ``model_update_probe_tolerance`` is set."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import ModelArgs, RoleConfig
from roll.distributed.model_update import group as group_module
from roll.distributed.model_update.errors import ModelUpdateError
from roll.distributed.model_update.group import ModelUpdateGroup
from roll.distributed.model_update.probe import (
    ProbeVerdict,
    build_probe_batch,
    classify_probe,
    probe_warn_threshold,
)

BF16 = probe_warn_threshold("bf16", "bf16")


def test_thresholds_follow_the_least_precise_dtype():
    assert probe_warn_threshold("fp32", "fp32") == 1e-4
    assert probe_warn_threshold("fp32", "fp16") == 1e-2
    assert probe_warn_threshold("bf16", "fp32") == BF16 == 5e-2


@pytest.mark.parametrize(
    "diff, tolerance, threshold, verdict",
    [
        (0.01062, None, BF16, ProbeVerdict.OK),  # the healthy 2 x H200 Megatron run
        (0.01062, 0.01, BF16, ProbeVerdict.ERROR),  # ... is an error only where the user asks
        (0.2, None, BF16, ProbeVerdict.CHECK),
        (1e-3, None, 1e-4, ProbeVerdict.CHECK),  # the same 1e-3 is unusual in fp32
        (float("nan"), None, BF16, ProbeVerdict.ERROR),
        (float("inf"), 10.0, BF16, ProbeVerdict.ERROR),
    ],
)
def test_classify_probe(diff, tolerance, threshold, verdict):
    assert classify_probe(diff, tolerance, threshold) is verdict


class _FakeRole:
    """Answers ``async_call`` with fixed per-rank outputs (``get_all`` is patched to pass them)."""

    def __init__(self, role: str, outputs: list):
        self.role = role
        self.outputs = outputs

    def async_call(self, method, *args):
        return self.outputs


def _group(monkeypatch, diff: float, tolerance: float | None, differs: bool | None) -> ModelUpdateGroup:
    config = RLVRConfig(
        actor_train=RoleConfig(model_args=ModelArgs(dtype="bf16")),
        actor_infer=RoleConfig(model_args=ModelArgs(dtype="bf16")),
        model_update_probe_tolerance=tolerance,
    )
    batch = build_probe_batch(vocab_size=50, size=2, seed=0)
    trainer = torch.zeros(2, 16)
    group = ModelUpdateGroup(
        _FakeRole("actor_train", [trainer, None]),
        _FakeRole("actor_infer", [trainer, trainer + diff]),
        config,
        probe_batch=batch,
    )
    monkeypatch.setattr(group_module, "get_all", lambda *results: list(results))
    where = "first mismatching tensor: 'w'" if differs else "every engine holds exactly the tensors"
    monkeypatch.setattr(group, "locate_mismatch", lambda version: (differs, where))
    return group


def test_bf16_difference_below_threshold_is_a_metric_only(monkeypatch, caplog):
    group = _group(monkeypatch, 0.01062, None, differs=False)
    with caplog.at_level(logging.WARNING, logger="roll"):
        metrics = group.probe(version=1)
    assert metrics["model_update/probe_logprob_diff"] == pytest.approx(0.01062)
    assert metrics["model_update/probe_above_threshold"] == 0.0
    assert not caplog.records


def test_difference_above_threshold_with_equal_weights_is_a_warning(monkeypatch, caplog):
    group = _group(monkeypatch, 0.2, None, differs=False)
    with caplog.at_level(logging.WARNING, logger="roll"):
        metrics = group.probe(version=3)
    assert metrics["model_update/probe_above_threshold"] == 1.0
    [record] = caplog.records
    assert "above the warning threshold 0.05" in record.getMessage()
    assert "actor_infer rank 1" in record.getMessage()


def test_difference_above_threshold_with_unequal_weights_is_an_error(monkeypatch):
    group = _group(monkeypatch, 0.2, None, differs=True)
    with pytest.raises(ModelUpdateError, match="above the warning threshold.*first mismatching tensor: 'w'"):
        group.probe(version=3)


def test_explicit_tolerance_makes_a_difference_an_error(monkeypatch):
    group = _group(monkeypatch, 0.01062, 0.01, differs=False)
    with pytest.raises(ModelUpdateError, match="0.01062 .* exceeds model_update_probe_tolerance=0.01"):
        group.probe(version=1)


def test_non_finite_is_an_error_whatever_the_tolerance(monkeypatch):
    group = _group(monkeypatch, float("nan"), None, differs=None)
    with pytest.raises(ModelUpdateError, match="probe log-probs are not finite on actor_infer ranks \\[1\\]"):
        group.probe(version=1)


def test_shipped_bf16_megatron_example_warns_instead_of_failing():
    config = load_config("examples/config/rlvr_megatron_2gpus.yaml")
    assert config.model_update_probe_tolerance is None
    threshold = probe_warn_threshold(config.actor_train.model_args.dtype, config.actor_infer.model_args.dtype)
    assert classify_probe(0.01062, config.model_update_probe_tolerance, threshold) is ProbeVerdict.OK


@pytest.mark.parametrize("value", [0, -1, math.inf])
def test_tolerance_must_be_positive(tmp_path, value):
    with pytest.raises(ConfigError, match=r"^model_update_probe_tolerance: must be (a finite number \()?> 0"):
        load_config("examples/config/rlvr_config.yaml", [f"model_update_probe_tolerance={value}"])
