"""megatron_train / log-prob passes on packed rows and token-budget micro-batches equal the padded
path (fp32, CPU, two gloo ranks, the CPU shims).

TP=2 with sequence parallelism: log-probs (shifted rows vs packed rows, SDPA and FlexAttention
kernels, a token budget) and one train step's gradients for every ``loss_agg_mode`` (one row per
micro-batch unpacked vs packed micro-batches vs a token budget). DP=2: the gradient of the same
rows split across the two ranks three different ways is the same (the loss is normalised over the
whole mini-batch, not per rank or per micro-batch). The optimizer step is replaced by a capture of
the reduced gradients, so every run starts from the same weights.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from two_rank_training import megatron_rank, run_two_ranks, save_tiny_qwen2, train_strategy  # noqa: E402

from roll.core.batch import Batch  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402
from roll.models.megatron.hf_io import unwrap  # noqa: E402
from roll.pipeline.rlvr.algorithms.losses import actor_loss  # noqa: E402

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
TOL = dict(atol=2e-5, rtol=2e-4)


def ragged_batch(seed: int, rows: int = 6) -> Batch:
    """Left-padded prompts of 2..6 tokens, responses of 1..8 tokens, PPO fields."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 259, (rows, 6), generator=gen)
    mask = torch.ones_like(prompts)
    for i in range(rows):
        mask[i, : (i * 3) % 5] = 0
    prompts = prompts * mask
    responses = [torch.randint(3, 259, (1 + (i * 5) % 8,), generator=gen).tolist() for i in range(rows)]
    base = Batch.from_dict({"prompts": prompts, "prompt_mask": mask})
    out = build_generation_batch(base, responses, None, 1, 0, 8, temperature=0.8)
    out.tensors["advantages"] = torch.randn(rows, 8, generator=gen)
    out.tensors["old_log_probs"] = -torch.rand(rows, 8, generator=gen) * 6
    out.tensors["ref_log_probs"] = -torch.rand(rows, 8, generator=gen) * 6
    return out


def loss_fn(mode: str):
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
    """Replace the optimizer step by a copy of the reduced gradients (the weights never change)."""
    box: dict = {}

    def step():
        box["grads"] = {
            n: p.main_grad.detach().clone() for n, p in unwrap(strategy.model[0]).named_parameters()
        }
        return True, 0.0, None

    strategy.optimizer.step = step
    return box


def train_grads(strategy, box, micro_batches, mode, **config) -> dict:
    for key, value in {"sequence_packing": False, "max_tokens_per_microbatch": None, **config}.items():
        setattr(strategy.config, key, value)
    strategy.train_step(micro_batches, loss_fn(mode))
    return box["grads"]


def compare(name: str, base: dict, got: dict) -> list[str]:
    bad = []
    for key in base:
        if not torch.allclose(base[key], got[key], **TOL):
            diff = float((base[key] - got[key]).abs().max())
            bad.append(f"{name}: {key} differs by {diff:.3g}")
    return bad


def log_probs(strategy, batch, **config) -> torch.Tensor:
    for key, value in {"sequence_packing": False, "infer_max_tokens_per_microbatch": None, **config}.items():
        setattr(strategy.config, key, value)
    return strategy.compute_log_probs(batch)["log_probs"]


def set_kernel(strategy, kind: str) -> None:
    from roll.models.megatron.layer_spec import SDPAttention

    for module in unwrap(strategy.model[0]).modules():
        if isinstance(module, SDPAttention):
            module.packing_attention = kind


def check_tp2(path: str) -> list[str]:
    strategy = train_strategy(path, {"tensor_model_parallel_size": 2, "sequence_parallel": True})
    batch = ragged_batch(0)
    bad = []
    base = log_probs(strategy, batch)
    assert base.abs().sum() > 0
    for name, config in {
        "packed": {"sequence_packing": True},
        "budget": {"sequence_packing": True, "infer_max_tokens_per_microbatch": 16},
    }.items():
        got = log_probs(strategy, batch, **config)
        if not torch.allclose(base, got, **TOL):
            bad.append(f"log-probs {name} differ by {float((base - got).abs().max()):.3g}")
    set_kernel(strategy, "flex")
    got = log_probs(strategy, batch, sequence_packing=True)
    set_kernel(strategy, "sdpa")
    if not torch.allclose(base, got, **TOL):
        bad.append(f"log-probs flex differ by {float((base - got).abs().max()):.3g}")
    box = capture_grads(strategy)
    for mode in MODES:
        ref = train_grads(strategy, box, batch.split(1), mode)
        packed = train_grads(strategy, box, batch.split(3), mode, sequence_packing=True)
        budget = train_grads(
            strategy, box, [batch], mode, sequence_packing=True, max_tokens_per_microbatch=20
        )
        bad += compare(f"TP2 {mode} packed", ref, packed) + compare(f"TP2 {mode} budget", ref, budget)
    return bad


def check_dp2(path: str) -> list[str]:
    """The same 6 rows split over the two DP ranks three ways give one gradient."""
    strategy = train_strategy(path, {})
    box = capture_grads(strategy)
    batch = ragged_batch(1)
    rank = dist.get_rank()
    splits = ([[0, 1, 2], [3, 4, 5]], [[0], [1, 2, 3, 4, 5]], [[5, 0, 3, 1], [2, 4]])
    bad = []
    for mode in MODES:
        grads = []
        for split in splits:
            mine = batch.index(split[rank])
            grads.append(train_grads(strategy, box, mine.split(1), mode))
            packed = train_grads(
                strategy, box, [mine], mode, sequence_packing=True, max_tokens_per_microbatch=64
            )
            bad += compare(f"DP2 {mode} split {split} packed", grads[-1], packed)
        bad += compare(f"DP2 {mode} split 2", grads[0], grads[1])
        bad += compare(f"DP2 {mode} split 3", grads[0], grads[2])
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        bad += check_tp2(path) + check_dp2(path)


def test_packed_and_budgeted_match_padded(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "model", layers=2)
    bad = run_two_ranks(_worker, (path, str(tmp_path)), tmp_path)
    assert not bad, "packed / token-budget runs differ from the padded path:\n" + "\n".join(bad)
