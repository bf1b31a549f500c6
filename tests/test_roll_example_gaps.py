"""The gaps alibaba/ROLL's own example files showed (tests/test_roll_examples.py runs the files), one
minimal ROLL-style file or key set each: what maps, what warns, what is refused with ROLL's meaning."""

from __future__ import annotations

import json

import pytest
import yaml
from launch_files import make_launch_files
from test_roll_compat_gaps import dry_run, roll_file

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.configs.role import DataArgs
from roll.configs.roll_compat import translate_roll_keys
from roll.pipeline.rlvr.data.dataset import parse_row
from roll.pipeline.rlvr.data.routing import build_tag_routes, reward_role_tags

ROLL_REWARD = "worker_cls: roll.pipeline.rlvr.rewards.math_rule_reward_worker.MathRuleRewardWorker"


def translate(text: str) -> dict:
    return translate_roll_keys(yaml.safe_load(text))


def test_messages_as_a_json_string_is_read_as_roll_does():
    chat = [{"role": "system", "content": "Reason step by step."}, {"role": "user", "content": "1 + 1?"}]
    messages, truth, tag = parse_row(
        {"messages": json.dumps(chat), "ground_truth": "2", "tag": "deepmath_103k"}, DataArgs(), "f"
    )
    assert (messages, truth, tag) == (chat, "2", "deepmath_103k")
    with pytest.raises(ValueError, match="invalid JSON in field 'messages'"):
        parse_row({"messages": "[{", "ground_truth": "2"}, DataArgs(), "f")


def test_a_prompt_file_without_good_rows_names_the_first_bad_one(tmp_path, capsys):
    path = roll_file(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "[{", "ground_truth": "2", "tag": "arithmetic"}\n')
    assert dry_run(path, f"actor_train.data_args.file_name=[{bad}]") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"every row is empty or bad; first: {bad}:1: invalid JSON in field 'messages'" in err


VALIDATION = """\
validation:
  data_args: {{file_name: [{val}]}}
  generating_args: {{max_new_tokens: 32}}
"""


def test_rows_of_a_tag_no_role_lists_are_scored_by_math_rule_as_in_roll(tmp_path, capsys):
    """ROLL's update_dataset_domain puts such rows in the math_rule domain (ROLL's benchmark file
    holds MATH-500 rows, its math_rule role lists deepmath_103k and aime)."""
    val = make_launch_files(tmp_path / "val", ("MATH-500",))["val"]
    path = roll_file(tmp_path, VALIDATION.format(val=val))
    assert dry_run(path) == 0, capsys.readouterr().err
    assert "scored by rewards.math_rule, as in ROLL" in capsys.readouterr().err
    cfg = load_config(path)
    assert cfg.default_reward == "math_rule"
    assert build_tag_routes(cfg) == ({"arithmetic": "math_rule"}, "math_rule")
    assert reward_role_tags(cfg, ["arithmetic", "MATH-500"]) == {"math_rule": ["arithmetic", "MATH-500"]}


def test_roll_own_files_keep_the_unclaimed_tag_error(tmp_path, capsys):
    """Without ROLL's worker_cls the file is roll's own: an unclaimed tag is still an error."""
    val = make_launch_files(tmp_path / "val", ("MATH-500",))["val"]
    path = roll_file(tmp_path, VALIDATION.format(val=val))
    path.write_text(path.read_text().replace(f"    {ROLL_REWARD}\n", "    reward_fn: math_rule\n"))
    assert dry_run(path) == 2
    assert "no reward role claims tag 'MATH-500'" in capsys.readouterr().err


def test_a_judge_left_out_of_the_mix_without_rows_warns(tmp_path, capsys):
    """ROLL's 235B file keeps its llm_judge role but comments its data file and probability out."""
    extra = """\
  llm_judge:
    worker_cls: roll.pipeline.rlvr.rewards.llm_judge_reward_worker.LLMJudgeRewardWorker
    judge_prompt: "Q: {question} A: {response} Ref: {reference} [[yes]] or [[no]]:"
    tag_included: [RLVR]
    model_args: {model_name_or_path: "${reward_pretrain}"}
    strategy_args: {strategy_name: vllm, strategy_config: {gpu_memory_utilization: 0.5}}
    device_mapping: list(range(4,6))
"""
    path = roll_file(tmp_path, extra)
    text = path.read_text().replace(
        "  data_args: {file_name: [", "  data_args: {domain_interleave_probs: {math_rule: 1.0}, file_name: ["
    )
    path.write_text(text)
    assert dry_run(path, "num_gpus_per_node=8") == 0, capsys.readouterr().err
    assert "WARNING: rewards.llm_judge.tag_included: ['RLVR'] match no row" in capsys.readouterr().err


def test_interleave_probs_short_of_one_give_the_rest_to_the_last_domain(capsys):
    raw = translate(f"""
actor_train:
  data_args: {{domain_interleave_probs: {{math_rule: 0.4, code_sandbox: 0.3, ifeval: 0.2}}}}
rewards: {{math_rule: {{{ROLL_REWARD}}}}}
""")
    assert raw["actor_train"]["data_args"]["domain_interleave_probs"]["ifeval"] == pytest.approx(0.3)
    assert (
        "sum to 0.9; ifeval: 0.2 -> 0.3, the remainder ROLL gives its last domain" in capsys.readouterr().err
    )
    own = translate("actor_train: {data_args: {domain_interleave_probs: {a: 0.4, b: 0.5}}}")
    assert own["actor_train"]["data_args"]["domain_interleave_probs"] == {"a": 0.4, "b": 0.5}


