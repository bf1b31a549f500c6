"""A vLLM/SGLang tensor- or expert-parallel layout the model cannot split is one ConfigError line
before any worker starts, naming the key and the model's numbers from its config.json
(``engine_options.check_engine_tp`` / ``check_engine_ep``, called by ``roll.launch.files``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from launch_files import point_at_files

from roll.configs.errors import ConfigError
from roll.distributed.strategy.engine_options import check_engine_ep, check_engine_tp, model_split_sizes
from roll.launch.rlvr import main
from roll.models.random_checkpoint import preset_config

REPO = Path(__file__).resolve().parents[1]
KEY = "actor_infer.strategy_args.strategy_config.tensor_parallel_size"
DENSE = {"num_attention_heads": 12, "num_key_value_heads": 2}


def test_model_numbers_from_config_json() -> None:
    assert model_split_sizes(DENSE) == (12, 2, 0)
    assert model_split_sizes({"num_attention_heads": 8}) == (8, 8, 0)  # no GQA: KV heads = heads
    assert model_split_sizes({"num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128}) == (
        32,
        4,
        128,
    )
    assert model_split_sizes({"num_local_experts": 8, "num_attention_heads": 32})[2] == 8  # Mixtral
    assert model_split_sizes({"n_routed_experts": 64, "num_attention_heads": 16})[2] == 64  # DeepSeek
    assert model_split_sizes({"text_config": DENSE}) == (12, 2, 0)  # a multimodal file's language model


@pytest.mark.parametrize("tp", [1, 2, 4, 6, 12])
def test_tp_that_splits_the_heads_passes(tp: int) -> None:
    check_engine_tp(DENSE, tp, KEY, "/m")  # KV heads: split (tp 1, 2) or copied (tp 4, 6, 12)


def test_tp_not_dividing_the_heads_names_the_key_and_the_count() -> None:
    with pytest.raises(ConfigError) as info:
        check_engine_tp(DENSE, 8, KEY, "/m")
    assert str(info.value) == (
        f"{KEY}: 8 does not divide the model's 12 attention heads (num_attention_heads in /m/config.json); "
        "use one of [1, 2, 3, 4, 6, 12]"
    )


def test_tp_and_kv_heads_that_divide_neither_way() -> None:
    with pytest.raises(ConfigError) as info:
        check_engine_tp(DENSE, 3, KEY, "/m")
    assert str(info.value).startswith(
        f"{KEY}: 3 and the model's 2 KV heads (num_key_value_heads in /m/config.json) do not split evenly"
    )
    assert str(info.value).endswith("use one of [1, 2, 4, 6, 12]")


def test_expert_parallel_must_divide_the_experts() -> None:
    moe = {"num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128}
    check_engine_ep(moe, 8, KEY, "tp x dp", "/m")
    check_engine_ep(DENSE, 3, KEY, "tp x dp", "/m")  # a dense model has no experts to split
    with pytest.raises(
        ConfigError, match=r"^.*: expert parallelism over 6 ranks \(tp x dp\) does not divide "
    ):
        check_engine_ep(moe, 6, KEY, "tp x dp", "/m")


# ------------------------------------------------------------------ through --dry_run


def dry_run(tmp_path: Path, capsys, preset: str, actor_infer: dict, **overrides) -> tuple[int, list[str]]:
    """``--dry_run`` of the shipped Megatron + vLLM config on a config.json of ``preset`` (no
    weights), with ``actor_infer`` merged into its actor_infer section; returns (code, stderr lines)."""
    name = "rlvr_megatron_vllm_2gpus"
    raw = point_at_files(yaml.safe_load((REPO / "examples/config" / f"{name}.yaml").read_text()), tmp_path)
    (tmp_path / "model" / "config.json").write_text(preset_config(preset, 2, **overrides).to_json_string())
    raw["actor_infer"].update(actor_infer)
    raw["num_gpus_per_node"] = 8  # one engine of up to 8 devices on one node
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    code = main(["--config_name", name, "--config_path", str(tmp_path), "--dry_run"])
    return code, capsys.readouterr().err.strip().splitlines()


def vllm(tp: int, devices: str, **engine_kwargs) -> dict:
    config = {"gpu_memory_utilization": 0.3, "tensor_parallel_size": tp, "engine_kwargs": engine_kwargs}
    return {"strategy_args": {"strategy_name": "vllm", "strategy_config": config}, "device_mapping": devices}


def test_dry_run_refuses_a_tp_the_heads_do_not_split(tmp_path, capsys) -> None:
    model = json.loads(preset_config("qwen2.5-1.5b", 2).to_json_string())
    assert (model["num_attention_heads"], model["num_key_value_heads"]) == (12, 2)
    code, err = dry_run(tmp_path, capsys, "qwen2.5-1.5b", vllm(8, "0-7"))
    assert code == 2
    assert err == [
        f"ConfigError: {KEY}: 8 does not divide the model's 12 attention heads (num_attention_heads in "
        f"{tmp_path / 'model'}/config.json); use one of [1, 2, 3, 4, 6, 12]"
    ]
    code, err = dry_run(tmp_path, capsys, "qwen2.5-1.5b", vllm(3, "0-2"))
    assert code == 2 and len(err) == 1 and "3 and the model's 2 KV heads" in err[0], err
    assert dry_run(tmp_path, capsys, "qwen2.5-1.5b", vllm(4, "0-3"))[0] == 0  # KV heads copied


def test_dry_run_refuses_expert_parallel_over_a_count_the_experts_do_not_split(tmp_path, capsys) -> None:
    code, err = dry_run(
        tmp_path, capsys, "qwen3-30b-a3b", vllm(2, "0-1", enable_expert_parallel=True, data_parallel_size=3)
    )
    assert code == 2
    assert err == [
        f"ConfigError: {KEY}: expert parallelism over 6 ranks (enable_expert_parallel; tensor_parallel_size "
        f"x data_parallel_size = 2 x 3) does not divide the model's 128 experts ({tmp_path / 'model'}/config.json); "
        "use a divisor of 128: [1, 2, 4, 8, 16, 32, 64, 128]"
    ]
    ok = vllm(2, "0-1", enable_expert_parallel=True, data_parallel_size=2)
    assert dry_run(tmp_path, capsys, "qwen3-30b-a3b", ok)[0] == 0
    bad_dp = vllm(2, "0-1", enable_expert_parallel=True, data_parallel_size="two")
    code, err = dry_run(tmp_path, capsys, "qwen3-30b-a3b", bad_dp)
    assert code == 2 and err == [
        "ConfigError: actor_infer.strategy_args.strategy_config.engine_kwargs.data_parallel_size: "
        "must be an integer >= 1, got 'two'"
    ]
