"""fsdp2_train with HSDP (``fsdp_size``): 4 gloo ranks in 2 shard groups of 2 against 4 ranks fully
sharded and 1 rank, on the same rows; checkpoints into the same and other shard layouts; the weight
export; with Ulysses; a GPU run (marked) of pure replication (``fsdp_size: 1``) over NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import process_group, spawn_ranks
from test_fsdp2_lora import make_lora_strategy
from test_fsdp2_strategy import full_params, global_batch, make_strategy, policy_loss
from tiny_models import build_tiny_model_dir
from transformers import AutoModelForCausalLM

from roll.configs.errors import ConfigError
from roll.utils.safe_unpickle import check_dcp_dir

torch.set_num_threads(1)
STEPS = 2


def run(strategy, steps: int = STEPS) -> dict:
    """``steps`` optimizer steps on this data-parallel rank's rows (one row per micro-batch, so the
    loss each rank reports, a mean over its micro-batches, averages over DP ranks to the 1-rank one)."""
    dp_rank, dp_size, _ = strategy.dp_layout()
    mine = global_batch().chunk(dp_size)[dp_rank].split(1)
    stats = [strategy.train_step(mine, policy_loss) for _ in range(steps)]
    return {"losses": [s["loss"] for s in stats], "grad_norms": [s["grad_norm"] for s in stats]}


def with_params(strategy, result: dict) -> dict:
    """``result`` plus the full weights (rank 0; every rank takes part in the gathers)."""
    return result | {"params": full_params(strategy)}


def check_layout(strategy, mesh_shape: tuple[int, ...]) -> None:
    """The mesh, and each parameter's local rows: 1 / (ranks on the shard axis) of the full ones."""
    assert tuple(strategy.mesh.shape) == mesh_shape, strategy.mesh
    shard = mesh_shape[-1]
    for name, param in strategy.model.named_parameters():
        assert param.to_local().shape[0] == -(-param.shape[0] // shard), name


def _hsdp_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins
        results: dict = {}
        hsdp = make_strategy(model_dir, rank, world_size, fsdp_size=2)
        check_layout(hsdp, (2, 2))
        results["hsdp"] = with_params(hsdp, run(hsdp))
        hsdp.save_checkpoint(f"{out}/ckpt_hsdp")
        full = make_strategy(model_dir, rank, world_size)
        results["full"] = with_params(full, run(full))
        full.save_checkpoint(f"{out}/ckpt_full")
        # One more step each from the saved state: what a resumed run must reproduce (after an
        # offload/reload, which a colocated run does between steps).
        hsdp.offload_states()
        hsdp.reload_states()
        results["hsdp_next"] = with_params(hsdp, run(hsdp, 1))
        for name, ckpt, fsdp_size in (
            ("same", "ckpt_hsdp", 2),  # the same layout
            ("full_to_hsdp", "ckpt_full", 2),  # sharded over 4, loaded into groups of 2
            ("hsdp_to_full", "ckpt_hsdp", None),
            ("hsdp_to_replicas", "ckpt_hsdp", 1),
        ):
            resumed = make_strategy(model_dir, rank, world_size, fsdp_size=fsdp_size)
            check_layout(resumed, {2: (2, 2), None: (4,), 1: (4, 1)}[fsdp_size])
            resumed.load_checkpoint(f"{out}/{ckpt}")
            loaded = full_params(resumed)
            results[name] = with_params(resumed, run(resumed, 1)) | {"loaded": loaded}
        ulysses = make_strategy(model_dir, rank, world_size, fsdp_size=2, ulysses_size=2)
        results["ulysses"] = with_params(ulysses, run(ulysses))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        hsdp.load_weights(iter(hf.items()))  # full tensors into the shards of the 2-D mesh
        results["loaded_hf"] = full_params(hsdp)
        results |= lora_results(model_dir, rank, world_size, out)
        torch.save(results, f"{out}/rank{rank}.pt")


def lora_results(model_dir: str, rank: int, world_size: int, out: str) -> dict:
    """LoRA adapters trained in shard groups of 2 and fully sharded; the HSDP one checkpointed and
    resumed in its layout."""
    results = {}
    for name, config in (("lora_hsdp", {"fsdp_size": 2}), ("lora_full", {})):
        strategy = make_lora_strategy(model_dir, rank, world_size, config)
        results[name] = with_params(strategy, run(strategy))
    strategy.save_checkpoint(f"{out}/ckpt_lora")
    resumed = make_lora_strategy(model_dir, rank, world_size, {"fsdp_size": 2})
    resumed.load_checkpoint(f"{out}/ckpt_lora")
    results["lora_resumed"] = full_params(resumed)
    return results


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def one_rank(model_dir) -> dict:
    """STEPS steps on 1 rank (in this process), then one more."""
    owns_group = not dist.is_initialized()
    strategy = make_strategy(model_dir, 0, 1)
    result = with_params(strategy, run(strategy))
    result["next"] = with_params(strategy, run(strategy, 1))
    yield result
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def four_ranks(model_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hsdp")
    spawn_ranks(_hsdp_worker, 4, str(model_dir), str(out))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)]
    ranks[0]["out"] = out
    return ranks


