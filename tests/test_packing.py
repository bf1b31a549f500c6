"""The pieces of sequence packing: the packed row layout, attention confined to each sequence,
the token-budget micro-batch planner and the loss weights that keep the mini-batch's aggregation."""

from __future__ import annotations

import random

import pytest
import torch

from roll.configs.build import build_dataclass
from roll.configs.errors import ConfigError
from roll.configs.rl_options import OffPolicyCorrectionConfig, PolicyLossConfig
from roll.configs.strategy_configs import FSDP2Config, MegatronConfig
from roll.core.batch import Batch
from roll.distributed.strategy.generation import build_generation_batch
from roll.models.megatron.forward import packing_enabled
from roll.models.microbatch import (
    deal,
    invert,
    loss_agg_mode_of,
    loss_weights,
    min_micro_batches,
    plan_micro_batches,
    split_by_tokens,
)
from roll.models.packed_attention import packed_attention, resolve_kind, varlen_available
from roll.models.packing import pack_rows, packed_length
from roll.pipeline.rlvr.algorithms.losses import make_actor_loss_fn
from roll.pipeline.rlvr.algorithms.masked import AGG_MODES, agg_loss


def small_batch() -> Batch:
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 4]])
    return build_generation_batch(
        Batch.from_dict({"prompts": prompts, "prompt_mask": (prompts > 0).long()}),
        [[11, 12], [13], [14, 15, 16]],
        None,
        1,
        0,
        3,
    )


def test_pack_rows_layout_positions_segments_and_window() -> None:
    batch = small_batch()
    row = pack_rows(batch, multiple=8)
    assert row.input_ids.tolist() == [[5, 6, 11, 12, 7, 8, 9, 10, 13, 4, 14, 15, 16, 0, 0, 0]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    assert row.cu_seqlens.tolist() == [0, 4, 9, 13, 16]  # the padding tail is a segment of its own
    assert row.num_tokens == 13 and row.max_seqlen == 5
    ids = row.input_ids[0]
    for i in range(3):
        for t in range(int(batch["response_mask"][i].sum())):
            assert ids[row.window[i, t] + 1] == batch["responses"][i, t]  # the column right before
    assert packed_length([batch, batch.index([0])], 8) == 16
    with pytest.raises(ValueError, match="do not fit"):
        pack_rows(batch, length=12)


def _reference(q, k, v, cu, scale):
    """Each sequence on its own, plain softmax attention in float64."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = q[s:e].double(), k[s:e].double(), v[s:e].double()
        ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
    return torch.cat(outs)


def _check_attention(
    kind: str, device: str, backward: bool, dim: int = 8, dtype: torch.dtype = torch.float32
) -> None:
    """``kind`` against the float64 reference, forward and (``backward``) gradients. Fused GPU
    kernels need a head dim of at least 16 (inductor's FlexAttention refused 8); bf16/fp16 runs are
    compared at their own precision."""
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(16, h, dim, generator=gen).to(device, dtype) for h in (4, 2, 2))
    weights = torch.randn(16, 4, dim, generator=gen).to(device, dtype)
    for t in (q, k, v):
        t.requires_grad_(backward)
    out = packed_attention(q, k, v, cu, dim**-0.5, kind)
    ref_inputs = [t.detach().cpu().double().requires_grad_(True) for t in (q, k, v)]
    ref = _reference(*ref_inputs, cu.cpu(), dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=tol, rtol=tol)
    if backward:
        (out * weights).sum().backward()
        (ref * weights.cpu().double()).sum().backward()
        for got, r in zip((q, k, v), ref_inputs):
            torch.testing.assert_close(got.grad.cpu().double(), r.grad, atol=tol * 4, rtol=tol * 4)


def test_packed_attention_stays_inside_each_sequence() -> None:
    _check_attention("sdpa", "cpu", backward=True)
    with torch.no_grad():
        _check_attention("flex", "cpu", backward=False)
    q = torch.zeros(4, 2, 8, requires_grad=True)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="no backward on CPU"):
        packed_attention(q, q, q, cu, 1.0, "flex")
    with pytest.raises(ValueError, match="packing_attention"):
        packed_attention(q, q, q, cu, 1.0, "dense")
    with pytest.raises(ValueError, match="'varlen' runs on CUDA in bf16/fp16"):
        packed_attention(q, q, q, cu, 1.0, "varlen")
    _check_attention("auto", "cpu", backward=True)  # auto is the per-sequence loop on CPU
    assert resolve_kind(q) == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["sdpa", "flex"])
def test_packed_attention_on_cuda(kind: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_attention(kind, "cuda", backward=True, dim=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["varlen", "auto"])
def test_varlen_packed_attention_on_cuda(kind: str) -> None:
    """FlashAttention's varlen kernel (the GPU default) against the reference in bf16, GQA included."""
    assert varlen_available(), "torch.nn.attention.varlen is missing from this torch"
    q = torch.zeros(4, 2, 64, device="cuda", dtype=torch.bfloat16)
    assert resolve_kind(q) == "varlen"
    _check_attention(kind, "cuda", backward=True, dim=64, dtype=torch.bfloat16)


# --------------------------------------------------------------------------------- the planner
@pytest.mark.parametrize("seed", range(5))
def test_plan_respects_the_budget_uses_every_row_once_and_balances(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(8, 60), rng.randint(200, 512)]) for _ in range(64)]
    budget = 1024
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for part in plan for i in part) == list(range(64))
    loads = [sum(lengths[i] for i in part) for part in plan]
    assert max(loads) <= budget
    assert len(plan) == min_micro_batches(lengths, budget) <= -(-sum(lengths) // budget) + 1
    assert max(loads) - min(loads) <= max(lengths)  # LPT: loads differ by at most one row
    more = plan_micro_batches(lengths, budget, len(plan) + 3)  # what a busier DP rank asks for
    assert len(more) == len(plan) + 3 and all(more)
    assert sorted(i for part in more for i in part) == list(range(64))
    assert max(sum(lengths[i] for i in part) for part in more) <= budget


def test_plan_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_microbatch: a sequence of 9 tokens"):
        plan_micro_batches([3, 9], 8)
    with pytest.raises(ValueError, match="3 non-empty micro-batches from 2 rows"):
        plan_micro_batches([3, 4], 8, 3)
    with pytest.raises(ValueError, match="max_tokens_per_microbatch: a sequence of 5 tokens"):
        split_by_tokens(small_batch(), max_tokens=4)


def test_deal_gives_every_rank_as_many_micro_batches_and_about_the_same_tokens() -> None:
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(8, 60), rng.randint(200, 512)]) for _ in range(96)]
    plan = plan_micro_batches(lengths, 1024, 4 * 6)
    loads = [sum(lengths[i] for i in part) for part in plan]
    owner = deal(loads, ranks=4, per_rank=6)
    assert [owner.count(r) for r in range(4)] == [6] * 4
    totals = [sum(load for load, r in zip(loads, owner) if r == rank) for rank in range(4)]
    assert max(totals) - min(totals) <= max(loads)


