"""fsdp2_train: 2 gloo ranks on CPU (torch.multiprocessing spawn) against 1 rank, checkpoints,
weight export; a GPU run (marked gpu) in bf16 with mixed precision."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import process_group, spawn_ranks
from tiny_models import build_tiny_model_dir, encode_prompts
from transformers import AutoModelForCausalLM

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
from roll.core.batch import Batch
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.generation import build_generation_batch
from roll.distributed.strategy.registry import load_strategy_class

torch.set_num_threads(1)
STEPS = 4  # optimizer steps; the checkpoint is taken after STEPS // 2


def global_batch(response_width: int = 6) -> Batch:
    prompts, mask = encode_prompts(["1 + 2 =", "what is 3?", "x", "so 4 * 5 ="], 8)
    gen = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 250, (response_width - i % 2,), generator=gen).tolist() for i in range(4)]
    return build_generation_batch(
        Batch.from_dict({"prompts": prompts, "prompt_mask": mask}),
        responses,
        None,
        1,
        0,
        response_width,
        temperature=0.9,
    )


def policy_loss(outputs: dict[str, torch.Tensor], micro: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    mask = micro["response_mask"].float()
    loss = -(outputs["log_probs"] * mask).sum() / mask.sum()
    return loss, {"entropy": float((outputs["entropy"].detach() * mask).sum() / mask.sum())}


def value_loss(outputs: dict[str, torch.Tensor], micro: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    mask = micro["response_mask"].float()
    return (((outputs["values"] - 1.0) ** 2) * mask).sum() / mask.sum(), {}


def make_strategy(model_dir, rank, world_size, device="cpu", dtype="fp32", schedule=None, **config):
    """``schedule``: (lr_scheduler_type, total optimizer steps) as the driver would hand them over."""
    kind, total = schedule or ("constant", None)
    role = RoleConfig(
        model_args=ModelArgs(
            model_name_or_path=str(model_dir), dtype=dtype, model_type=config.pop("model_type", None)
        ),
        training_args=TrainingArgs(
            learning_rate=config.pop("lr", 1e-2), weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type=kind
        ),
        strategy_args=StrategyArgs("fsdp2_train", strategy_config=config),
        infer_batch_size=2,
    )
    ctx = WorkerContext(
        "actor_train", rank, world_size, rank, torch.device(device), seed=42, total_optimizer_steps=total
    )
    strategy = load_strategy_class("fsdp2_train")(role, ctx)
    strategy.initialize()
    return strategy


def local_micro_batches(rank: int, world_size: int) -> list[Batch]:
    """This rank's rows of the global batch, one row per micro-batch (same split for any world size)."""
    return global_batch().chunk(world_size)[rank].split(1)


def train(strategy, steps: int, micro_batches: list[Batch]) -> list[float]:
    return [strategy.train_step(micro_batches, policy_loss)["loss"] for _ in range(steps)]


def full_params(strategy) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in strategy.iter_hf_weights()}


