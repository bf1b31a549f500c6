"""ROLL's judge served by its own inference cluster (``judge_model_type: cluster`` with a top-level
``reward_model`` role, as ROLL's ``rlvr_config_8gpus_llm_as_judge_server`` writes it): the judge
reward role takes the cluster's engine, devices, model and generation options."""

from __future__ import annotations

import pytest
from test_roll_compat_gaps import dry_run, roll_file

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config

CLIENT = """\
  llm_judge:
    worker_cls: roll.pipeline.rlvr.rewards.llm_judge_reward_worker.LLMJudgeRewardWorker
    judge_model_type: cluster
    judge_prompt: "Q: {question} A: {response} Ref: {reference} [[yes]] or [[no]]:"
    tag_included: [RLVR]
    world_size: 32
    model_args: {model_name_or_path: "${reward_pretrain}"}
    generating_args: {max_new_tokens: 64, temperature: 0.3, num_return_sequences: 1}
"""
SERVICE = """\
{key}:
  name: reward_llm
  worker_cls: roll.pipeline.base_worker.InferWorker
  model_args: {{model_name_or_path: "${{reward_pretrain}}", dtype: bf16}}
  generating_args: {{max_new_tokens: 128, temperature: 0.3, num_return_sequences: 1}}
  data_args: {{template: native}}
  strategy_args:
    strategy_name: vllm
    strategy_config: {{gpu_memory_utilization: 0.5, enforce_eager: false, load_format: auto}}
  device_mapping: "[4, 5]"
"""


@pytest.mark.parametrize("key", ["reward_model", "reward_infer"])  # ROLL's example files; its newer pipeline
def test_cluster_judge_runs_the_service_roles_engine_on_its_devices(tmp_path, capsys, key):
    path = roll_file(tmp_path, CLIENT + SERVICE.format(key=key), tags=("arithmetic", "RLVR"))
    assert dry_run(path, "num_gpus_per_node=8") == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert (
        f"rewards.llm_judge.judge_model_type: cluster -> the judge's engine is rewards.llm_judge's own, on {key}'s"
        in err
    )
    assert "world_size 32 (ROLL's client workers) dropped" in err
    judge = load_config(path).rewards["llm_judge"]
    assert judge.strategy_args.strategy_name == "vllm" and judge.device_mapping == [4, 5]
    assert judge.world_size is None and judge.model_args.dtype == "bf16"
    assert (
        judge.generating_args.max_new_tokens == 128
    )  # the service's: what ROLL's cluster judge generates with


def test_cluster_judge_without_a_service_role_is_one_line(tmp_path):
    path = roll_file(tmp_path, CLIENT, tags=("arithmetic", "RLVR"))
    with pytest.raises(
        ConfigError,
        match=r"rewards.llm_judge.judge_model_type=cluster \(ROLL's judge service is one top-level role named reward_model or reward_infer \(found none\)",
    ):
        load_config(path)


def test_a_key_of_the_service_role_roll_does_not_map_is_named(tmp_path):
    service = SERVICE.format(key="reward_model") + "  offload_nccl_to_cpu: true\n"
    path = roll_file(tmp_path, CLIENT + service, tags=("arithmetic", "RLVR"))
    with pytest.raises(
        ConfigError, match=r"reward_model.offload_nccl_to_cpu \(a key of ROLL's judge service role"
    ):
        load_config(path)
