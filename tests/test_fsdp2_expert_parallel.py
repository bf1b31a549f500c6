"""fsdp2_train with expert parallelism (``ep_size``) on a tiny Qwen3-MoE: 2 gloo ranks splitting
the 4 experts of each layer (and 4 ranks: 2 EP groups, each slice sharded over 2 ranks) against 1
rank holding all of them, on the same rows: losses, log-probs, gradient norms, weights after 2
steps, the weight export, HF weights loaded into the slices, checkpoints resumed in the same layout
and loaded into other ``ep_size`` values; with Ulysses; a GPU run (marked)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from gloo_ranks import process_group, spawn_ranks
from test_fsdp2_strategy import full_params, global_batch, make_strategy, policy_loss, value_loss
from tiny_models import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, safetensors_dir, save_random_model

torch.set_num_threads(1)
STEPS = 2
NUM_EXPERTS = 4


def tiny_moe_config() -> transformers.Qwen3MoeConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
    )


def run(strategy, steps: int = STEPS) -> dict:
    """``steps`` optimizer steps on this rank's rows (one row per micro-batch)."""
    dp_rank, dp_size, _ = strategy.dp_layout()
    mine = global_batch().chunk(dp_size)[dp_rank].split(1)
    stats = [strategy.train_step(mine, policy_loss) for _ in range(steps)]
    return {"losses": [s["loss"] for s in stats], "grad_norms": [s["grad_norm"] for s in stats]}


def rank_results(model_dir: str, rank: int, world_size: int, out: str, device: str = "cpu", **config) -> dict:
    """Log-probs of this rank's rows, then STEPS steps (a checkpoint after the first), the full
    weights, and the second step again from the checkpoint."""
    strategy = make_strategy(model_dir, rank, world_size, device=device, **config)
    dp_rank, dp_size, _ = strategy.dp_layout()
    result = {"log_probs": strategy.compute_log_probs(global_batch().chunk(dp_size)[dp_rank])["log_probs"]}
    result["local_experts"] = [m.gate_up_proj.shape[0] for m in _experts_modules(strategy)]
    first = run(strategy, 1)
    strategy.save_checkpoint(f"{out}/ckpt")
    result["checkpointed"] = full_params(strategy)
    second = run(strategy, 1)
    result |= {key: first[key] + second[key] for key in first}
    result["params"] = full_params(strategy)
    resumed = make_strategy(model_dir, rank, world_size, device=device, **config)
    resumed.load_checkpoint(f"{out}/ckpt")
    result["resumed"] = run(resumed, 1) | {"params": full_params(resumed)}
    return result


def critic_results(model_dir: str, rank: int, world_size: int, device: str = "cpu", **config) -> dict:
    """A value model (critic) on the MoE model: its values and losses over 2 steps, and the weights."""
    strategy = make_strategy(model_dir, rank, world_size, device=device, model_type="value", **config)
    dp_rank, dp_size, _ = strategy.dp_layout()
    mine = global_batch().chunk(dp_size)[dp_rank]
    values = strategy.compute_values(mine)
    stats = [strategy.train_step(mine.split(1), value_loss) for _ in range(STEPS)]
    losses, norms = [s["loss"] for s in stats], [s["grad_norm"] for s in stats]
    return {"values": values, "losses": losses, "grad_norms": norms, "params": full_params(strategy)}


def _experts_modules(strategy) -> list[torch.nn.Module]:
    return [m for m in strategy.model.modules() if type(m).__name__.endswith("Qwen3MoeExperts")]


def other_layouts(model_dir: str, rank: int, world_size: int, out: str, ep_sizes: tuple[int, ...]) -> dict:
    """The ep_size-2 checkpoint loaded into each of ``ep_sizes`` (DCP reshards the [E, ...] expert
    tensors): the weights as loaded and after one more step."""
    results = {}
    for ep_size in ep_sizes:
        other = make_strategy(model_dir, rank, world_size, ep_size=ep_size)
        other.load_checkpoint(f"{out}/ckpt")
        loaded = full_params(other)
        results[ep_size] = run(other, 1) | {"loaded": loaded, "params": full_params(other)}
    return results


