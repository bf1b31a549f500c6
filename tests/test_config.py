"""Config loading: good files, every bad file in tests/configs/bad gives one ConfigError line."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from launch_files import launch_overrides, make_launch_files, point_at_files

from roll.configs.device_mapping import format_device_ids, parse_device_mapping
from roll.configs.errors import ConfigError
from roll.configs.loader import apply_overrides, interpolate, load_config
from roll.launch.rlvr import main

HERE = Path(__file__).parent / "configs"
GOOD = HERE / "good" / "minimal.yaml"
REPO = Path(__file__).resolve().parents[1]


def deep_merge(base: dict, delta: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in delta.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def write_variant(tmp_path: Path, delta_file: Path) -> Path:
    """A bad file is a delta on top of the minimal good file, so each shows one mistake."""
    text = delta_file.read_text()
    try:
        delta = yaml.safe_load(text)
    except yaml.YAMLError:
        return delta_file  # not YAML at all: load it as it is
    merged = deep_merge(yaml.safe_load(GOOD.read_text()), delta or {})
    out = tmp_path / delta_file.name
    out.write_text(yaml.safe_dump(merged, sort_keys=False))
    return out


# bad file -> (key path the error must name, words the message must contain)
BAD_CASES = {
    "unknown_top_key": ("rollout_batch_sise", "did you mean 'rollout_batch_size'"),
    "unknown_nested_key": ("actor_train.training_args.learning_rat", "did you mean 'learning_rate'"),
    "bad_device_mapping": ("actor_train.device_mapping", "cannot parse"),
    "duplicate_device": ("actor_train.device_mapping", "listed twice"),
    "unknown_strategy": ("actor_train.strategy_args.strategy_name", "did you mean 'megatron_train'"),
    "tp_not_dividing": (
        "actor_train.strategy_args.strategy_config.tensor_model_parallel_size",
        "does not divide",
    ),
    "token_budget_too_small": (
        "actor_train.strategy_args.strategy_config.max_tokens_per_microbatch",
        "prompt_length + response_length = 48",
    ),
    "packing_with_local_attention": (
        "actor_train.strategy_args.strategy_config.sequence_packing",
        "attention_backend: sdpa",
    ),
    "cp_on_generation": (
        "actor_infer.strategy_args.strategy_config.context_parallel_size",
        "generation has no context parallelism",
    ),
    "token_budget_without_packing": (
        "actor_train.strategy_args.strategy_config.infer_max_tokens_per_microbatch",
        "needs sequence_packing",
    ),
    "unknown_strategy_option": (
        "actor_infer.strategy_args.strategy_config.gpu_memory_utilisation",
        "did you mean 'gpu_memory_utilization'",
    ),
    "wrong_type": ("rollout_batch_size", "expected int"),
    "bad_interpolation": ("actor_infer.generating_args.max_new_tokens", "did you mean 'response_length'"),
    "interpolation_cycle": ("exp_name", "cycle"),
    "batch_not_dividing": ("actor_train.training_args.gradient_accumulation_steps", "mini-batches"),
    "device_missing_on_nodes": ("actor_infer.device_mapping", "does not exist"),
    "vllm_colocated_no_sleep": ("actor_infer.strategy_args.strategy_config.sleep_level", "shares devices"),
    "gae_without_critic": ("critic", "needs a critic"),
    "kl_without_reference": ("reference", "need a reference"),
    "bad_reward_fn": ("rewards.math.reward_fn", "did you mean 'math_rule'"),
    "roll_worker_cls": ("rewards.math.worker_cls", "unknown ROLL reward worker"),
    "invalid_yaml": ("invalid_yaml.yaml", "invalid YAML at line"),
    "engine_on_train_role": ("actor_train.strategy_args.strategy_name", "cannot train"),
    "num_return_mismatch": (
        "actor_infer.generating_args.num_return_sequences",
        "num_return_sequences_in_group",
    ),
    "negative_device": ("actor_train.device_mapping", ">= 0"),
    "vllm_tp_split": ("actor_infer.strategy_args.strategy_config.distributed_executor_backend", "span nodes"),
    "full_recompute_no_method": (
        "actor_train.strategy_args.strategy_config.recompute_method",
        "needs recompute_method",
    ),
}


def test_every_bad_file_has_a_case():
    files = {p.stem for p in (HERE / "bad").glob("*.yaml")}
    assert files == set(BAD_CASES)


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_file_gives_one_line_config_error(name, tmp_path, capsys):
    path = write_variant(tmp_path, HERE / "bad" / f"{name}.yaml")
    code = main(["--config_name", path.name, "--config_path", str(path.parent), "--dry_run"])
    err = capsys.readouterr().err.strip().splitlines()
    key, words = BAD_CASES[name]
    assert code == 2
    assert len(err) == 1, err
    assert err[0].startswith(f"ConfigError: {key}") or err[0].startswith("ConfigError: ") and key in err[0], (
        err[0]
    )
    assert words in err[0], err[0]


def test_bad_file_through_the_real_script_exits_2_without_traceback(tmp_path):
    path = write_variant(tmp_path, HERE / "bad" / "unknown_nested_key.yaml")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples/start_rlvr_pipeline.py"),
            "--config_name",
            path.stem,
            "--config_path",
            str(path.parent),
            "--dry_run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("ConfigError: actor_train.training_args.learning_rat")


def test_good_file_loads_with_interpolation_and_types():
    cfg = load_config(GOOD)
    assert cfg.actor_train.model_args.model_name_or_path == "/tmp/model"
    assert cfg.actor_infer.generating_args.max_new_tokens == 16  # ${response_length} keeps int type
    assert cfg.actor_train.training_args.learning_rate == pytest.approx(1e-5)  # "1e-5" read as float
    assert cfg.actor_infer.device_mapping == [0, 1]
    assert type(cfg.actor_train.strategy_args.strategy_config).__name__ == "FSDP2Config"


def test_overrides_apply_before_interpolation_and_validation():
    cfg = load_config(GOOD, ["response_length=8", "actor_train.training_args.learning_rate=0.5", "seed=7"])
    assert cfg.actor_infer.generating_args.max_new_tokens == 8
    assert cfg.actor_train.training_args.learning_rate == 0.5
    assert cfg.seed == 7


def test_override_to_unknown_key_names_it():
    with pytest.raises(ConfigError, match=r"actor_train\.training_args\.lr: unknown key"):
        load_config(GOOD, ["actor_train.training_args.lr=0.1"])


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"seed": 1}, ["seed.x=2"])


def test_embedded_interpolation_becomes_string():
    out = interpolate({"exp_name": "run", "output_dir": "./out/${exp_name}/x", "n": 3, "m": "${n}"})
    assert out["output_dir"] == "./out/run/x"
    assert out["m"] == 3


def test_hydra_block_is_ignored_with_a_notice(tmp_path, capsys):
    data = yaml.safe_load(GOOD.read_text())
    data["hydra"] = {"run": {"dir": "."}}
    path = tmp_path / "with_hydra.yaml"
    path.write_text(yaml.safe_dump(data))
    load_config(path)
    assert "ignoring the 'hydra' block" in capsys.readouterr().err


def test_missing_file_is_a_config_error(tmp_path, capsys):
    assert main(["--config_name", "nope", "--config_path", str(tmp_path), "--dry_run"]) == 2
    assert "config file not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value, expected",
    [
        ([0, 1, 2], [0, 1, 2]),
        ("0-3", [0, 1, 2, 3]),
        ("0-1,4-5", [0, 1, 4, 5]),
        ("list(range(0,8))", list(range(8))),
        ("list(range(0, 16, 4))", [0, 4, 8, 12]),
        ("range(3)", [0, 1, 2]),
        ("5", [5]),
        (["2", 3], [2, 3]),
        (None, None),
    ],
)
def test_device_mapping_forms(value, expected):
    assert parse_device_mapping(value) == expected


@pytest.mark.parametrize(
    "value",
    ["list(range(0,8)) + [9]", "__import__('os')", "3-1", "range(0,8,0)", "", [], [True], 1.5, "range(a)"],
)
def test_device_mapping_rejects(value):
    with pytest.raises(ConfigError, match="device_mapping"):
        parse_device_mapping(value)


def test_format_device_ids():
    assert format_device_ids([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"


def shipped(name: str, tmp: Path) -> str:
    """Directory holding ``examples/config/<name>.yaml`` with its model and data paths pointed at
    files made in ``tmp`` (the shipped paths name GPU checkpoints absent here; see test_preflight)."""
    raw = point_at_files(yaml.safe_load((REPO / "examples/config" / f"{name}.yaml").read_text()), tmp)
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    return str(tmp)


@pytest.mark.parametrize("name", ["qwen2.5-7B-rlvr_megatron_8gpus", "qwen2.5-7B-rlvr_megatron_16gpus"])
def test_shipped_gpu_configs_dry_run(name, capsys, tmp_path):
    code = main(["--config_name", name, "--config_path", shipped(name, tmp_path), "--dry_run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Placement plan" in out


def test_dry_run_plan_for_16_gpu_disaggregated(capsys, tmp_path):
    main(
        [
            "--config_name",
            "qwen2.5-7B-rlvr_megatron_16gpus",
            "--config_path",
            shipped("qwen2.5-7B-rlvr_megatron_16gpus", tmp_path),
            "--dry_run",
        ]
    )
    out = capsys.readouterr().out
    assert "2 node(s) x 8 GPU(s)" in out
    assert "actor_infer            vllm                4  TP=2" in out
    assert "node1: 8-15" in out
    assert "actor_train + reference on devices 0-7" in out


def test_dry_run_plan_for_8_gpu_colocated(capsys, tmp_path):
    main(
        [
            "--config_name",
            "qwen2.5-7B-rlvr_megatron_8gpus",
            "--config_path",
            shipped("qwen2.5-7B-rlvr_megatron_8gpus", tmp_path),
            "--dry_run",
        ]
    )
    out = capsys.readouterr().out
    assert "1 node(s) x 8 GPU(s)" in out
    assert "actor_train + actor_infer + reference on devices 0-7" in out
    assert "TP=2 PP=1 CP=1 EP=1 DP=4" in out


def test_worker_error_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    from roll.distributed.scheduler.errors import WorkerError
    from roll.pipeline.rlvr import pipeline

    def fail(config):
        raise WorkerError("actor_train", 1, "ValueError", "bad batch", remote_traceback="Traceback ...")

    monkeypatch.setattr(pipeline, "run_pipeline", fail)
    files = make_launch_files(tmp_path, ("minimal",))  # untagged rows would take the file's stem
    overrides = launch_overrides(files, validation=False)
    code = main(["--config_name", "minimal", "--config_path", str(GOOD.parent), *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err == ["WorkerError: actor_train rank 1: ValueError: bad batch"]


def test_missing_tracker_package_is_a_config_error(monkeypatch):
    import importlib.util

    from roll.launch import rules
    from roll.launch.checks import check_before_launch

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "tensorboard", raising=False)  # as if never imported
    monkeypatch.setattr(
        rules.importlib.util, "find_spec", lambda name: None if name == "tensorboard" else real(name)
    )
    config = load_config(HERE / "good" / "minimal.yaml", ["track_with=tensorboard"])
    with pytest.raises(ConfigError, match="track_with: 'tensorboard' needs the tensorboard package"):
        check_before_launch(config, files=False)
