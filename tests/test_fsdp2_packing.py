"""fsdp2_train on packed rows and token-budget micro-batches equals the padded path (fp32, CPU).

One rank: log-probs / values (padded vs packed vs a token budget) and one train step's gradients
for every ``loss_agg_mode``. Two gloo ranks: the same rows split across the ranks three ways give
the one-rank gradient (the loss is normalised over the whole mini-batch, not per rank or per
micro-batch). The optimizer step is skipped (gradients are captured at clipping), so every run
starts from the same weights.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import process_group, spawn_ranks
from test_fsdp2_strategy import make_strategy
from tiny_models import VOCAB_SIZE, build_tiny_model_dir
from torch.distributed.tensor import DTensor

from roll.core.batch import Batch
from roll.distributed.strategy.generation import build_generation_batch
from roll.models.microbatch import rebudget
from roll.pipeline.rlvr.algorithms.losses import actor_loss, critic_loss
from roll.pipeline.sft.chat_data import ChatExample, to_sft_batch
from roll.pipeline.sft.stages import sft_loss, step_loss

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
TOL = dict(atol=2e-5, rtol=2e-4)
# FSDP2 ranks must run the same number of micro-batches: one row each on even splits; a token
# budget (which agrees on the count across ranks) on uneven ones.
EVEN = ([[0, 1, 2], [3, 4, 5]], [[5, 0, 3], [1, 2, 4]])
UNEVEN = ([[0], [1, 2, 3, 4, 5]], [[5, 0, 3, 1], [2, 4]])


def ragged_batch(seed: int = 0, rows: int = 6) -> Batch:
    """Left-padded prompts of 2..6 tokens, responses of 1..8 tokens, PPO and critic fields."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, VOCAB_SIZE, (rows, 6), generator=gen)
    mask = torch.ones_like(prompts)
    for i in range(rows):
        mask[i, : (i * 3) % 5] = 0
    responses = [
        torch.randint(5, VOCAB_SIZE, (1 + (i * 5) % 8,), generator=gen).tolist() for i in range(rows)
    ]
    base = Batch.from_dict({"prompts": prompts * mask, "prompt_mask": mask})
    out = build_generation_batch(base, responses, None, 1, 0, 8, temperature=0.8)
    out.tensors["advantages"] = torch.randn(rows, 8, generator=gen)
    out.tensors["old_log_probs"] = -torch.rand(rows, 8, generator=gen) * 6
    out.tensors["ref_log_probs"] = -torch.rand(rows, 8, generator=gen) * 6
    out.tensors["returns"] = torch.randn(rows, 8, generator=gen)
    out.tensors["row_id"] = torch.arange(rows)
    return out


def actor_fn(mode: str):
    return functools.partial(
        actor_loss,
        clip_low=0.2,
        clip_high=0.28,
        dual_clip_c=None,
        loss_agg_mode=mode,
        entropy_coef=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
    )


def capture_grads(strategy) -> dict:
    """Gradients (full tensors) at clipping; the optimizer step is skipped (norm reported as NaN)."""
    box: dict = {}

    def clip() -> float:
        box["grads"] = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in strategy.model.named_parameters()
        }
        return float("nan")

    strategy._clip_gradients = clip
    return box


def grads(strategy, box, micro_batches, loss_fn, **config) -> dict:
    for key, value in {"sequence_packing": False, "max_tokens_per_microbatch": None, **config}.items():
        setattr(strategy.config, key, value)
    strategy.train_step(micro_batches, loss_fn)
    return box["grads"]


def outputs(strategy, batch, **config) -> dict:
    for key, value in {"sequence_packing": False, "infer_max_tokens_per_microbatch": None, **config}.items():
        setattr(strategy.config, key, value)
    if strategy.is_value_model:
        return {"values": strategy.compute_values(batch)}
    return strategy.compute_log_probs(batch)


def assert_close(base: dict, got: dict, what: str) -> None:
    for key in base:
        torch.testing.assert_close(got[key], base[key], **TOL, msg=lambda m, k=key: f"{what}: {k}: {m}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_packing"), seed=0)


@pytest.fixture(scope="module")
def policy(model_dir):
    owns_group = not dist.is_initialized()
    strategy = make_strategy(model_dir, 0, 1)
    yield strategy
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()


def test_log_probs_packed_and_budgeted_equal_padded(policy) -> None:
    batch = ragged_batch()
    base = outputs(policy, batch)
    assert base["log_probs"].abs().sum() > 0
    assert_close(base, outputs(policy, batch, sequence_packing=True), "packed")
    assert_close(base, outputs(policy, batch, infer_max_tokens_per_microbatch=12), "budget")


@pytest.mark.parametrize("mode", MODES)
def test_gradients_packed_and_budgeted_equal_padded(policy, mode: str) -> None:
    box = capture_grads(policy)
    batch = ragged_batch()
    base = grads(policy, box, batch.split(1), actor_fn(mode))
    assert_close(base, grads(policy, box, batch.split(4), actor_fn(mode), sequence_packing=True), "packed")
    budget = grads(policy, box, [batch], actor_fn(mode), max_tokens_per_microbatch=20)
    assert_close(base, budget, "budget")
    one = grads(policy, box, [batch], actor_fn(mode))  # the whole mini-batch in one micro-batch
    assert_close(base, one, "one micro-batch")