def test_split_by_tokens_and_invert_restore_the_order() -> None:
    batch = small_batch()
    parts, order = split_by_tokens(batch, max_tokens=6)
    assert all(int(p["attention_mask"].sum()) <= 6 for p in parts) and len(parts) == 3
    joined = Batch.concat(parts)
    assert torch.equal(joined["input_ids"][invert(order)], batch["input_ids"])


# ---------------------------------------------------------------------------------- loss weights
@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_weighted_micro_batch_losses_equal_the_whole_mini_batch_loss(mode: str) -> None:
    gen = torch.Generator().manual_seed(1)
    rows = 7
    mask = (torch.rand(rows, 5, generator=gen) > 0.3).long()
    mask[3] = 0  # a row with no valid token
    losses = torch.randn(rows, 5, generator=gen)
    batch = Batch.from_dict({"response_mask": mask, "loss": losses})
    parts = [batch.index([0, 3]), batch.index([1]), batch.index([2, 4, 5, 6])]
    weights = loss_weights(parts, mode)
    got = sum(w * agg_loss(p["loss"], p["response_mask"], mode) for p, w in zip(parts, weights))
    torch.testing.assert_close(got, agg_loss(losses, mask, mode))
    assert loss_weights(parts, None) == [1 / 3] * 3


def test_loss_agg_mode_is_read_from_the_loss_factories() -> None:
    class Config:
        pg_clip, pg_clip_low, pg_clip_high, dual_clip_loss, dual_clip_c = 0.2, None, None, False, 3.0
        use_kl_loss, kl_loss_type, kl_loss_coef, entropy_loss_coef = False, "k1", 0.0, 0.0
        loss_agg_mode = "seq-mean-token-sum"
        off_policy_correction = OffPolicyCorrectionConfig()
        pg_variant, policy_loss = "ppo", PolicyLossConfig()

    assert loss_agg_mode_of(make_actor_loss_fn(Config())) == "seq-mean-token-sum"
    assert loss_agg_mode_of(lambda outputs, batch: None) is None


# ----------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "cls,data,key",
    [
        (FSDP2Config, {"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch"),
        (MegatronConfig, {"infer_max_tokens_per_microbatch": -5}, "infer_max_tokens_per_microbatch"),
        (
            FSDP2Config,
            {"sequence_packing": False, "max_tokens_per_microbatch": 64},
            "max_tokens_per_microbatch",
        ),
    ],
)
def test_packing_options_are_range_checked(cls, data: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"strategy_config.{key}"):
        build_dataclass(cls, data, "strategy_config")


def test_megatron_packing_kernel_and_backend_checks() -> None:
    from roll.launch.named_values import check_named_values

    with pytest.raises(ConfigError, match="cfg.packing_attention"):
        check_named_values(MegatronConfig(packing_attention="dense"), "cfg")
    with pytest.raises(ConfigError, match="cfg.sequence_packing"):
        MegatronConfig(sequence_packing=True, attention_backend="local").validate(1, "cfg")
    local = MegatronConfig(attention_backend="local")
    local.validate(1, "cfg")
    assert not packing_enabled(local) and not packing_enabled(MegatronConfig())  # null: padded rows
    assert packing_enabled(MegatronConfig(context_parallel_size=2))  # CP runs on packed rows
    assert packing_enabled(MegatronConfig(max_tokens_per_microbatch=4096))
    assert packing_enabled(MegatronConfig(infer_max_tokens_per_microbatch=4096))
    assert not packing_enabled(MegatronConfig(context_parallel_size=2, attention_backend="local"))
    assert packing_enabled(MegatronConfig(sequence_packing=True))
