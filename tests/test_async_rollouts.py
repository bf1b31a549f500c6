"""Asynchronous generation: step k + 1 is generated while step k trains (a RolloutSource on a fake
run, where the overlap is forced), the colocated-layout and missing-correction errors, and a real
disaggregated CPU pipeline (train on slot 0, infer on slot 1) with weight versions and TIS."""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline_e2e import config_dict, load, pipeline_dir  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.role import GeneratingArgs  # noqa: E402
from roll.configs.rollout_dump import RolloutDumpConfig  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.launch.checks import check_before_launch  # noqa: E402
from roll.pipeline.common.timing import StageTimer  # noqa: E402
from roll.pipeline.rlvr import rollout_source  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from pipeline_dir(tmp_path_factory, "async")


class FakeSampler:
    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}


def fake_run(async_ratio: int, max_steps: int = 3) -> SimpleNamespace:
    args = GeneratingArgs(max_new_tokens=4)
    config = SimpleNamespace(
        async_generation_ratio=async_ratio, max_steps=max_steps, seed=0,
        actor_infer=SimpleNamespace(generating_args=args), rollout_dump=RolloutDumpConfig(),
    )  # fmt: skip
    return SimpleNamespace(config=config, sampler=FakeSampler(), weight_version=0)


def test_next_step_generates_while_this_step_trains(monkeypatch):
    run = fake_run(1)
    training = threading.Event()
    log: list[str] = []

    def collect(run_, step, params, timer):
        run_.sampler.pos += 1
        if step > 1:  # generation of step k + 1 cannot finish unless step k is training meanwhile
            assert training.wait(timeout=30), f"step {step} was not generated during training"
        log.append(f"generated {step} with v{run_.weight_version}")
        return Batch.from_dict({"x": torch.tensor([step])}), {}

    monkeypatch.setattr(rollout_source, "collect_rollouts", collect)
    source = rollout_source.RolloutSource(run)
    try:
        for step in (1, 2, 3):
            batch, _ = source.take(step, StageTimer())
            assert batch["x"].tolist() == [step]
            if step < 3:
                assert source.sampler_state() == {"pos": step}  # before step + 1's prompts
            training.set()  # "train" step k while k + 1 generates
            source.settle()
            training.clear()
            log.append(f"updated to v{step}")
            run.weight_version = step
    finally:
        source.close()
    # staleness 1: step k + 1 was generated with the weights of step k - 1
    assert log == [
        "generated 1 with v0", "generated 2 with v0", "updated to v1",
        "generated 3 with v1", "updated to v2", "updated to v3",
    ]  # fmt: skip


def test_synchronous_source_generates_in_take(monkeypatch):
    run = fake_run(0)
    calls = []
    monkeypatch.setattr(
        rollout_source,
        "collect_rollouts",
        lambda r, s, p, t: calls.append((s, p.seed)) or (Batch.from_dict({}), {}),
    )
    source = rollout_source.RolloutSource(run)
    source.take(1, StageTimer())
    source.settle()
    assert calls == [(1, 1)] and source.pool is None


def test_async_on_colocated_actor_infer_is_a_config_error(setup):
    tmp, model = setup
    cfg = config_dict(tmp, model, tmp / "x", async_generation_ratio=1, off_policy_correction={"mode": "tis"})
    with pytest.raises(ConfigError) as err:
        check_before_launch(load(tmp, "colocated_async", cfg), files=False)
    assert str(err.value).startswith("async_generation_ratio: needs a disaggregated actor_infer")


def disaggregated(tmp: Path, model: Path, out: Path, **overrides) -> dict:
    cfg = config_dict(tmp, model, out, **overrides)
    cfg["actor_train"]["device_mapping"] = "0"
    cfg["actor_train"]["training_args"]["per_device_train_batch_size"] = 2
    cfg["reference"]["device_mapping"] = "0"
    cfg["actor_infer"]["device_mapping"] = "1"
    return cfg


def test_async_without_correction_runs_with_one_warning(setup, capsys):
    # ROLL runs async_generation_ratio uncorrected; roll does too and recommends TIS/MIS once.
    tmp, model = setup
    cfg = disaggregated(tmp, model, tmp / "y", async_generation_ratio=1)
    check_before_launch(load(tmp, "async_no_tis", cfg), files=False)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "tis or mis" in warnings[0] and "rollout/logprob_mismatch" in warnings[0]


@pytest.mark.slow
def test_async_disaggregated_pipeline_on_cpu(setup):
    from roll.pipeline.rlvr.pipeline import run_pipeline

    tmp, model = setup
    cfg = disaggregated(
        tmp, model, tmp / "async", async_generation_ratio=1, save_steps=0,
        off_policy_correction={"mode": "tis", "level": "token", "cap": 2.0},
        dynamic_sampling={"enabled": True, "max_rounds": 2},
    )  # fmt: skip
    config = load(tmp, "async", cfg)
    check_before_launch(config, files=False)
    rows = read_metrics(run_pipeline(config) / "metrics.jsonl")
    steps = {r["step"]: r for r in rows}
    assert sorted(steps) == [0, 1, 2, 3]
    assert [steps[s]["rollout/weight_version"] for s in (1, 2, 3)] == [0, 0, 1]
    assert [steps[s]["rollout/staleness"] for s in (1, 2, 3)] == [0, 1, 1]
    for s in (1, 2, 3):
        row = steps[s]
        for key in ("time/wait_rollouts", "time/generate", "off_policy/ratio_mean", "off_policy/ratio_p95"):
            assert key in row and math.isfinite(row[key]), key
        assert row["dynamic_sampling/groups_drawn"] >= 2
    # Step 2's samples come from the weights before step 1's update: the trainer's ratio moved.
    assert (
        abs(steps[2]["off_policy/ratio_max"] - 1) > 1e-4 or abs(steps[2]["off_policy/ratio_min"] - 1) > 1e-4
    )
    assert abs(steps[1]["off_policy/ratio_max"] - 1) < 1e-3  # step 1 is on policy (same weights)


@pytest.mark.parametrize("name", ["rlvr_config_async"])
def test_shipped_async_configs_dry_run(name, capsys, tmp_path):
    from launch_files import point_at_files

    from roll.launch.rlvr import main

    repo = Path(__file__).resolve().parents[1]
    # Its model and prompt files come from prepare_default_example.py: point them at files made here.
    raw = point_at_files(yaml.safe_load((repo / "examples/config" / f"{name}.yaml").read_text()), tmp_path)
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    assert main(["--config_name", name, "--config_path", str(tmp_path), "--dry_run"]) == 0
    assert "actor_infer" in capsys.readouterr().out
