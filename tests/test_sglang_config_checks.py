"""Bad SGLang input is one ``ConfigError`` line from the launcher before any worker starts: SGLang
missing where the workers start or of a version roll does not run on, a memory fraction that leaves
no room for a colocated trainer, memory saver off on a trainer's devices, TP that does not divide
the role's devices. Runs the real launcher (``roll.launch.rlvr.main``) on the SGLang drafts of
``examples/config`` pointed at files made here; no engine is installed on CPU."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest
import yaml
from launch_files import point_at_files

from roll.launch import rlvr
from roll.launch.rlvr import main

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples/config"
COLOCATED = "rlvr_megatron_sglang_2gpus"
INFER_CFG = "actor_infer.strategy_args.strategy_config"


@pytest.fixture
def no_worker_starts(monkeypatch):
    """A launch that gets past the checks fails the test instead of starting Ray."""

    def started(config):
        raise AssertionError("the launch started the run")

    monkeypatch.setattr(rlvr, "run", started)


@pytest.fixture
def sglang_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # find_spec -> None, import -> ImportError


def write_config(tmp_path: Path, name: str = COLOCATED, qwen_shape: bool = False) -> Path:
    """The draft with its model and prompt files made under ``tmp_path``; ``qwen_shape`` gives the
    model directory Qwen2.5-1.5B's config.json so the memory planner can predict the roles."""
    raw = point_at_files(yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text()), tmp_path)
    if qwen_shape:
        from roll.models.random_checkpoint import preset_config

        preset_config("qwen2.5-1.5b", None).save_pretrained(raw["pretrain"])
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path


def launch(tmp_path: Path, *overrides: str, name: str = COLOCATED, dry_run: bool = False) -> int:
    argv = ["--config_name", name, "--config_path", str(tmp_path), *overrides]
    return main(argv + ["--dry_run"] if dry_run else argv)


def one_config_error(capsys, key: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ConfigError: {key}: "), err
    return err[0]


def test_sglang_missing_stops_a_launch_and_the_dry_run_names_it(
    tmp_path, capsys, monkeypatch, sglang_absent, no_worker_starts
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    write_config(tmp_path)
    assert launch(tmp_path) == 2
    line = one_config_error(capsys, "actor_infer.strategy_args.strategy_name")
    assert "'sglang' package" in line and "pip install -e .[sglang]" in line
    # --dry_run plans without the engine (a laptop planning a GPU run) and says what a launch would do
    assert launch(tmp_path, dry_run=True) == 0
    out = capsys.readouterr().out
    assert "Placement plan" in out
    assert (
        "missing engine: actor_infer.strategy_args.strategy_name: strategy 'sglang' needs the 'sglang'" in out
    )
    assert "a one-node launch from here stops on this" in out


def test_sglang_missing_on_the_driver_of_another_cluster_is_left_to_its_workers(
    tmp_path, monkeypatch, sglang_absent
):
    from roll.configs.loader import load_config
    from roll.launch.checks import check_before_launch
    from roll.launch.roles import check_engines_installed, engines_missing_here

    config = load_config(write_config(tmp_path) / f"{COLOCATED}.yaml")
    plan = check_before_launch(config)
    assert [e.path for e in engines_missing_here(config)] == ["actor_infer.strategy_args.strategy_name"]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    check_engines_installed(config, plan)  # the engines live on that cluster's nodes


@pytest.mark.parametrize(
    "installed, ok",
    [("0.5.16", True), ("0.5.17.post2", True), ("0.5.15", False), ("0.4.10", False), ("0.6.0", False)],
)
def test_sglang_version_outside_the_tested_range_is_one_line(
    tmp_path, capsys, monkeypatch, installed, ok, no_worker_starts
):
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: installed if name == "sglang" else real(name)
    )
    write_config(tmp_path)
    code = launch(tmp_path, dry_run=True)
    if ok:
        assert code == 0, capsys.readouterr().err
        return
    assert code == 2
    line = one_config_error(capsys, "actor_infer.strategy_args.strategy_name")
    assert f"but {installed} is installed" in line and ">=0.5.16,<0.6" in line
    assert "pip install -e .[sglang]" in line


def test_memory_fraction_that_leaves_no_room_for_the_colocated_trainer(tmp_path, capsys):
    write_config(tmp_path, qwen_shape=True)
    # the shipped 0.3 fits next to the trainer on an H100
    assert launch(tmp_path, "gpu=H100", dry_run=True) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert launch(tmp_path, "gpu=H100", f"{INFER_CFG}.mem_fraction_static=0.9", dry_run=True) == 2
    line = one_config_error(capsys, f"{INFER_CFG}.mem_fraction_static")
    assert "is 0.9 of the 79.2 GiB device (gpu H100)" in line
    assert "actor_train " in line and "GiB predicted by the memory planner" in line
    fits = float(line.split("at most ")[1].split(" fits")[0])
    assert 0.3 < fits < 0.9
    # what the message says fits does fit
    capsys.readouterr()
    assert launch(tmp_path, "gpu=H100", f"{INFER_CFG}.mem_fraction_static={fits}", dry_run=True) == 0
    # a device too small for the trainer's resident state leaves nothing to turn but the layout
    capsys.readouterr()
    assert launch(tmp_path, "device_memory_gib=12", dry_run=True) == 2
    line = one_config_error(capsys, f"{INFER_CFG}.mem_fraction_static")
    assert "none fits; offload actor_train's state or give actor_infer devices of its own" in line


def test_memory_fraction_is_free_on_devices_of_its_own(tmp_path, capsys):
    name = f"{COLOCATED}_disagg"
    write_config(tmp_path, name, qwen_shape=True)
    assert launch(tmp_path, "gpu=H100", f"{INFER_CFG}.mem_fraction_static=0.95", name=name, dry_run=True) == 0


def test_memory_saver_off_on_a_trainers_devices_is_one_line(tmp_path, capsys):
    write_config(tmp_path)
    assert launch(tmp_path, f"{INFER_CFG}.enable_memory_saver=false", dry_run=True) == 2
    line = one_config_error(capsys, f"{INFER_CFG}.enable_memory_saver")
    assert "shares devices with actor_train" in line and "release memory" in line


def test_tensor_parallel_size_that_does_not_divide_the_devices_is_one_line(tmp_path, capsys):
    write_config(tmp_path)
    assert launch(tmp_path, f"{INFER_CFG}.tensor_parallel_size=3", dry_run=True) == 2
    line = one_config_error(capsys, f"{INFER_CFG}.tensor_parallel_size")
    assert "3 does not divide the role's 2 devices" in line
