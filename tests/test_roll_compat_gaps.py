"""alibaba/ROLL RLVR files load as they are (issue 30): each gap shown by a minimal ROLL-style file,
and the stage order that lets a colocated vLLM engine run with sleep_level 2."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launch_files import make_launch_files

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.launch.rlvr import main
from roll.pipeline.common.timing import SwapTimes
from roll.pipeline.rlvr import stages
from roll.pipeline.rlvr.data.dataset import resolve_files
from roll.pipeline.rlvr.pipeline import update_inference_weights

# A ROLL-style file on 4 GPUs (colocated), with the keys each test adds below it.
BASE = """\
exp_name: roll-gap
pretrain: {model}
reward_pretrain: {model}
num_gpus_per_node: 4
rollout_batch_size: 8
num_return_sequences_in_group: 4
prompt_length: 64
response_length: 32
actor_train:
  worker_cls: roll.pipeline.base_worker.ActorWorker
  training_args: {{per_device_train_batch_size: 2, gradient_accumulation_steps: 2}}
  data_args: {{file_name: [{train}]}}
  strategy_args:
    strategy_name: fsdp2_train
    strategy_config: {{param_dtype: bf16, reduce_dtype: {reduce_dtype}}}
  device_mapping: {train_devices}
actor_infer:
  generating_args:
    max_new_tokens: ${{response_length}}
    num_return_sequences: ${{num_return_sequences_in_group}}
  strategy_args:
    strategy_name: vllm
    strategy_config: {{sleep_level: {sleep_level}, load_format: dummy}}
  device_mapping: {infer_devices}
rewards:
  math_rule:
    worker_cls: roll.pipeline.rlvr.rewards.math_rule_reward_worker.MathRuleRewardWorker
    tag_included: [arithmetic]
    world_size: 1
"""


def roll_file(tmp_path: Path, extra: str = "", tags: tuple[str, ...] = ("arithmetic",), **fields) -> Path:
    files = make_launch_files(tmp_path, tags)
    values = {
        "model": files["model"],
        "train": files["train"],
        "reduce_dtype": "fp32",
        "train_devices": "list(range(0,4))",
        "infer_devices": "list(range(0,4))",
        "sleep_level": 1,
        **fields,
    }
    path = tmp_path / "rlvr_config.yaml"
    path.write_text(BASE.format(**values) + extra)
    return path


def dry_run(path: Path, *overrides: str) -> int:
    return main(["--config_name", path.stem, "--config_path", str(path.parent), "--dry_run", *overrides])


def test_gap1_dataset_dir_is_not_joined_twice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.jsonl").write_text(
        '{"prompt": "1 + 1 = ?", "ground_truth": "2", "tag": "arithmetic"}\n'
    )
    path = roll_file(tmp_path, train="data/x.jsonl")
    cfg = load_config(path, ["actor_train.data_args.dataset_dir=data"])
    assert resolve_files(cfg.actor_train.data_args, "actor_train.data_args") == [Path("data/x.jsonl")]
    cfg = load_config(
        path, ["actor_train.data_args.dataset_dir=data", "actor_train.data_args.file_name=[y.jsonl]"]
    )
    with pytest.raises(ConfigError, match=r"'y.jsonl': no such file 'data/y.jsonl' \(dataset_dir joined"):
        resolve_files(cfg.actor_train.data_args, "actor_train.data_args")


JUDGE = """\
  llm_judge:
    worker_cls: roll.pipeline.rlvr.rewards.llm_judge_reward_worker.LLMJudgeRewardWorker
    judge_model_type: inference
    judge_prompt: "Q: {question} A: {response} Ref: {reference} [[yes]] or [[no]]:"
    tag_included: [RLVR]
    model_args: {model_name_or_path: "${reward_pretrain}", model_type: trl}
    strategy_args: {strategy_name: vllm, strategy_config: {gpu_memory_utilization: 0.5, sleep_level: 1}}
    device_mapping: list(range(4,6))
