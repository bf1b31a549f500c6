"""The ``vllm`` strategy against a real vLLM engine on CUDA (skipped without vLLM or a GPU).

What each test checks, on the default example's model shape (tiny Qwen2, bf16):

- generate with n samples: the Batch layout (row ``i * n + j`` = sample j of prompt i) and the
  engine's sampled-token log-probs against transformers' forward on the same weights;
- sampling parameters: top_k=1 equals greedy, stop token ids end responses, min_new_tokens holds;
- prompt scoring (``compute_log_probs``) against transformers;
- seeds: one seed reproduces, another DP rank's seed differs;
- per-request ``generate_one`` and ``abort`` from another thread;
- ``sleep``/``wake_up`` frees the KV cache and weights and brings them back (same greedy output);
- ``load_weights`` (in-process, and by CUDA IPC into TP=2 workers) makes the engine score like the
  new weights;
- a model update through Ray from an fsdp2_train trainer (``ModelUpdateGroup`` between a trainer
  and an engine cluster, as the pipeline builds them): colocated on one GPU (CUDA IPC) and, on 2
  GPUs, disaggregated (NCCL); the sync's checksums agree (``check_update``), versions advance, and
  afterwards the engine's log-probs of a probe batch equal the trainer's within bf16 tolerance
  (before it, they do not: the trainer took a step the engine has not seen).

bf16 tolerance: see tests/engine_gpu.py.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from engine_gpu import (  # noqa: E402
    assert_close,
    check_compute_log_probs_matches_hf,
    check_generate_n_samples_layout_and_logprobs_match_hf,
    check_generate_one_and_abort_from_another_thread,
    check_load_weights_changes_scores_to_the_new_model,
    check_sampling_params_top_k_stop_ids_and_min_tokens,
    free_gib,
    hf_logprobs,
    hf_model,
    prompt_batch,
    save_tiny_model,
)
from engine_gpu import make_strategy as make_engine_strategy  # noqa: E402

from roll.configs.pipeline_config import RLVRConfig  # noqa: E402
from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402

# Ray workers cannot import this test module by name; ship its functions (the loss) by value.
pytest.importorskip("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])


def make_strategy(model_dir: Path, rank: int = 0, **cfg):
    return make_engine_strategy("vllm", model_dir, rank, **cfg)


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_gpu")
    return save_tiny_model(root / "a", seed=0), save_tiny_model(root / "b", seed=1)


@pytest.fixture(scope="module")
def engine(models):
    strategy = make_strategy(models[0], gpu_memory_utilization=0.25, enforce_eager=True, sleep_level=1)
    yield strategy
    del strategy.llm
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ tests


def test_generate_n_samples_layout_and_logprobs_match_hf(engine, models):
    check_generate_n_samples_layout_and_logprobs_match_hf(engine, models)


def test_sampling_params_top_k_stop_ids_and_min_tokens(engine, models):
    check_sampling_params_top_k_stop_ids_and_min_tokens(engine, models)


def test_compute_log_probs_matches_hf(engine, models):
    check_compute_log_probs_matches_hf(engine, models)


def test_seeds_reproduce_and_differ_per_dp_rank(engine, models):
    batch = prompt_batch(models[0])
    params = SamplingParams(n=2, max_new_tokens=16, seed=42, logprobs=False)
    a, b = engine.generate(batch, params), engine.generate(batch, params)
    assert torch.equal(a["responses"], b["responses"])
    # The worker offsets params.seed by its DP rank; another rank's seed gives other samples.
    other = engine.generate(batch, dataclasses.replace(params, seed=43))
    assert not torch.equal(a["responses"], other["responses"])


def test_generate_one_and_abort_from_another_thread(engine, models):
    check_generate_one_and_abort_from_another_thread(engine, models)


def test_sleep_frees_memory_and_wake_restores_outputs(engine, models):
    batch = prompt_batch(models[0])
    greedy = SamplingParams(n=1, max_new_tokens=16, temperature=0.0, logprobs=False)
    before = engine.generate(batch, greedy)
    awake = free_gib()
    engine.offload_states()
    asleep = free_gib()
    print(f"sleep(level=1) freed {asleep - awake:.2f} GiB")
    assert asleep - awake > 1.0, f"sleep freed only {asleep - awake:.2f} GiB"
    engine.reload_states()
    assert free_gib() < asleep - 1.0
    assert torch.equal(engine.generate(batch, greedy)["responses"], before["responses"])


def test_load_weights_in_process_changes_scores_to_the_new_model(engine, models):
    check_load_weights_changes_scores_to_the_new_model(engine, models)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_2_generates_scores_and_loads_by_ipc(models, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0,1"))
    tp = make_strategy(models[0], tensor_parallel_size=2, gpu_memory_utilization=0.25, enforce_eager=True)
    try:
        out = tp.generate(prompt_batch(models[0]), SamplingParams(n=2, max_new_tokens=20, seed=4))
        assert_close(
            out["infer_logprobs"], hf_logprobs(hf_model(models[0]), out), out["response_mask"], "TP2 generate"
        )
        new = hf_model(models[1])
        tp.load_weights((name, t) for name, t in new.state_dict().items())  # CUDA IPC into both workers
        assert_close(
            tp.compute_log_probs(out)["log_probs"], hf_logprobs(new, out), out["response_mask"], "TP2 load"
        )
    finally:
        del tp.llm
        torch.cuda.empty_cache()


# ------------------------------------------------------------------- model update through Ray


def _policy_loss(outputs, micro):
    mask = micro["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}


def _update_config(model_dir: Path, infer_devices: list[int]) -> RLVRConfig:
    """fsdp2_train on GPU 0 (bf16 compute, fp32 master weights) -> vllm on ``infer_devices``."""

    def role(strategy: str, devices: list[int], **strategy_config) -> RoleConfig:
        args = StrategyArgs(strategy, strategy_config=strategy_config)
        return RoleConfig(
            model_args=ModelArgs(model_name_or_path=str(model_dir), dtype="bf16"),
            training_args=TrainingArgs(learning_rate=0.05),
            strategy_args=args,
            device_mapping=devices,
            infer_batch_size=4,
        )

    engine = {"gpu_memory_utilization": 0.2, "enforce_eager": True, "sleep_level": 1, "max_model_len": 128}
    return RLVRConfig(
        actor_train=role("fsdp2_train", [0], mixed_precision=True),
        actor_infer=role("vllm", infer_devices, **engine),
        num_gpus_per_node=max(infer_devices) + 1,
        device="cuda",
        model_update_buffer_size_mb=1,  # several buckets for the tiny model
        model_update_probe_size=0,  # the test probes itself, before and after the sync
    )


def _run_ray_model_update(model_dir: Path, infer_devices: list[int]) -> None:
    import ray
    from transformers import AutoConfig

    from roll.distributed.model_update.group import ModelUpdateGroup
    from roll.distributed.model_update.probe import build_probe_batch
    from roll.distributed.model_update.worker_mixin import ModelUpdateReceiverMixin, ModelUpdateSenderMixin
    from roll.distributed.scheduler.placement import plan_placement
    from roll.distributed.scheduler.resource_manager import ResourceManager
    from roll.pipeline.workers.model_worker import ModelCluster, ModelWorker

    if ray.is_initialized():
        ray.shutdown()
    config = _update_config(model_dir, infer_devices)
    plan = plan_placement(config)
    rm = ResourceManager(plan, "cuda", log_to_driver=False)
    try:
        train = ModelCluster(
            "actor_train", ModelWorker, rm, plan.roles["actor_train"], config.actor_train, config
        )
        infer = ModelCluster(
            "actor_infer", ModelWorker, rm, plan.roles["actor_infer"], config.actor_infer, config
        )
        train.initialize(10)
        infer.initialize()
        group = ModelUpdateGroup(train, infer, config)
        group.setup()
        colocated = [bool(spec.local_receivers) for spec in group.specs]
        assert colocated == [infer_devices == [0]], f"links {group.specs}"
        probe = build_probe_batch(AutoConfig.from_pretrained(model_dir).vocab_size, size=4, seed=0)

        def trainer_logprobs():
            outs = train.call(ModelUpdateSenderMixin.model_update_probe_log_probs, probe)
            return next(out for out in outs if out is not None)

        train.train_step(probe, _policy_loss, seed=1)  # moves the trainer away from the engine
        want = trainer_logprobs()
        [stale] = infer.call(ModelUpdateReceiverMixin.model_update_probe_log_probs, probe)
        with pytest.raises(AssertionError):  # the step is larger than the bf16 tolerance
            assert_close(stale, want, probe["response_mask"], "engine before the update")

        metrics = group.sync(version=1)  # raises ModelUpdateError on any checksum mismatch
        assert metrics["model_update/version_train"] == metrics["model_update/version_infer"] == 1
        assert metrics["model_update/bytes"] > 0
        assert infer.model_update_version() == [1]
        [fresh] = infer.call(ModelUpdateReceiverMixin.model_update_probe_log_probs, probe)
        assert_close(fresh, want, probe["response_mask"], "engine after the update")
        infer.shutdown()
        train.shutdown()
    finally:
        rm.destroy()
        ray.shutdown()


@pytest.mark.timeout(600)
def test_ray_model_update_fsdp2_to_vllm_colocated(models):
    """Trainer and engine on GPU 0: the buckets reach the engine by CUDA IPC."""
    _run_ray_model_update(models[0], infer_devices=[0])


@pytest.mark.multigpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ray_model_update_fsdp2_to_vllm_disaggregated(models):
    """Trainer on GPU 0, engine on GPU 1: the buckets cross by NCCL broadcast."""
    _run_ray_model_update(models[0], infer_devices=[1])
