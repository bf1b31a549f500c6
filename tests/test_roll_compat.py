"""alibaba/ROLL RLVR files: keys mapped onto roll's, ROLL defaults taken, the rest refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch_files import launch_overrides, make_launch_files

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.configs.roll_compat import translate_roll_keys
from roll.launch.rlvr import main

HERE = Path(__file__).parent / "configs" / "roll_format"


def test_roll_format_file_loads_with_roll_meanings():
    cfg = load_config(HERE / "megatron_multi_reward.yaml")
    assert cfg.exp_name == "roll-format-reinforce"
    assert cfg.actor_train.model_args.model_name_or_path == "/models/policy"  # from pretrain
    assert cfg.actor_infer.model_args.model_name_or_path == "/models/policy"
    assert cfg.rewards["math_rule"].reward_fn == "math_rule"
    assert cfg.rewards["llm_judge"].reward_fn == "llm_judge"
    assert cfg.rewards["code_sandbox"].reward_fn == "code_sandbox"
    assert cfg.rewards["code_sandbox"].reward_kwargs == {"reward_type": "hard"}
    assert cfg.rewards["crossthinkqa"].reward_fn == "multiple_choice"
    assert cfg.rewards["ifeval"].reward_kwargs == {"reward_type": "soft"}
    assert cfg.actor_infer.strategy_args.strategy_config.tensor_parallel_size == 2  # num_gpus_per_worker
    assert cfg.actor_train.data_args.template == "qwen2_5"  # global_template
    megatron = cfg.actor_train.strategy_args.strategy_config
    assert (megatron.recompute_method, megatron.recompute_num_layers) == ("uniform", 1)  # ROLL's default
    assert megatron.sequence_parallel is False  # TP=1, as ROLL's mcore_adapter does
    assert megatron.transformer_config_kwargs == {"bias_activation_fusion": True}


def test_roll_format_file_dry_runs(capsys, tmp_path):
    # The file names models and data of a GPU cluster; point them at files made here.
    files = make_launch_files(tmp_path, ("deepmath", "RLVR", "KodCode", "crossthinkqa", "ifeval"))
    paths = [f"reward_pretrain={files['model']}", *launch_overrides(files, validation=False)]
    code = main(["--config_name", "megatron_multi_reward", "--config_path", str(HERE), "--dry_run", *paths])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "rewards.llm_judge" in out.out


def test_every_unsupported_key_is_named_in_one_line(capsys):
    code = main(["--config_name", "fsdp2_roll_features", "--config_path", str(HERE), "--dry_run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    for key in (
        "difficulty_loss_weight=True",
        "reward_norm='batch'",
        "ratio_type='segment' (a sequence-level ratio is pg_variant: gspo",
        "actor_train.use_dynamic_batching_in_train=True",
        "rewards.code_sandbox.use_local=False",
    ):
        assert key in err[0], key
    assert "docs/migrating_from_roll.md" in err[0]


def test_fsdp2_keys_map_onto_fsdp2_config():
    raw = {
        "actor_train": {
            "worker_cls": "roll.pipeline.base_worker.ActorWorker",  # a ROLL file: its fsdp_size
            "model_args": {"dtype": "bf16"},
            "strategy_args": {
                "strategy_name": "fsdp2_train",
                "strategy_config": {
                    "fsdp_size": 4,
                    "param_dtype": "bf16",
                    "reduce_dtype": "fp32",
                    "offload_policy": True,
                },
            },
            "device_mapping": "list(range(0,4))",
        }
    }
    config = translate_roll_keys(raw)["actor_train"]["strategy_args"]["strategy_config"]
    assert config == {"cpu_offload": True, "mixed_precision": True, "reduce_dtype": "fp32"}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (
            {
                "actor_train": {
                    "strategy_args": {
                        "strategy_name": "fsdp2_train",
                        "strategy_config": {"reduce_dtype": "fp16"},
                    }
                }
            },
            "reduce_dtype",
        ),
        ({"rewards": {"r": {"worker_cls": "a.b.MyRewardWorker"}}}, "known: MathRuleRewardWorker"),
        (
            {
                "actor_infer": {
                    "num_gpus_per_worker": 2,
                    "strategy_args": {
                        "strategy_name": "sglang",
                        "strategy_config": {"tensor_parallel_size": 4},
                    },
                }
            },
            "must equal",
        ),
    ],
)
def test_conflicting_roll_keys_are_refused(raw, words):
    with pytest.raises(ConfigError, match=words):
        translate_roll_keys(raw)


def test_a_vllm_workers_devices_are_its_tensor_parallel_size_as_in_roll(capsys):
    """ROLL's WorkerConfig sets a vLLM worker's num_gpus_per_worker to TP x PP whatever the file says
    (ROLL's qwen3.5-27B file writes 2 with tensor_parallel_size 4): dropped with a note."""
    config = {"tensor_parallel_size": 4}
    raw = {
        "actor_infer": {
            "num_gpus_per_worker": 2,
            "strategy_args": {"strategy_name": "vllm", "strategy_config": config},
        }
    }
    out = translate_roll_keys(raw)
    assert out["actor_infer"] == {
        "strategy_args": {"strategy_name": "vllm", "strategy_config": {"tensor_parallel_size": 4}}
    }
    assert "num_gpus_per_worker: 2 dropped" in capsys.readouterr().err


def test_roll_keys_at_their_off_value_are_dropped():
    raw = {
        "difficulty_loss_weight": False,
        "reward_norm": None,
    }
    assert translate_roll_keys(raw) == {}
    # pg_variant is roll's key too (its policy losses, docs/policy_losses.md).
    assert translate_roll_keys({"pg_variant": "ppo"}) == {"pg_variant": "ppo"}
    # roll has async_generation_ratio itself (same meaning): it passes through untouched.
    assert translate_roll_keys({"async_generation_ratio": 1}) == {"async_generation_ratio": 1}


def test_roll_packing_keys_map_onto_packing_options():
    raw = {
        "actor_train": {
            "use_dynamic_batching_in_train": True,
            "max_tokens_per_microbatch_in_train": 8192,
            "sequence_length_round_in_train": 128,
            "strategy_args": {"strategy_name": "megatron_train", "strategy_config": {}},
        },
        "reference": {
            "use_sequence_packing": True,
            "sequence_packing_args": {
                "algorithm": "load_balance",
                "max_packed_sequence_length_forward": 16384,
            },
            "strategy_args": {"strategy_name": "megatron_infer", "strategy_config": {}},
        },
    }
    out = translate_roll_keys(raw)
    assert out["actor_train"]["strategy_args"]["strategy_config"] == {"max_tokens_per_microbatch": 8192}
    assert out["reference"]["strategy_args"]["strategy_config"] == {
        "sequence_packing": True,
        "infer_max_tokens_per_microbatch": 16384,
    }
    assert "use_sequence_packing" not in out["reference"]
    vllm = {"actor_infer": {"use_sequence_packing": True, "strategy_args": {"strategy_name": "vllm"}}}
    with pytest.raises(ConfigError, match="roll packs in fsdp2_train"):
        translate_roll_keys(vllm)
    more = {"use_sequence_packing": True, "sequence_packing_args": {"min_num_micro_batches_train": 4}}
    with pytest.raises(ConfigError, match="min_num_micro_batches_train=4"):
        translate_roll_keys({"actor_train": more})


def test_roll_keys_roll_does_its_own_way_are_dropped_with_a_note(capsys):
    raw = translate_roll_keys(
        {
            "logging_dir": "./output/logs",
            "checkpoint_config": {"type": "file_system", "output_dir": "/ckpt"},
            "actor_train": {
                "data_args": {"preprocessing_num_workers": 16, "interleave_probs": "1.0"},
                "training_args": {"num_train_epochs": 50},
            },
            "validation": {"data_args": {"preprocessing_num_workers": 4}},
        }
    )
    assert raw == {
        "checkpoint_config": {"output_dir": "/ckpt"},
        "actor_train": {"data_args": {}, "training_args": {}},
        "validation": {"data_args": {}},
    }
    err = capsys.readouterr().err
    for key in ("logging_dir", "actor_train.data_args.preprocessing_num_workers", "num_train_epochs"):
        assert key in err, key


def test_roll_ml_tracker_becomes_tensorboard_with_a_note(capsys):
    """ROLL's internal tracker (its video file's ``track_with: ml_tracker``) writes TensorBoard."""
    kwargs = {"project": "video-r1", "tags": ["roll"]}
    raw = translate_roll_keys({"track_with": "ml_tracker", "tracker_kwargs": kwargs})
    assert raw == {"track_with": "tensorboard", "tracker_kwargs": kwargs}
    assert "track_with: 'ml_tracker' (ROLL's internal tracker) -> 'tensorboard'" in capsys.readouterr().err
    assert translate_roll_keys({"track_with": "wandb"}) == {"track_with": "wandb"}  # roll's own: kept
    assert (
        load_config(HERE / "megatron_multi_reward.yaml", ["track_with=ml_tracker"]).track_with
        == "tensorboard"
    )


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"checkpoint_config": {"type": "s3"}}, "checkpoint_config.type='s3' (remove it; roll checkpoints"),
        (
            {"actor_train": {"data_args": {"interleave_probs": "0.7,0.3"}}},
            "actor_train.data_args.interleave_probs='0.7,0.3'",
        ),
    ],
)
def test_roll_keys_roll_cannot_honour_are_refused(raw, words):
    with pytest.raises(ConfigError, match="alibaba/ROLL keys roll does not support") as info:
        translate_roll_keys(raw)
    assert words in str(info.value)


def test_roll_only_keys_are_unknown_to_roll_own_sections():
    from roll.configs.build import build_dataclass
    from roll.configs.run_config import CheckpointConfig

    with pytest.raises(ConfigError, match="type: unknown key; valid keys: output_dir, max_to_keep"):
        build_dataclass(CheckpointConfig, {"type": "file_system"})


def test_vllm_workers_span_their_tensor_parallel_size_whatever_num_gpus_per_worker_says(capsys):
    """ROLL's WorkerConfig sets a vllm worker's num_gpus_per_worker to TP x PP (ROLL's
    qwen3-vl-30BA3B rlvr_megatron_80GB file gives 4 for TP 2): dropped with a note."""
    raw = {
        "actor_infer": {
            "num_gpus_per_worker": 4,
            "strategy_args": {"strategy_name": "vllm", "strategy_config": {"tensor_parallel_size": 2}},
        }
    }
    out = translate_roll_keys(raw)["actor_infer"]
    assert "num_gpus_per_worker" not in out and out["strategy_args"]["strategy_config"] == {
        "tensor_parallel_size": 2
    }
    assert "actor_infer.num_gpus_per_worker: 4 dropped" in capsys.readouterr().err
