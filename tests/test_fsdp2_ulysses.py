"""fsdp2_train with Ulysses sequence parallelism (``ulysses_size``): gloo ranks on CPU against one
rank without it, on the same rows, for padded and packed micro-batches; the all-to-all attention
against plain attention (KV heads replicated); a GPU run (marked) over NCCL."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_ranks import process_group, spawn_ranks
from test_fsdp2_strategy import full_params, global_batch, make_strategy, policy_loss, value_loss
from tiny_models import build_tiny_model_dir

from roll.core.batch import Batch
from roll.models.ulysses import UlyssesBatch, set_ulysses_batch, ulysses_attention

torch.set_num_threads(1)
STEPS = 2
# 8 prompt + 7 response columns: 15, not a multiple of the group, so the columns are padded.
RESPONSE_WIDTH = 7


def rows() -> Batch:
    return global_batch(RESPONSE_WIDTH)


def _policy_loss(outputs: dict, micro: Batch, loss_agg_mode: str) -> tuple[torch.Tensor, dict]:
    return policy_loss(outputs, micro)


# A token-mean loss as the RL loss factories bind it: the strategy weights each micro-batch by its
# share of the mini-batch's tokens over all data-parallel ranks (roll.models.microbatch).
token_mean_loss = partial(_policy_loss, loss_agg_mode="token-mean")


def run(strategy, dp_rank: int, dp_size: int) -> dict:
    """Log-probs of this DP rank's rows, then STEPS optimizer steps on them (one row per
    micro-batch, so the reported loss, a mean over micro-batches, splits over DP ranks)."""
    mine = rows().chunk(dp_size)[dp_rank]
    out = strategy.compute_log_probs(mine)
    grads = record_first_gradients(strategy)
    steps = [strategy.train_step(mine.split(1), token_mean_loss) for _ in range(STEPS)]
    return {
        "log_probs": out["log_probs"],
        "entropy": out["entropy"],
        "losses": [s["loss"] for s in steps],
        "grad_norms": [s["grad_norm"] for s in steps],
        "grads": grads,
        "params": {name: tensor.cpu() for name, tensor in full_params(strategy).items()},
    }


def record_first_gradients(strategy) -> dict[str, torch.Tensor]:
    """The full gradients of the first optimizer step, gathered when it is taken (every rank)."""
    grads: dict[str, torch.Tensor] = {}
    step = strategy.optimizer.step

    def recording_step(*args, **kwargs):
        if not grads:
            for name, param in strategy.model.named_parameters():
                grads[name] = param.grad.full_tensor().cpu()
        return step(*args, **kwargs)

    strategy.optimizer.step = recording_step
    return grads


def critic_run(
    model_dir: str, rank: int, world_size: int, packing: bool, ulysses: int = 1, device="cpu"
) -> dict:
    """A critic's values of this DP rank's rows and the gradient norm of one step on them."""
    critic = make_strategy(
        model_dir,
        rank,
        world_size,
        device=device,
        model_type="value",
        sequence_packing=packing,
        ulysses_size=ulysses,
    )
    dp_rank, dp_size, _ = critic.dp_layout()
    mine = rows().chunk(dp_size)[dp_rank]
    values = critic.compute_values(mine)
    return {"values": values, "critic_grad_norm": critic.train_step([mine], value_loss)["grad_norm"]}


def budget_gradients(model_dir: str, rank: int, world_size: int, ulysses: int, device="cpu") -> dict:
    """First-step gradients with micro-batches re-formed by a token budget over the DP ranks."""
    strategy = make_strategy(
        model_dir,
        rank,
        world_size,
        device=device,
        ulysses_size=ulysses,
        sequence_packing=True,
        max_tokens_per_microbatch=32,
    )
    dp_rank, dp_size, _ = strategy.dp_layout()
    grads = record_first_gradients(strategy)
    strategy.train_step(rows().chunk(dp_size)[dp_rank].split(1), token_mean_loss)
    return grads


def rank_results(model_dir: str, rank: int, world_size: int, ulysses: int, device: str = "cpu") -> dict:
    """Everything this rank computes, padded (False) and packed (True), and with a token budget."""
    result: dict = {}
    for packing in (False, True):
        strategy = make_strategy(
            model_dir, rank, world_size, device=device, ulysses_size=ulysses, sequence_packing=packing
        )
        dp_rank, dp_size, collected = strategy.dp_layout()
        assert (dp_rank, dp_size, collected) == (rank // ulysses, world_size // ulysses, rank % ulysses == 0)
        result[packing] = run(strategy, dp_rank, dp_size)
        result[packing] |= critic_run(model_dir, rank, world_size, packing, ulysses, device)
    result["budget"] = budget_gradients(model_dir, rank, world_size, ulysses, device)
    return result


def _ulysses_worker(rank: int, world_size: int, port: int, model_dir: str, out: str, ulysses: int) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins
        torch.save(rank_results(model_dir, rank, world_size, ulysses), f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def unsplit(model_dir):
    """One rank without Ulysses, padded and packed, in this process."""
    owns_group = not dist.is_initialized()
    result = {}
    for packing in (False, True):
        result[packing] = run(make_strategy(model_dir, 0, 1, sequence_packing=packing), 0, 1)
        result[packing] |= critic_run(model_dir, 0, 1, packing)
    yield result
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()


def check_against_unsplit(out, world_size: int, ulysses: int, reference: dict) -> None:
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
    dp_size = world_size // ulysses
    for packing, ref in ((p, reference[p]) for p in (False, True)):
        got = [r[packing] for r in ranks]
        for key in ("log_probs", "entropy", "values"):
            # every rank of a group holds its DP rank's rows whole
            whole = torch.cat([got[d * ulysses][key] for d in range(dp_size)])
            assert torch.allclose(whole, ref[key], atol=1e-5), (packing, key, (whole - ref[key]).abs().max())
            for r in range(world_size):
                assert torch.allclose(got[r][key], got[r // ulysses * ulysses][key], atol=1e-6)
        for step in range(STEPS):
            # each rank reports its DP rank's loss; their mean over DP ranks is the unsplit loss
            mean = sum(got[d * ulysses]["losses"][step] for d in range(dp_size)) / dp_size
            assert mean == pytest.approx(ref["losses"][step], abs=1e-5), (packing, step)
            for r in range(world_size):
                assert got[r]["grad_norms"][step] == pytest.approx(ref["grad_norms"][step], rel=1e-5)
        assert got[0]["critic_grad_norm"] == pytest.approx(ref["critic_grad_norm"], rel=1e-5)
        check_gradients(got[0]["grads"], ref["grads"], packing)
        if packing:  # the token-budget micro-batches hold other rows; the token-mean gradient is the same
            check_gradients(ranks[0]["budget"], ref["grads"], "budget")
        # Gradients agree to ~5e-8 (summation order); AdamW divides each by sqrt(v) + 1e-8, so an
        # entry near 1e-8 turns that noise into up to ~1e-4 of an lr 1e-2 step: weights to 1e-4.
        for name, tensor in got[0]["params"].items():
            diff = (tensor - ref["params"][name]).abs().max()
            assert torch.allclose(tensor, ref["params"][name], atol=1e-4), (packing, name, diff)


def check_gradients(got: dict, reference: dict, what: object) -> None:
    for name, grad in got.items():
        diff = (grad - reference[name]).abs().max()
        assert torch.allclose(grad, reference[name], rtol=1e-4, atol=1e-6), (what, name, diff)


def test_two_ranks_of_one_ulysses_group_train_like_one_rank(model_dir, unsplit, tmp_path):
    spawn_ranks(_ulysses_worker, 2, str(model_dir), str(tmp_path), 2)
    check_against_unsplit(tmp_path, 2, 2, unsplit)


def test_two_data_parallel_ranks_of_two_ulysses_ranks_train_like_one_rank(model_dir, unsplit, tmp_path):
    spawn_ranks(_ulysses_worker, 4, str(model_dir), str(tmp_path), 2)
    check_against_unsplit(tmp_path, 4, 2, unsplit)


# ---------------------------------------------------------------------------- the attention alone
class _Layer(torch.nn.Module):
    training = False


def _attention_worker(rank: int, world_size: int, port: int, out: str) -> None:
    """Random q/k/v of 4 query heads and 1 KV head (replicated over the 2 ranks), padded rows."""
    with process_group(rank, world_size, port):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, 6, 8, generator=gen, requires_grad=True)
        k = torch.randn(2, 1, 6, 8, generator=gen, requires_grad=True)
        v = torch.randn(2, 1, 6, 8, generator=gen, requires_grad=True)
        key_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
        set_ulysses_batch(UlyssesBatch(dist.group.WORLD, key_mask=key_mask))
        cols = slice(rank * 3, rank * 3 + 3)
        local, _ = ulysses_attention(_Layer(), q[:, :, cols], k[:, :, cols], v[:, :, cols], None)
        grad = torch.randn(2, 6, 4, 8, generator=gen)
        (local * grad[:, cols]).sum().backward()
        torch.save({"out": local.detach(), "grads": [t.grad for t in (q, k, v)]}, f"{out}/attn{rank}.pt")


def test_all_to_all_attention_equals_full_attention_with_replicated_kv_heads(tmp_path):
    spawn_ranks(_attention_worker, 2, str(tmp_path))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 1, 6, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 1, 6, 8, generator=gen, requires_grad=True)
    key_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]).bool()
    mask = torch.ones(6, 6, dtype=torch.bool).tril() & key_mask[:, None, :]
    mask = (mask | torch.eye(6, dtype=torch.bool)).unsqueeze(1)
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    grad = torch.randn(2, 6, 4, 8, generator=gen)
    (full * grad).sum().backward()
    ranks = [torch.load(tmp_path / f"attn{r}.pt", weights_only=True) for r in range(2)]
    assert torch.allclose(torch.cat([r["out"] for r in ranks], dim=1), full.detach(), atol=1e-6)
    for i, tensor in enumerate((q, k, v)):
        summed = ranks[0]["grads"][i] + ranks[1]["grads"][i]  # each rank's part of the gradient
        assert torch.allclose(summed, tensor.grad, atol=1e-6), i


# ---------------------------------------------------------------------------------------- GPU
def _gpu_worker(rank: int, world_size: int, port: int, model_dir: str, out: str, ulysses: int) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins (nccl)
        result = rank_results(model_dir, rank, world_size, ulysses, device=f"cuda:{rank}")
        torch.save(result, f"{out}/rank{rank}.pt")


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ulysses_on_two_gpus_trains_like_one_gpu(model_dir, tmp_path):
    """fp32 on CUDA over NCCL: 2 GPUs with ulysses_size 2 against 1 GPU without it."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    (tmp_path / "sp").mkdir()
    (tmp_path / "one").mkdir()
    spawn_ranks(_gpu_worker, 2, str(model_dir), str(tmp_path / "sp"), 2)
    spawn_ranks(_gpu_worker, 1, str(model_dir), str(tmp_path / "one"), 1)
    reference = torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)
    check_against_unsplit(tmp_path / "sp", 2, 2, reference)