"""


def test_gap2_generative_judge_drops_its_value_head_type(tmp_path, capsys):
    path = roll_file(tmp_path, JUDGE, tags=("arithmetic", "RLVR"))
    assert dry_run(path, "num_gpus_per_node=8") == 0, capsys.readouterr().err
    assert "rewards.llm_judge.model_args.model_type: 'trl' dropped" in capsys.readouterr().err
    assert load_config(path).rewards["llm_judge"].model_args.model_type is None


def test_gap3_pg_variant_top_level_and_per_role_dry_runs(tmp_path, capsys):
    extra = "pg_variant: cispo\ncispo_epsilon_high: 0.2\n"
    path = roll_file(tmp_path, extra)
    text = path.read_text().replace("exp_name: roll-gap", "exp_name: roll-${pg_variant}")
    path.write_text(
        text.replace("  worker_cls: roll.pipeline.base_worker.ActorWorker", "  pg_variant: cispo")
    )
    assert dry_run(path) == 0, capsys.readouterr().err
    cfg = load_config(path)
    assert (cfg.exp_name, cfg.pg_variant, cfg.policy_loss.cispo_epsilon_high) == ("roll-cispo", "cispo", 0.2)


def test_gap4_async_without_correction_dry_runs_with_one_warning(tmp_path, capsys):
    path = roll_file(
        tmp_path, "async_generation_ratio: 1\n", train_devices="list(range(0,2))", infer_devices="[2, 3]"
    )
    path.write_text(
        path.read_text().replace("gradient_accumulation_steps: 2", "gradient_accumulation_steps: 4")
    )
    assert dry_run(path) == 0
    err = capsys.readouterr().err
    assert sum(line.startswith("WARNING: async_generation_ratio") for line in err.splitlines()) == 1


def test_gap4_mismatch_metric_is_logged_without_correction(tmp_path):
    cfg = load_config(roll_file(tmp_path, "async_generation_ratio: 1\n"))
    assert cfg.off_policy_correction.mode == "none"
    mask = torch.ones(2, 3)
    batch = Batch.from_dict(
        {
            "scores": torch.tensor([1.0, 0.0]),
            "response_mask": mask,
            "old_log_probs": torch.full((2, 3), -1.0),
            "infer_logprobs": torch.full((2, 3), -1.25),
        },
        {"domain": ["arithmetic"] * 2, "tag": ["arithmetic"] * 2},
    )
    run = SimpleNamespace(config=cfg, reward_routes=lambda tags: {"math_rule": list(range(len(tags)))})
    metrics = stages.rollout_metrics(run, batch)
    assert metrics["rollout/logprob_mismatch"] == pytest.approx(0.25)


def test_gap5_device_mapping_literal_list_inside_list(tmp_path, capsys):
    path = roll_file(tmp_path, infer_devices='"list([0,1,2,3])"', train_devices='"list([0,1,2,3])"')
    assert load_config(path).actor_infer.device_mapping == [0, 1, 2, 3]
    assert dry_run(path) == 0, capsys.readouterr().err
    path.write_text(path.read_text().replace('"list([0,1,2,3])"', '"list([0,1,2,__import__])"', 1))
    with pytest.raises(ConfigError, match=r"device_mapping\[3\]: expected a device id"):
        load_config(path)


def test_gap6_fsdp2_reduce_dtype_bf16(tmp_path, capsys):
    path = roll_file(tmp_path, reduce_dtype="bf16")
    config = load_config(path).actor_train.strategy_args.strategy_config
    assert (config.mixed_precision, config.reduce_dtype) == (True, "bf16")
    assert dry_run(path) == 0, capsys.readouterr().err
    path.write_text(path.read_text().replace("reduce_dtype: bf16", "reduce_dtype: fp16"))
    assert dry_run(path) == 2
    assert "reduce_dtype='fp16' (gradients reduce in one of float32, fp32" in capsys.readouterr().err


def test_gap7_use_remove_padding_is_sequence_packing(tmp_path, capsys):
    path = roll_file(tmp_path)
    path.write_text(
        path.read_text().replace(
            "  worker_cls: roll.pipeline.base_worker.ActorWorker", "  use_remove_padding: true"
        )
    )
    assert load_config(path).actor_train.strategy_args.strategy_config.sequence_packing is True
    assert dry_run(path) == 0, capsys.readouterr().err


def test_gap8_colocated_vllm_sleep_level_2_dry_runs(tmp_path, capsys):
    from roll.pipeline.rlvr.start import refills_on_wake

    path = roll_file(tmp_path, sleep_level=2)
    assert dry_run(path) == 0, capsys.readouterr().err
    colocated = {"actor_train", "actor_infer"}
    assert refills_on_wake(load_config(path), colocated)
    assert not refills_on_wake(load_config(path), {"actor_train"})  # disaggregated: never sleeps
    assert not refills_on_wake(
        load_config(path, ["actor_infer.strategy_args.strategy_config.sleep_level=1"]), colocated
    )


class _Cluster:
    """Records reload/offload/generate calls of a role into the shared event list."""

    def __init__(self, role: str, events: list[str]):
        self.role, self.events, self.dp_size = role, events, 1

    def reload_states(self) -> None:
        self.events.append(f"{self.role}.reload")

    def offload_states(self) -> None:
        self.events.append(f"{self.role}.offload")

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        self.events.append(f"{self.role}.generate")
        rows = len(batch) * params.n
        return Batch.from_dict(
            {"responses": torch.ones(rows, 2, dtype=torch.long), "response_mask": torch.ones(rows, 2)}
        )


def fake_run(refill: bool) -> SimpleNamespace:
    events: list[str] = []
    clusters = {role: _Cluster(role, events) for role in ("actor_train", "actor_infer")}
    return SimpleNamespace(
        events=events,
        config=SimpleNamespace(model_update_frequency=1),
        colocated={"actor_train", "actor_infer"},
        refill_on_wake=refill,
        weight_version=0,
        swaps=SwapTimes(),
        model=clusters.__getitem__,
        model_update=SimpleNamespace(sync=lambda version: events.append(f"sync v{version}") or {}),
        tokenizer=SimpleNamespace(batch_decode=lambda rows, **_: ["" for _ in rows]),
    )


def _step(run) -> None:
    """End of one step and the next one's generation, as run_pipeline orders them."""
    update_inference_weights(run, step=1)
    stages.generate_rollouts(
        run, Batch.from_dict({"prompts": torch.ones(1, 2, dtype=torch.long)}), SamplingParams(n=2)
    )


def test_gap8_sleep_level_2_engine_is_woken_updated_and_used_without_an_offload_between():
    run = fake_run(refill=True)
    _step(run)
    assert run.events == [
        "actor_infer.reload",  # level 2: the weights' memory only
        "sync v1",  # refills the dropped weights (and the KV cache, finish_model_update)
        "actor_train.offload",
        "actor_infer.generate",
        "actor_infer.offload",  # drops the weights again; the next wake refills them
    ]
    assert run.weight_version == 1
    # The refill is timed apart from the wake (both inside time/generate).
    assert {"swap/actor_infer/reload_s", "swap/actor_infer/refill_s"} <= set(run.swaps.take())


def test_sleep_level_1_engine_keeps_the_update_then_offload_order():
    run = fake_run(refill=False)
    _step(run)
    assert run.events == [
        "actor_infer.reload",
        "sync v1",
        "actor_train.offload",
        "actor_infer.offload",  # level 1: the new weights wait in CPU memory
        "actor_infer.reload",
        "actor_infer.generate",
        "actor_infer.offload",
    ]
