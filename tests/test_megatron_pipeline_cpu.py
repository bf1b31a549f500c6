"""End to end on CPU: the rlvr_megatron_2gpus example (megatron_train TP=2 + SP trains,
megatron_infer TP=1 x DP=2 rolls out and scores the reference, all colocated) for 2 steps through
Ray, with the Megatron strategies running on gloo through the test-only shims.

Guards two bugs that hung or corrupted that example on 2 x H200:
- the cluster kept the DP layout read before the strategies existed, so megatron_train's two TP
  peers got different DP chunks and their collectives mismatched (a NCCL hang in step 1);
- a fused parameter (q/k/v, gate/up) whose parts fell into different model-update buckets was not
  written on megatron receivers (1 MB buckets here split the 2 MB model).

The shims reach the Ray workers through ``tests/megatron/ray_cpu_shim/sitecustomize.py`` on
``PYTHONPATH`` with ``ROLL_TEST_MEGATRON_CPU=1`` (a local Ray's workers inherit the driver's
environment). Uses ``output/default_example`` when ``examples/prepare_default_example.py`` has
made it, else makes a quick one (5 warm-start steps: the test checks plumbing, not accuracy).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import check_two_steps, shrunk_example, write_config
from gloo_ranks import process_group, spawn_ranks

from roll.configs.loader import load_config
from roll.pipeline.rlvr.pipeline import run_pipeline

REPO = Path(__file__).resolve().parents[1]


def small_config(tmp: Path, example: Path) -> Path:
    """The 2-GPU Megatron example shrunk for CPU: fp32, 4 prompts x 4 samples, 16 tokens."""
    raw = shrunk_example(
        "rlvr_megatron_2gpus",
        tmp,
        example,
        example / "sft_model",
        4,
        2,
        eval_steps=0,
        save_steps=0,
        response_length=16,
    )
    raw["validation"]["data_args"]["file_name"] = [str(example / "data" / "val.jsonl")]
    return write_config(raw, tmp / "rlvr_megatron_cpu.yaml")


@pytest.mark.slow
def test_megatron_pipeline_two_steps(tmp_path, shimmed_ray, example):
    config = load_config(small_config(tmp_path, example))
    run_dir = run_pipeline(config)

    for row in check_two_steps(run_dir):
        # The 2 MB model crosses a 1 MB bucket boundary, plus TP rank 1's empty bucket.
        assert row["model_update/buckets"] >= 3
    assert (run_dir / "hf_model" / "model.safetensors").is_file()


def test_fused_parameter_split_across_buckets(example):
    """The pipeline's 1 MB buckets happen to cut between whole fused groups of this model, so cut
    one by hand: q_proj in one load_weights call, k_proj/v_proj two calls later."""
    spawn_ranks(_split_update_worker, 1, str(example))


def _split_update_worker(rank: int, world_size: int, port: int, example: str) -> None:

    sys.path.insert(0, str(REPO / "tests" / "megatron"))
    import compat
    from cuda_on_cpu import cuda_on_cpu

    from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs
    from roll.core.errors import CheckpointError
    from roll.core.worker_context import WorkerContext
    from roll.distributed.strategy.megatron_infer_strategy import MegatronInferStrategy
    from roll.models.megatron.hf_io import export_hf_weights

    with process_group(rank, world_size, port):
        compat.apply()
        args = StrategyArgs("megatron_infer", strategy_config={"tensor_model_parallel_size": 1})
        role = RoleConfig(
            model_args=ModelArgs(model_name_or_path=str(Path(example) / "sft_model"), dtype="fp32"),
            strategy_args=args,
            device_mapping=[0],
        )
        with cuda_on_cpu():
            strategy = MegatronInferStrategy(role, WorkerContext("actor_infer", 0, 1, 0, torch.device("cpu")))
            strategy.initialize()
            new = [(name, tensor + 0.01) for name, tensor in export_hf_weights(strategy.chunks)]
            cut = [name for name, _ in new].index("model.layers.0.self_attn.k_proj.weight")
            rest = new[cut:]
            layer0 = [(n, t) for n, t in rest if ".layers.0." in n]
            strategy.load_weights(iter(new[:cut]))
            waiting = dict(strategy._loader.source.files)  # q_proj, copied once when it arrived
            assert "model.layers.0.self_attn.q_proj.weight" in waiting
            # Another link's bucket in between (a real update loads several links, each on its own
            # CUDA stream): the held part must not be copied again there, on the other stream.
            strategy.load_weights(iter([(n, t) for n, t in rest if ".layers.0." not in n]))
            assert all(strategy._loader.source.files[n] is t for n, t in waiting.items())
            strategy.load_weights(iter(layer0))
            strategy.finish_model_update(1)
            held = dict(export_hf_weights(strategy.chunks))
            stale = [name for name, tensor in new if not torch.equal(held[name], tensor)]
            assert not stale, f"not updated: {stale}"
            # What a failed probe's verification pass compares with the trainer's stream.
            shown = dict(strategy.iter_hf_weights())
            assert shown.keys() == held.keys() and all(torch.equal(shown[k], held[k]) for k in held)
            # An update that ends with a fused parameter incomplete is an error, not a stale weight.
            strategy.load_weights(iter(new[:cut]))
            with pytest.raises(CheckpointError, match="q_proj"):
                strategy.finish_model_update(2)