def test_value_model_packed_equals_padded(model_dir, policy) -> None:
    critic = make_strategy(model_dir, 0, 1, model_type="value")
    batch = ragged_batch()
    assert_close(outputs(critic, batch), outputs(critic, batch, sequence_packing=True), "values")
    box = capture_grads(critic)
    loss = functools.partial(critic_loss, value_clip=None, loss_agg_mode="token-mean")
    base = grads(critic, box, batch.split(1), loss)
    assert_close(base, grads(critic, box, batch.split(3), loss, sequence_packing=True), "critic packed")


def _two_rank_worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins
        strategy = make_strategy(model_dir, rank, 2)
        box = capture_grads(strategy)
        batch = ragged_batch()
        result = {}
        for mode in MODES:
            for s, split in enumerate(EVEN):
                mine = batch.index(split[rank])
                result[f"{mode}/{s}"] = grads(strategy, box, mine.split(1), actor_fn(mode))
                result[f"{mode}/{s}/budget"] = grads(
                    strategy, box, [mine], actor_fn(mode), sequence_packing=True, max_tokens_per_microbatch=24
                )
            for s, split in enumerate(UNEVEN):
                mine = batch.index(split[rank])
                result[f"{mode}/uneven{s}"] = grads(
                    strategy, box, mine.split(8), actor_fn(mode), max_tokens_per_microbatch=64
                )
        if rank == 0:
            torch.save(result, f"{out}/grads.pt")
        parts = rebudget([batch.index(UNEVEN[0][rank])], 24, dist.group.WORLD)  # 1 row vs 5 rows
        rows = [p["row_id"].tolist() for p in parts]
        torch.save(
            {"rows": rows, "tokens": [int(p["attention_mask"].sum()) for p in parts]},
            f"{out}/balance{rank}.pt",
        )


def test_two_ranks_any_split_give_the_one_rank_gradient(policy, model_dir, tmp_path: Path) -> None:
    spawn_ranks(_two_rank_worker, 2, str(model_dir), str(tmp_path))
    two = torch.load(tmp_path / "grads.pt", weights_only=True)
    box = capture_grads(policy)
    batch = ragged_batch()
    for mode in MODES:
        one = grads(policy, box, [batch], actor_fn(mode))
        for key, value in two.items():
            if key.startswith(f"{mode}/"):
                assert_close(one, value, f"2 ranks {key}")
    # A token budget exchanges rows: both ranks get as many micro-batches and about the same tokens.
    balance = [torch.load(tmp_path / f"balance{r}.pt") for r in range(2)]
    assert sorted(i for b in balance for part in b["rows"] for i in part) == list(range(6))
    assert len(balance[0]["rows"]) == len(balance[1]["rows"])
    assert all(t <= 24 for b in balance for t in b["tokens"])
    longest = int(batch["attention_mask"].sum(1).max())
    assert abs(sum(balance[0]["tokens"]) - sum(balance[1]["tokens"])) <= longest


def test_packing_follows_what_transformers_can_do(policy, monkeypatch) -> None:
    import roll.distributed.strategy.fsdp2_strategy as fsdp2

    policy.config.sequence_packing = None
    assert policy.packing  # null = on with this transformers
    monkeypatch.setattr(fsdp2, "transformers_detects_packing", lambda: False)
    assert not policy.packing
    # sequence_packing: true on such a transformers is refused before launch
    # (tests/test_launch_checks.py), not by a started worker.


def sft_batch(rows: int = 6) -> Batch:
    """Chat rows of 9..19 tokens whose trained tokens (``loss_mask``) have holes, as multi-turn
    conversations do (user turns between answers)."""
    gen = torch.Generator().manual_seed(1)
    examples = []
    for i in range(rows):
        length = 9 + (i * 7) % 11
        ids = torch.randint(5, VOCAB_SIZE, (length,), generator=gen).tolist()
        start = 2 + i % 4
        mask = [0] * start + [1] * (length - start)
        mask[start + 2 : start + 4] = [0, 0]  # a context span between two trained spans
        examples.append(ChatExample(ids, mask, f"rows:{i}"))
    return to_sft_batch(examples, pad_token_id=0)


def test_sft_loss_is_one_token_mean_however_split_or_packed(policy) -> None:
    """The SFT loss weights micro-batches by their trained tokens (``loss_mask``, not every
    response token): per-row micro-batches, packed rows and a token budget give the gradient of
    the whole batch's token mean, and ``step_loss`` reports that mean."""
    box = capture_grads(policy)
    batch = sft_batch()
    assert batch["loss_mask"].sum() < batch["response_mask"].sum()
    one = grads(policy, box, [batch], sft_loss)
    assert_close(one, grads(policy, box, batch.split(1), sft_loss), "per-row micro-batches")
    assert_close(one, grads(policy, box, batch.split(4), sft_loss, sequence_packing=True), "packed")
    assert_close(one, grads(policy, box, [batch], sft_loss, max_tokens_per_microbatch=24), "budget")
    policy.config.sequence_packing, policy.config.max_tokens_per_microbatch = False, None
    whole = policy.train_step([batch], sft_loss)
    rows = policy.train_step(batch.split(1), sft_loss)
    assert step_loss([rows]) == pytest.approx(step_loss([whole]), rel=1e-6)
    assert step_loss([whole]) == pytest.approx(whole["loss"], rel=1e-6)
    assert rows["loss"] != pytest.approx(whole["loss"], rel=1e-3)  # the plain micro-batch mean differs