def _two_rank_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins
        micro = local_micro_batches(rank, world_size)
        first = make_strategy(model_dir, rank, world_size)
        losses = train(first, STEPS // 2, micro)
        first.save_checkpoint(f"{out}/ckpt")
        losses += train(first, STEPS - STEPS // 2, micro)
        uninterrupted = full_params(first)
        names = [(name, tuple(t.shape), t.dtype) for name, t in uninterrupted.items()]
        first.save_hf_checkpoint(f"{out}/hf")
        logps = first.compute_log_probs(global_batch().chunk(world_size)[rank])["log_probs"]

        resumed = make_strategy(model_dir, rank, world_size)
        resumed.load_checkpoint(f"{out}/ckpt")
        assert resumed.step == STEPS // 2
        train(resumed, STEPS - STEPS // 2, micro)
        after_resume = full_params(resumed)

        replicas = make_strategy(model_dir, rank, world_size, sharding="no_shard")
        train(replicas, STEPS, micro)
        no_shard = full_params(replicas)
        if rank == 0:
            result = {
                "losses": losses,
                "params": uninterrupted,
                "resumed": after_resume,
                "no_shard": no_shard,
            }
            torch.save(
                {**result, "names": [(n, s, str(d)) for n, s, d in names], "logps0": logps},
                f"{out}/result.pt",
            )
        else:
            assert names == [] and after_resume == {} and no_shard == {}  # only rank 0 yields
            torch.save({"losses": losses, "logps1": logps}, f"{out}/result_rank1.pt")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def two_rank_result(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2_two_ranks")
    spawn_ranks(_two_rank_worker, 2, str(model_dir), str(out))
    result = torch.load(out / "result.pt", weights_only=True)
    result["rank1"] = torch.load(out / "result_rank1.pt", weights_only=True)
    result["out"] = out
    return result


@pytest.fixture(scope="module")
def one_rank(model_dir):
    """A 1-rank strategy in this process (it creates a process group on a free port)."""
    owns_group = not dist.is_initialized()
    strategy = make_strategy(model_dir, 0, 1)
    yield strategy
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()


def test_two_ranks_train_like_one_rank(two_rank_result, one_rank):
    losses = train(one_rank, STEPS, local_micro_batches(0, 1))
    assert losses[-1] < losses[0]
    # Each rank reports its own rows' mean loss; their mean is the 1-rank loss.
    two = [(a + b) / 2 for a, b in zip(two_rank_result["losses"], two_rank_result["rank1"]["losses"])]
    assert two == pytest.approx(losses, abs=1e-5)
    params = full_params(one_rank)
    for name, tensor in two_rank_result["params"].items():
        assert torch.allclose(tensor, params[name], atol=1e-5), name
    for name, tensor in two_rank_result["no_shard"].items():
        assert torch.allclose(tensor, params[name], atol=1e-5), name


def test_checkpoint_resume_is_bit_identical(two_rank_result):
    assert two_rank_result["resumed"].keys() == two_rank_result["params"].keys()
    for name, tensor in two_rank_result["params"].items():
        assert torch.equal(two_rank_result["resumed"][name], tensor), name


def test_hf_weights_match_the_hf_state_dict_and_export_loads(two_rank_result, model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = [(name, tuple(t.shape), str(t.dtype)) for name, t in hf.state_dict().items()]
    assert two_rank_result["names"] == expected
    hf.load_state_dict(two_rank_result["params"])
    exported = AutoModelForCausalLM.from_pretrained(two_rank_result["out"] / "hf", dtype=torch.float32)
    batch = global_batch()
    with torch.no_grad():
        assert torch.equal(
            exported(input_ids=batch["input_ids"]).logits, hf.eval()(input_ids=batch["input_ids"]).logits
        )
    assert (two_rank_result["out"] / "hf" / "tokenizer.json").is_file()
    # compute_log_probs after training, per rank, equals a forward of the exported model.
    from roll.models.logprobs import response_log_probs

    with torch.no_grad():
        expected_logps = response_log_probs(exported.eval(), batch, temperature=0.9)["log_probs"]
    got = torch.cat([two_rank_result["logps0"], two_rank_result["rank1"]["logps1"]])
    assert torch.allclose(got, expected_logps, atol=1e-5)


def _gather_worker(rank: int, world_size: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from roll.distributed.strategy.fsdp2_gather import gather_dim0_shards

    with process_group(rank, world_size, port):
        mesh = init_device_mesh("cpu", (world_size,))
        gen = torch.Generator().manual_seed(0)
        # Uneven splits (5 rows: 3 + 2), a rank with no rows (1 row), more dims.
        fulls = [torch.randn(shape, generator=gen) for shape in ((5, 3), (1,), (4,), (7, 2, 2))]
        shards = [distribute_tensor(full, mesh, [Shard(0)]) for full in fulls]
        gathered = gather_dim0_shards(shards, torch.device("cpu"), mesh.get_group())
        assert all(torch.equal(g, f) for g, f in zip(gathered, fulls))
        assert all(torch.equal(g, s.full_tensor()) for g, s in zip(gathered, shards))
        Path(out, f"ok{rank}").touch()


def test_grouped_gather_of_uneven_shards_equals_full_tensor(tmp_path):
    spawn_ranks(_gather_worker, 2, str(tmp_path))
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def test_no_reshard_after_forward_trains_alike_and_leaves_no_forward_gathered(model_dir, one_rank, tmp_path):
    from torch.distributed.tensor import DTensor

    kept = make_strategy(model_dir, 0, 1, reshard_after_forward=False)
    default = make_strategy(model_dir, 0, 1)
    for strategy in (kept, default):
        strategy.compute_log_probs(global_batch())  # a forward without backward
        assert all(isinstance(p, DTensor) for p in strategy.model.parameters())
    assert train(kept, 2, local_micro_batches(0, 1)) == train(default, 2, local_micro_batches(0, 1))
    kept.compute_log_probs(global_batch())
    kept.save_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(full_params(kept)[k], v) for k, v in full_params(default).items())


def test_value_model_trains(model_dir, one_rank):
    critic = make_strategy(model_dir, 0, 1, model_type="value", lr=1e-2)
    micro = local_micro_batches(0, 1)
    losses = [critic.train_step(micro, value_loss)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    values = critic.compute_values(global_batch())
    assert values.shape == global_batch()["responses"].shape


def test_schedule_offload_load_weights_and_errors(model_dir, one_rank, tmp_path):
    strategy = make_strategy(model_dir, 0, 1, schedule=("linear", 2))
    micro = local_micro_batches(0, 1)
    lrs = [strategy.train_step(micro, policy_loss)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([1e-2, 5e-3, 0.0])
    strategy.offload_states()
    strategy.reload_states()
    assert strategy.train_step(micro, policy_loss)["skipped"] == 0.0
    other = AutoModelForCausalLM.from_pretrained(
        build_tiny_model_dir(tmp_path / "other", seed=1), dtype=torch.float32
    )
    strategy.load_weights(iter(other.state_dict().items()))
    loaded = full_params(strategy)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in other.state_dict().items())
    with pytest.raises(KeyError, match="model.extra.weight"):
        strategy.load_weights(iter([("model.extra.weight", torch.zeros(2))]))
    with pytest.raises(ValueError, match="model.norm.weight"):
        strategy.load_weights(iter([("model.norm.weight", torch.zeros(3))]))
    with pytest.raises(ValueError, match="at least one micro-batch"):
        strategy.train_step([], policy_loss)
    with pytest.raises(FileNotFoundError, match="not an fsdp2_train checkpoint"):
        strategy.load_checkpoint(str(Path(model_dir)))
    cosine = RoleConfig(
        model_args=strategy.role_config.model_args,
        training_args=TrainingArgs(lr_scheduler_type="cosine"),
        strategy_args=StrategyArgs("fsdp2_train"),
    )
    unset = load_strategy_class("fsdp2_train")(cosine, replace(strategy.ctx, total_optimizer_steps=None))
    unset.initialize()
    with pytest.raises(ValueError, match="set WorkerContext.total_optimizer_steps"):
        unset.train_step(micro, policy_loss)


# ------------------------------------------------------------------------------------------ GPU
def _gpu_worker(rank: int, world_size: int, port: int, model_dir: str, out: str, config: dict) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins (nccl)
        strategy = make_strategy(model_dir, rank, world_size, device=f"cuda:{rank}", dtype="bf16", **config)
        micro = local_micro_batches(rank, world_size)
        losses = [strategy.train_step(micro, policy_loss)["loss"] for _ in range(4)]
        strategy.offload_states()
        strategy.reload_states()
        losses.append(strategy.train_step(micro, policy_loss)["loss"])
        strategy.save_checkpoint(f"{out}/ckpt")
        before = full_params(strategy)
        restored = make_strategy(model_dir, rank, world_size, device=f"cuda:{rank}", dtype="bf16", **config)
        restored.load_checkpoint(f"{out}/ckpt")
        after = full_params(restored)
        if rank == 0:
            assert all(t.dtype == torch.bfloat16 and t.is_cuda for t in before.values())
            assert all(torch.equal(before[k], after[k]) for k in before)
            torch.save({"losses": losses}, f"{out}/gpu_result.pt")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "world_size",
    [1, pytest.param(2, marks=[pytest.mark.multigpu])],
)
@pytest.mark.parametrize("config", [{}, {"cpu_offload": True}, {"sharding": "no_shard"}])
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp2_on_gpus_bf16(model_dir, tmp_path, world_size, config):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    spawn_ranks(_gpu_worker, world_size, str(model_dir), str(tmp_path), config)
    losses = torch.load(tmp_path / "gpu_result.pt", weights_only=True)["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def _reduce_dtype_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    """One step's reduced gradients with fp32 and bf16 gradient reduction, then bf16 training."""
    with process_group(rank, world_size, port, init=False):  # the strategy joins
        micro = local_micro_batches(rank, world_size)
        grads = {}
        for reduce_dtype in ("fp32", "bf16"):
            strategy = make_strategy(model_dir, rank, world_size, reduce_dtype=reduce_dtype)
            clip = strategy._clip_gradients

            def record(clip=clip, strategy=strategy, key=reduce_dtype) -> float:
                full = [p.grad.full_tensor().clone() for p in strategy.model.parameters()]
                grads.setdefault(key, full)  # the first step's: both start from the same weights
                return clip()

            strategy._clip_gradients = record
            losses = train(strategy, STEPS, micro)
        if rank == 0:
            torch.save({"grads": grads, "bf16_losses": losses}, f"{out}/reduce.pt")


def test_bf16_gradient_reduction_trains_close_to_fp32(model_dir, tmp_path):
    """fsdp2 reduce_dtype: bf16 (ROLL's reduce_dtype) on 2 gloo ranks: every gradient within 1% (in
    norm) of the fp32-reduced one, not identical to it (the bf16 path ran), and the loss falls."""
    spawn_ranks(_reduce_dtype_worker, 2, str(model_dir), str(tmp_path))
    result = torch.load(tmp_path / "reduce.pt", weights_only=True)
    fp32, bf16 = result["grads"]["fp32"], result["grads"]["bf16"]
    assert len(fp32) == len(bf16) > 0
    for a, b in zip(fp32, bf16):
        assert b.dtype == torch.float32  # sharded gradients stay in the parameter dtype
        assert (b - a).norm() <= 1e-2 * a.norm() + 1e-8
    assert any(not torch.equal(a, b) for a, b in zip(fp32, bf16))
    losses = result["bf16_losses"]
    assert losses[-1] < losses[0]
