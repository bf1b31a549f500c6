"""What a colocated SGLang run needs from the pipeline around the engine, found on 2 x H200 when
``rlvr_megatron_sglang_2gpus`` first ran (2026-11-27):

- SGLang's ``Engine`` sets NCCL_CUMEM_ENABLE=0 in its worker's process unless it is set, and the
  trainer -> engine broadcast then failed in NCCL's peer-to-peer transport ("Cuda failure 'invalid
  argument'") between that process and the trainer's, which kept cuMem on. Every worker of a run
  with an SGLang role now gets NCCL_CUMEM_ENABLE=0 (``StrategySpec.run_env``); with it set by
  hand the update went through on the GPUs.
- With the memory saver, an offloaded actor_infer has released its weights and SGLang keeps no
  copy, so the engine's first generate after a model update and an offload found no weights.
  Such an engine is refilled on every wake (``refills_on_wake``), as vLLM at sleep level 2 is.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from launch_files import point_at_files

from roll.configs.loader import load_config
from roll.configs.role import RoleConfig
from roll.configs.strategies import strategies_run_env
from roll.distributed.scheduler.cluster import worker_extra_env
from roll.pipeline.rlvr.start import refills_on_wake

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples/config"
COLOCATED = {"actor_train", "actor_infer", "reference"}


def sglang_config(tmp_path: Path, *overrides: str):
    raw = point_at_files(yaml.safe_load((EXAMPLES / "rlvr_megatron_sglang_2gpus.yaml").read_text()), tmp_path)
    path = tmp_path / "rlvr_megatron_sglang_2gpus.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(path, list(overrides))


def test_every_worker_of_an_sglang_run_agrees_on_nccl_cumem(tmp_path):
    config = sglang_config(tmp_path)
    assert strategies_run_env(config.roles().values()) == {"NCCL_CUMEM_ENABLE": "0"}
    for role in config.roles().values():  # the trainer's workers too, not only the engine's
        assert worker_extra_env(config, role)["NCCL_CUMEM_ENABLE"] == "0"
    # The run's and the role's system_envs still win.
    config.system_envs["NCCL_CUMEM_ENABLE"] = "1"
    assert worker_extra_env(config, config.actor_train)["NCCL_CUMEM_ENABLE"] == "1"
    role = RoleConfig(system_envs={"NCCL_CUMEM_ENABLE": "0", "X": "y"})
    assert worker_extra_env(config, role) == {"NCCL_CUMEM_ENABLE": "0", "X": "y"}
    assert worker_extra_env(None, role) == {"NCCL_CUMEM_ENABLE": "0", "X": "y"}


def test_a_run_without_sglang_keeps_nccl_defaults():
    config = load_config(REPO / "examples/config/rlvr_megatron_vllm_2gpus.yaml")
    assert strategies_run_env(config.roles().values()) == {}
    assert "NCCL_CUMEM_ENABLE" not in worker_extra_env(config, config.actor_train)


def test_a_colocated_sglang_engine_with_the_memory_saver_is_refilled_on_every_wake(tmp_path):
    assert refills_on_wake(sglang_config(tmp_path), COLOCATED)
    assert not refills_on_wake(sglang_config(tmp_path), {"actor_train"})  # disaggregated: never offloaded
    saver_off = sglang_config(tmp_path, "actor_infer.strategy_args.strategy_config.enable_memory_saver=false")
    assert not refills_on_wake(saver_off, COLOCATED)