def _ep_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins
        result = rank_results(model_dir, rank, world_size, out, ep_size=2)
        result["other_layouts"] = other_layouts(model_dir, rank, world_size, out, (1,))
        result["critic"] = critic_results(model_dir, rank, world_size, ep_size=2)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        ep = make_strategy(model_dir, rank, world_size, ep_size=2)
        run(ep, 1)
        ep.load_weights(iter(hf.items()))  # full tensors into the expert slices
        result["loaded_hf"] = full_params(ep)
        # Both ranks split each sequence (Ulysses) and the experts: one data-parallel rank.
        ulysses = make_strategy(model_dir, rank, world_size, ep_size=2, ulysses_size=2)
        log_probs = ulysses.compute_log_probs(global_batch())["log_probs"]
        result["ulysses"] = run(ulysses) | {"params": full_params(ulysses), "log_probs": log_probs}
        torch.save(result, f"{out}/rank{rank}.pt")
        dist.barrier()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_random_model(tiny_moe_config(), tmp_path_factory.mktemp("tiny_moe"), std=0.2)


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("one")
    spawn_ranks(_one_rank_worker, 1, str(model_dir), str(out))
    return torch.load(out / "rank0.pt", weights_only=True)


def _one_rank_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):
        result = rank_results(model_dir, rank, world_size, out) | {
            "critic": critic_results(model_dir, rank, world_size)
        }
        torch.save(result, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ep")
    spawn_ranks(_ep_worker, 2, str(model_dir), str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def check_against_one_rank(ranks: list[dict], one: dict, atol: float = 1e-5) -> None:
    """The same training as one rank: the mean loss of each step, every rank's global gradient
    norm, the log-probs of each rank's rows, and the full weights after STEPS steps."""
    assert one["losses"][-1] < one["losses"][0]
    for step, expected in enumerate(one["losses"]):
        assert sum(r["losses"][step] for r in ranks) / len(ranks) == pytest.approx(expected, abs=1e-5)
    for rank in ranks:
        assert rank["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    log_probs = torch.cat([r["log_probs"] for r in ranks])
    assert torch.allclose(log_probs, one["log_probs"], atol=1e-5), float(
        (log_probs - one["log_probs"]).abs().max()
    )
    got, expected = ranks[0]["params"], one["params"]
    assert got.keys() == expected.keys() and got
    for name, tensor in got.items():
        assert tensor.shape == expected[name].shape, name
        assert torch.allclose(tensor, expected[name], atol=atol), (
            name,
            float((tensor - expected[name]).abs().max()),
        )


def test_two_ranks_splitting_the_experts_train_like_one_rank(two_ranks, one_rank):
    assert one_rank["local_experts"] == [NUM_EXPERTS] * 2
    assert all(r["local_experts"] == [NUM_EXPERTS // 2] * 2 for r in two_ranks)  # each holds its half
    check_against_one_rank(two_ranks, one_rank)


def test_a_critic_on_the_moe_model_trains_like_one_rank(two_ranks, one_rank):
    """A value model (the MoE model under a value head) with ep_size 2: values, losses, gradient
    norms and weights as on 1 rank."""
    one = one_rank["critic"]
    values = torch.cat([r["critic"]["values"] for r in two_ranks])
    assert torch.allclose(values, one["values"], atol=1e-5)
    for step, expected in enumerate(one["losses"]):
        assert sum(r["critic"]["losses"][step] for r in two_ranks) / 2 == pytest.approx(expected, abs=1e-5)
    for rank in two_ranks:
        assert rank["critic"]["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    for name, tensor in two_ranks[0]["critic"]["params"].items():
        assert torch.allclose(tensor, one["params"][name], atol=1e-5), name


def test_expert_parallel_composes_with_ulysses(two_ranks, one_rank):
    """ulysses_size 2 x ep_size 2 on 2 ranks: the ranks exchange sequence shards around attention
    and tokens around the experts; rank 0 reports the one data-parallel rank's loss."""
    ulysses = two_ranks[0]["ulysses"]
    assert ulysses["losses"] == pytest.approx(one_rank["losses"], abs=1e-5)
    for rank in two_ranks:
        assert rank["ulysses"]["grad_norms"] == pytest.approx(one_rank["grad_norms"], rel=1e-5)
    assert torch.allclose(ulysses["log_probs"], one_rank["log_probs"], atol=1e-5)
    for name, tensor in ulysses["params"].items():
        assert torch.allclose(tensor, one_rank["params"][name], atol=1e-5), name


def test_the_weight_export_has_every_expert_under_the_checkpoint_names(two_ranks, model_dir):
    """What a model update sends and an export writes: each expert under the names
    ``save_pretrained`` gives it (``mlp.experts.3.gate_proj.weight``; vLLM and SGLang load those),
    not transformers' stacked module parameters (``mlp.experts.gate_up_proj``)."""
    checkpoint = safetensors_dir(model_dir)
    exported = two_ranks[0]["params"]
    assert {n: tuple(t.shape) for n, t in exported.items()} == {
        n: tuple(t.shape) for n, t in checkpoint.items()
    }
    assert any(".experts.1.up_proj.weight" in name for name in exported)
    assert two_ranks[1]["params"] == {}  # only rank 0 yields
    for name, tensor in checkpoint.items():  # the checkpoint loaded by module names comes back whole
        assert torch.equal(two_ranks[0]["loaded_hf"][name], tensor), name


def test_resume_in_the_same_layout_is_bit_identical(two_ranks):
    for rank in two_ranks:
        assert rank["resumed"]["losses"] == rank["losses"][1:]
    for name, tensor in two_ranks[0]["resumed"]["params"].items():
        assert torch.equal(tensor, two_ranks[0]["params"][name]), name


def check_other_layouts(ranks: list[dict], one: dict) -> None:
    """Each load is exact, and the step after it is the uninterrupted 1-rank run's second step."""
    for ep_size, got in ranks[0]["other_layouts"].items():
        for name, tensor in got["loaded"].items():
            assert torch.equal(tensor, ranks[0]["checkpointed"][name]), (ep_size, name)
        for name, tensor in got["params"].items():
            assert torch.allclose(tensor, one["params"][name], atol=1e-5), (ep_size, name)
        losses = [r["other_layouts"][ep_size]["losses"][0] for r in ranks]
        assert sum(losses) / len(losses) == pytest.approx(one["losses"][1], abs=1e-5), ep_size


def test_a_checkpoint_loads_into_another_ep_size(two_ranks, one_rank):
    check_other_layouts(two_ranks, one_rank)


def _four_rank_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):
        result = rank_results(model_dir, rank, world_size, out, ep_size=2)
        result["other_layouts"] = other_layouts(model_dir, rank, world_size, out, (1, 4))
        torch.save(result, f"{out}/rank{rank}.pt")
        dist.barrier()


@pytest.fixture(scope="module")
def four_ranks(model_dir, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ep4")
    spawn_ranks(_four_rank_worker, 4, str(model_dir), str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)]


def test_four_ranks_in_two_expert_groups_with_sharded_slices_train_like_one_rank(four_ranks, one_rank):
    """ep_size 2 on 4 ranks: efsdp_size 2, so each expert slice is also FSDP-sharded (and each
    rank's gradient of it reduce-scattered with the other group's); resumed in its layout and
    loaded into full sharding (ep_size 1) and one expert per rank (ep_size 4)."""
    assert all(r["local_experts"] == [NUM_EXPERTS // 2] * 2 for r in four_ranks)
    check_against_one_rank(four_ranks, one_rank)
    for name, tensor in four_ranks[0]["resumed"]["params"].items():
        assert torch.equal(tensor, four_ranks[0]["params"][name]), name
    check_other_layouts(four_ranks, one_rank)


# ---------------------------------------------------------------------------------------- GPU
def _gpu_worker(rank: int, world_size: int, port: int, model_dir: str, out: str, ep_size: int) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins (nccl)
        result = rank_results(model_dir, rank, world_size, out, device=f"cuda:{rank}", ep_size=ep_size)
        torch.save(result, f"{out}/rank{rank}.pt")


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_expert_parallel_on_two_gpus_trains_like_one_gpu(model_dir, tmp_path):
    """fp32 on CUDA over NCCL: 2 GPUs with ep_size 2 against 1 GPU holding every expert."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    (tmp_path / "ep").mkdir()
    (tmp_path / "one").mkdir()
    spawn_ranks(_gpu_worker, 2, str(model_dir), str(tmp_path / "ep"), 2)
    spawn_ranks(_gpu_worker, 1, str(model_dir), str(tmp_path / "one"), 1)
    one = torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)
    ranks = [torch.load(tmp_path / "ep" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    check_against_one_rank(ranks, one, atol=1e-4)