def test_rpc_timeout_sets_every_stage_not_given(tmp_path):
    cfg = load_config(roll_file(tmp_path, "rpc_timeout: 7200\nworker_timeouts: {call_s: 60}\n"))
    assert (cfg.worker_timeouts.train_s, cfg.worker_timeouts.generate_s, cfg.worker_timeouts.call_s) == (
        7200,
        7200,
        60,
    )
    with pytest.raises(ConfigError, match="rpc_timeout=-1 \\(ROLL's seconds per worker call"):
        translate("rpc_timeout: -1")


def test_engine_arguments_pass_to_the_engine_as_roll_does(tmp_path):
    path = roll_file(tmp_path)
    path.write_text(
        path.read_text().replace("load_format: dummy}", "load_format: dummy, disable_log_stats: false}")
    )
    cfg = load_config(path)
    assert cfg.actor_infer.strategy_args.strategy_config.engine_kwargs == {"disable_log_stats": False}


MEGATRON = """\
actor_train:
  worker_cls: roll.pipeline.rlvr.actor_worker.ActorWorker
  strategy_args:
    strategy_name: megatron_train
    strategy_config:
      tensor_model_parallel_size: 2
      recompute_modules: moe,layernorm
      moe_shared_expert_overlap: true
      additional_configs: {moe_permute_fusion: true}
"""


def test_megatron_core_options_pass_through_as_roll_does():
    config = translate(MEGATRON)["actor_train"]["strategy_args"]["strategy_config"]
    assert config == {
        "tensor_model_parallel_size": 2,
        "transformer_config_kwargs": {
            "moe_shared_expert_overlap": True,
            "moe_permute_fusion": True,
            "recompute_modules": ["moe", "layernorm"],
        },
    }


FSDP2_INFER = """\
reference:
  strategy_args:
    strategy_name: fsdp2_infer
    strategy_config: {apply_tiled_mlp: true, tiled_num_shards: 8, wrap_policy: {wrap_embeddings: true}}
offload_nccl: true
"""


def test_fsdp2_infer_and_dropped_memory_options_warn(capsys):
    raw = translate(FSDP2_INFER)
    assert raw["reference"]["strategy_args"] == {"strategy_name": "fsdp2_train", "strategy_config": {}}
    assert "offload_nccl" not in raw
    err = capsys.readouterr().err
    for words in (
        "WARNING: reference.strategy_args.strategy_name: fsdp2_infer -> fsdp2_train",
        "WARNING: reference.strategy_args.strategy_config.apply_tiled_mlp: True dropped",
        "WARNING: reference.strategy_args.strategy_config.wrap_policy",
        "WARNING: offload_nccl: true dropped",
    ):
        assert words in err


def test_fsdp2_expert_parallelism_keys_are_roll_keys(capsys):
    """ROLL's ep_size / efsdp_size (which roll used to refuse) keep their values on fsdp2 roles of a
    ROLL file; efsdp_size without expert parallelism shards nothing and is dropped with a note."""
    raw = translate(
        "reference: {worker_cls: roll.pipeline.rlvr.actor_worker.ActorWorker, strategy_args: "
        "{strategy_name: fsdp2_infer, strategy_config: {ep_size: 8, efsdp_size: 4}}}\n"
        "actor_train: {worker_cls: roll.pipeline.rlvr.actor_worker.ActorWorker, strategy_args: "
        "{strategy_name: fsdp2_train, strategy_config: {ep_size: -1, efsdp_size: 2}}}"
    )
    assert raw["reference"]["strategy_args"]["strategy_config"] == {"ep_size": 8, "efsdp_size": 4}
    assert raw["actor_train"]["strategy_args"]["strategy_config"] == {}
    assert "actor_train.strategy_args.strategy_config.efsdp_size: 2 dropped" in capsys.readouterr().err


def test_model_download_type_is_dropped_with_a_note(capsys):
    assert "model_download_type" not in translate("model_download_type: MODELSCOPE")
    assert "model_download_type: 'MODELSCOPE' dropped; roll loads local" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, words",
    [
        ("lora_rank: 32", "lora_rank=32 (ROLL's top-level LoRA keys only feed ${} references"),
        (
            "actor_train: {model_args: {ulysses_size: 2}, strategy_args: {strategy_name: megatron_train}}",
            "ulysses_size=2 (Ulysses sequence parallelism is fsdp2_train's (strategy 'megatron_train' here); "
            "on megatron strategies split sequences with strategy_config.context_parallel_size",
        ),
        ("rewards: {j: {judge_model_type: cluster}}", "judge_model_type='cluster' (ROLL: api asks"),
        (
            "actor_train: {data_args: {custom_data_kwargs_func: x.speech_get_data_kwargs}}",
            "custom_data_kwargs_func=x.speech_get_data_kwargs (unknown ROLL row reader; known: "
            "video_r1_get_data_kwargs, audio_test_get_data_kwargs",
        ),
        (
            "reward_system_config: {skip_special_tokens: false}",
            "reward_system_config.skip_special_tokens=False (roll's rewards read responses decoded without "
            "special tokens",
        ),
        (
            "rewards: {d: {worker_cls: x.MysteryRewardWorker}}",
            "MysteryRewardWorker (unknown ROLL reward worker; known: MathRuleRewardWorker",
        ),
    ],
)
def test_roll_features_roll_lacks_are_refused_with_their_meaning(text, words):
    with pytest.raises(ConfigError, match="alibaba/ROLL keys roll does not support") as info:
        translate(text)
    assert words in str(info.value) and "\n" not in str(info.value)
