"""Checks that once ran inside started workers now fail before launch, through the function the
launchers call (roll.launch.checks.check_before_launch): one test per class of check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from launch_files import point_at_files
from test_vllm_sglang_strategies import ENGINE_CONFIG, FakeEngineArgs, fake_engines  # noqa: F401 (fixture)

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.launch import roles
from roll.launch.checks import check_before_launch

REPO = Path(__file__).resolve().parents[1]
MINIMAL = REPO / "tests" / "configs" / "good" / "minimal.yaml"


def engines(tmp_path, *overrides, infer="vllm", infer_cfg="{}", judge="vllm", judge_cfg="{sleep_level: 1}"):
    """The engine example (actor_infer on 0-3 beside actor_train, a judge on 4-5), checked."""
    text = ENGINE_CONFIG.format(infer=infer, infer_cfg=infer_cfg, judge=judge, judge_cfg=judge_cfg)
    path = tmp_path / "engines.yaml"
    path.write_text(text.replace("num_gpus_per_node: 4", "num_gpus_per_node: 8"))
    check_before_launch(load_config(path, list(overrides)), files=False)


def refused(call, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    assert info.value.path == key and words in info.value.message, str(info.value)


# ---------------------------------------------------------------- options only an updated role can use


@pytest.mark.parametrize(
    "judge, judge_cfg, key",
    [
        ("vllm", "{load_format: dummy}", "load_format"),
        ("vllm", "{sleep_level: 2}", "sleep_level"),
        ("sglang", "{load_format: dummy}", "load_format"),
    ],
)
def test_engine_options_only_actor_infer_can_use(tmp_path, judge, judge_cfg, key):
    refused(
        lambda: engines(tmp_path, judge=judge, judge_cfg=judge_cfg),
        f"rewards.judge.strategy_args.strategy_config.{key}",
        "only actor_infer gets",
    )


def test_vllm_reference_needs_actor_infer_at_temperature_1(tmp_path):
    reference = (
        "reference={model_args: {model_name_or_path: /tmp/model}, strategy_args: {strategy_name: vllm, "
        "strategy_config: {sleep_level: 1}}, device_mapping: '6-7'}"
    )
    engines(tmp_path, reference)  # temperature 1: fine
    refused(
        lambda: engines(tmp_path, reference, "actor_infer.generating_args.temperature=0.7"),
        "reference.strategy_args.strategy_name",
        "vllm scores with temperature 1 but actor_infer samples at 0.7",
    )


# ---------------------------------------------------------------- engine options


def test_engine_kwargs_that_roll_sets_are_refused(tmp_path):
    refused(
        lambda: engines(tmp_path, infer_cfg="{sleep_level: 1, engine_kwargs: {max_model_len: 64}}"),
        "actor_infer.strategy_args.strategy_config.engine_kwargs.max_model_len",
        "is set by roll from actor_infer.strategy_args.strategy_config.max_model_len",
    )


@pytest.mark.parametrize(
    "infer, infer_cfg, key",
    [
        ("vllm", "{sleep_level: 1, engine_kwargs: {swap_spcae: 1}}", "engine_kwargs.swap_spcae"),
        ("sglang", "{engine_kwargs: {log_levle: info}}", "engine_kwargs.log_levle"),
    ],
)
@pytest.mark.usefixtures("fake_engines")  # vLLM and SGLang import on this driver
def test_unknown_engine_option_fails_before_launch_where_the_engine_imports(tmp_path, infer, infer_cfg, key):
    refused(
        lambda: engines(tmp_path, infer=infer, infer_cfg=infer_cfg),
        f"actor_infer.strategy_args.strategy_config.{key}",
        "did you mean",
    )


def test_engine_options_are_read_from_the_installed_source_without_importing_the_engine(
    tmp_path, monkeypatch
):
    import sys

    site = tmp_path / "site"
    (site / "vllm" / "engine").mkdir(parents=True)
    # importing this vllm fails the test: the driver's check must read its source instead
    (site / "vllm" / "__init__.py").write_text("raise RuntimeError('the driver imported vllm')\n")
    (site / "vllm" / "engine" / "__init__.py").write_text("")
    fields = "\n".join(f"    {name}: object = None" for name in FakeEngineArgs.__dataclass_fields__)
    (site / "vllm" / "engine" / "arg_utils.py").write_text(
        f"from dataclasses import dataclass\n\n\n@dataclass\nclass EngineArgs:\n{fields}\n"
    )
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    engines(tmp_path, infer_cfg="{sleep_level: 1, engine_kwargs: {swap_space: 1}}")
    refused(
        lambda: engines(tmp_path, infer_cfg="{sleep_level: 1, engine_kwargs: {swap_spcae: 1}}"),
        "actor_infer.strategy_args.strategy_config.engine_kwargs.swap_spcae",
        "did you mean",
    )
    assert "vllm" not in sys.modules


def test_unknown_engine_option_waits_for_the_worker_where_the_engine_is_missing(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError here
    engines(tmp_path, infer_cfg="{sleep_level: 1, engine_kwargs: {swap_spcae: 1}}")


# ---------------------------------------------------------------- training strategies


def test_fsdp2_packing_needs_a_transformers_that_confines_attention(monkeypatch):
    config = load_config(MINIMAL, ["actor_train.strategy_args.strategy_config={sequence_packing: true}"])
    check_before_launch(config, files=False)
    monkeypatch.setattr(roles, "transformers_detects_packing", lambda: False)
    refused(
        lambda: check_before_launch(config, files=False),
        "actor_train.strategy_args.strategy_config.sequence_packing",
        "cannot confine attention to packed sequences",
    )


def test_megatron_has_no_value_head():
    config = load_config(
        MINIMAL,
        ["actor_train.strategy_args.strategy_name=megatron_train", "actor_train.model_args.model_type=value"],
    )
    refused(
        lambda: check_before_launch(config, files=False),
        "actor_train.model_args.model_type",
        "megatron_train has no value head",
    )


def test_megatron_layout_is_checked_against_the_model(tmp_path):
    raw = point_at_files(yaml.safe_load(MINIMAL.read_text()), tmp_path)
    raw["actor_train"]["strategy_args"] = {
        "strategy_name": "megatron_train",
        "strategy_config": {"tensor_model_parallel_size": 2},
    }
    raw["actor_train"]["training_args"]["gradient_accumulation_steps"] = 4  # DP 1
    model = Path(raw["pretrain"])
    shape = {"model_type": "qwen2", "num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 48}
    shape |= {"intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": 128}
    (model / "config.json").write_text(json.dumps(shape))
    path = tmp_path / "megatron.yaml"
    path.write_text(yaml.safe_dump(raw))
    refused(
        lambda: check_before_launch(load_config(path)),
        "actor_train.strategy_args.strategy_config.tensor_model_parallel_size",
        "2 does not divide the model's num_attention_heads (3)",
    )


def test_the_sft_warm_start_config_passes_the_checks(tmp_path):
    from roll.launch.checks import check_sft_config
    from roll.pipeline.sft.warm_start import warm_start_config

    config = warm_start_config(tmp_path / "base", tmp_path / "sft.jsonl", tmp_path / "run", 3, 0, 1)
    assert check_sft_config(config, files=False).roles["actor_train"].parallel.dp == 1


def test_megatron_infer_generation_refuses_virtual_pipeline_stages_before_launch():
    """actor_infer on megatron_infer generates with one model chunk per stage: a layout that makes
    virtual stages is one ConfigError at load, naming the key; the reference may keep them."""
    from roll.launch.rules import check_generation_layout

    path = REPO / "examples" / "config" / "rlvr_megatron_2gpus.yaml"
    layout = "{tensor_model_parallel_size: 1, pipeline_model_parallel_size: 2, pipeline_model_parallel_layout: 'E|t|t|L'}"
    config = load_config(path, [f"reference.strategy_args.strategy_config={layout}"])
    check_generation_layout(config)  # scoring with virtual stages is fine
    config = load_config(path, [f"actor_infer.strategy_args.strategy_config={layout}"])
    refused(
        lambda: check_generation_layout(config),
        "actor_infer.strategy_args.strategy_config.pipeline_model_parallel_layout",
        "2 virtual pipeline stages per rank",
    )