def mean_losses(ranks: list[dict], key: str, dp_ranks: list[int]) -> list[float]:
    """The loss of each step averaged over one rank per data-parallel rank."""
    per_rank = [ranks[r][key]["losses"] for r in dp_ranks]
    return [sum(step) / len(step) for step in zip(*per_rank)]


def assert_params_close(got: dict, expected: dict, atol: float, what: str) -> None:
    assert got.keys() == expected.keys() and got, what
    for name, tensor in got.items():
        diff = (tensor - expected[name]).abs().max()
        assert torch.allclose(tensor, expected[name], atol=atol), (what, name, float(diff))


def assert_params_equal(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys() and got, what
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), (what, name)


def test_shard_groups_of_two_train_like_full_sharding_and_one_rank(four_ranks, one_rank):
    assert one_rank["losses"][-1] < one_rank["losses"][0]
    for key in ("hsdp", "full"):
        assert mean_losses(four_ranks, key, [0, 1, 2, 3]) == pytest.approx(one_rank["losses"], abs=1e-5)
        for rank in four_ranks:  # the norm is global: every rank reports the same
            assert rank[key]["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-5), key
    hsdp, full = four_ranks[0]["hsdp"], four_ranks[0]["full"]
    assert hsdp["grad_norms"] == pytest.approx(full["grad_norms"], rel=1e-6)
    # Gradients differ from 1 rank's in summation order only (~1e-8); AdamW's division by
    # sqrt(v) + 1e-8 magnifies that for entries near 1e-8, hence 1e-5 on the weights.
    assert_params_close(hsdp["params"], full["params"], 1e-5, "hsdp vs full_shard")
    assert_params_close(hsdp["params"], one_rank["params"], 1e-5, "hsdp vs 1 rank")


def test_only_rank_zero_yields_the_full_weights(four_ranks, one_rank):
    expected = {name: tuple(t.shape) for name, t in one_rank["params"].items()}
    assert {name: tuple(t.shape) for name, t in four_ranks[0]["hsdp"]["params"].items()} == expected
    assert all(rank["hsdp"]["params"] == {} for rank in four_ranks[1:])


def test_the_checkpoint_index_passes_the_resume_check(four_ranks):
    """What a pipeline resume checks before loading (roll.utils.safe_unpickle) reads the 2-D layout."""
    for name in ("ckpt_hsdp", "ckpt_full", "ckpt_lora"):
        check_dcp_dir(four_ranks[0]["out"] / name)


def test_resume_in_the_same_layout_is_bit_identical(four_ranks):
    same = four_ranks[0]["same"]
    assert_params_equal(same["loaded"], four_ranks[0]["hsdp"]["params"], "loaded")
    assert_params_equal(same["params"], four_ranks[0]["hsdp_next"]["params"], "the step after")
    for rank in four_ranks:
        assert rank["same"]["losses"] == rank["hsdp_next"]["losses"]


@pytest.mark.parametrize(
    "name, source", [("full_to_hsdp", "full"), ("hsdp_to_full", "hsdp"), ("hsdp_to_replicas", "hsdp")]
)
def test_a_checkpoint_loads_into_another_shard_layout(four_ranks, one_rank, name, source):
    """torch.distributed.checkpoint reshards: the weights load exactly, and the next step (which
    needs the optimizer state too) is the uninterrupted 1-rank run's."""
    got = four_ranks[0][name]
    assert_params_equal(got["loaded"], four_ranks[0][source]["params"], name)
    assert_params_close(got["params"], one_rank["next"]["params"], 1e-5, name)
    assert mean_losses(four_ranks, name, [0, 1, 2, 3]) == pytest.approx(one_rank["next"]["losses"], abs=1e-5)


def test_shard_groups_compose_with_ulysses(four_ranks, one_rank):
    """fsdp_size 2 x ulysses_size 2 on 4 ranks: 2 data-parallel ranks (0 and 2 report them)."""
    assert mean_losses(four_ranks, "ulysses", [0, 2]) == pytest.approx(one_rank["losses"], abs=1e-5)
    for rank in four_ranks:
        assert rank["ulysses"]["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-5)
    assert_params_close(four_ranks[0]["ulysses"]["params"], one_rank["params"], 1e-4, "ulysses")


def test_full_weights_load_into_the_shard_groups(four_ranks, model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert_params_equal(four_ranks[0]["loaded_hf"], hf, "load_weights")


def test_lora_adapters_train_in_shard_groups_and_resume_across_layouts(four_ranks):
    """The merged weights after 2 steps match full sharding's; the full-sharding checkpoint (adapters
    and their AdamW state) loads into shard groups of 2 exactly."""
    hsdp, full = four_ranks[0]["lora_hsdp"]["params"], four_ranks[0]["lora_full"]["params"]
    assert_params_close(hsdp, full, 1e-5, "lora")
    assert_params_equal(four_ranks[0]["lora_resumed"], full, "lora resumed")
    assert four_ranks[0]["lora_hsdp"]["losses"] == pytest.approx(
        four_ranks[0]["lora_full"]["losses"], abs=1e-6
    )


def test_a_shard_group_that_does_not_divide_the_ranks_is_a_config_error(model_dir, one_rank):
    """A strategy built without the pre-launch check (1 rank, fsdp_size 2) names the key."""
    with pytest.raises(ConfigError, match="2 does not divide the role's 1 ranks") as info:
        make_strategy(model_dir, 0, 1, fsdp_size=2)
    assert info.value.path == "actor_train.strategy_args.strategy_config.fsdp_size"


# ---------------------------------------------------------------------------------------- GPU
def _gpu_worker(rank: int, world_size: int, port: int, model_dir: str, out: str, fsdp_size) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins (nccl)
        strategy = make_strategy(model_dir, rank, world_size, device=f"cuda:{rank}", fsdp_size=fsdp_size)
        result = with_params(strategy, run(strategy))
        result["params"] = {name: tensor.cpu() for name, tensor in result["params"].items()}
        torch.save(result, f"{out}/rank{rank}.pt")


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replicas_on_two_gpus_train_like_one_gpu(model_dir, tmp_path):
    """fp32 over NCCL: 2 GPUs with fsdp_size 1 (pure replication) and 2 (one shard group) against 1 GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = {}
    for name, world_size, fsdp_size in (("one", 1, None), ("replicas", 2, 1), ("sharded", 2, 2)):
        (tmp_path / name).mkdir()
        spawn_ranks(_gpu_worker, world_size, str(model_dir), str(tmp_path / name), fsdp_size)
        results[name] = [torch.load(p, weights_only=True) for p in sorted((tmp_path / name).glob("rank*.pt"))]
    reference = results["one"][0]
    for name in ("replicas", "sharded"):
        ranks = results[name]
        assert [(a + b) / 2 for a, b in zip(*(r["losses"] for r in ranks))] == pytest.approx(
            reference["losses"], abs=1e-5
        )
        assert ranks[0]["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
        assert_params_close(ranks[0]["params"], reference["params"], 1e-4, name)
