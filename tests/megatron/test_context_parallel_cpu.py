"""Context parallelism on the plain-torch spec equals CP=1 (fp32, CPU, two gloo ranks, the shims).

The zig-zag attention against the one-process packed attention (outputs and gradients); then
megatron_train with CP=2 against CP=1 (two ranks; and TP2 + SP x CP2 against TP2 + SP x DP2 on four
ranks, marked slow) (DP=2 with both ranks given the same rows, so its reduced
gradient is the whole batch's): log-probs, and one step's reduced gradients for two
``loss_agg_mode``s, with row micro-batches and with a token budget. The optimizer step is replaced
by a capture of the gradients, so every run starts from the same weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from cuda_on_cpu import cuda_hidden  # noqa: E402
from gloo_ranks import spawn_ranks  # noqa: E402
from test_packing_cpu import capture_grads, compare, log_probs, ragged_batch, train_grads  # noqa: E402
from two_rank_training import megatron_rank, run_two_ranks, save_tiny_qwen2, train_strategy  # noqa: E402

from roll.models.context_parallel import cp_packed_attention, zigzag_indices  # noqa: E402
from roll.models.packed_attention import packed_attention  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-4)


def check_attention() -> list[str]:
    rank, group = dist.get_rank(), dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 8, 12, 28, 32], dtype=torch.int32)  # every sequence a multiple of 2 x CP
    q, k, v = (torch.randn(32, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    weights = torch.randn(32, 4, 8, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = packed_attention(*full, cu, 0.3, "sdpa")
    (ref * weights).sum().backward()
    local = zigzag_indices(cu, 2, rank)
    mine = [t[local].clone().requires_grad_(True) for t in (q, k, v)]
    out = cp_packed_attention(*mine, cu, 0.3, group)
    (out * weights[local]).sum().backward()
    bad = [] if torch.allclose(out, ref[local].detach()) else ["zig-zag attention output"]
    for name, got, want in zip("qkv", mine, full):
        if not torch.allclose(got.grad, want.grad[local]):
            bad.append(f"zig-zag attention grad of {name}")
    return bad


def check_strategy(path: str, base: dict | None = None) -> list[str]:
    """CP=2 against CP=1, both with the ``base`` layout (the remaining ranks are DP)."""
    batch, bad, results = ragged_batch(3), [], {}
    for layout in (dict(base or {}), {**(base or {}), "context_parallel_size": 2}):
        strategy = train_strategy(path, layout)
        out = {"logp": log_probs(strategy, batch, sequence_packing=True)}
        out["logp budget"] = log_probs(
            strategy, batch, sequence_packing=True, infer_max_tokens_per_microbatch=24
        )
        box = capture_grads(strategy)
        for mode in ("token-mean", "seq-mean-token-mean"):
            out[mode] = train_grads(strategy, box, batch.split(2), mode, sequence_packing=True)
            out[f"{mode} budget"] = train_grads(
                strategy, box, [batch], mode, sequence_packing=True, max_tokens_per_microbatch=24
            )
        results[layout.get("context_parallel_size", 1)] = out
    for key, base in results[1].items():
        if key.startswith("logp"):
            if not torch.allclose(base, results[2][key], **TOL):
                bad.append(f"CP2 {key} differs by {float((base - results[2][key]).abs().max()):.3g}")
        else:
            bad += compare(f"CP2 {key}", base, results[2][key])
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        bad += check_attention() + check_strategy(path)


def _four_rank_worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        bad += check_strategy(path, {"tensor_model_parallel_size": 2, "sequence_parallel": True})


@pytest.mark.slow  # four processes: about 90 s on two cores
def test_context_parallel_composes_with_tensor_parallel(tmp_path: Path) -> None:
    """TP2 + SP x CP2 against TP2 + SP x DP2 on four ranks."""
    path = save_tiny_qwen2(tmp_path / "model", layers=2)
    with cuda_hidden():
        spawn_ranks(_four_rank_worker, 4, path, str(tmp_path))
    bad = [f"rank {r}: {x}" for r in range(4) for x in (tmp_path / f"rank{r}.txt").read_text().splitlines()]
    assert not bad, "TP2 x CP2 differs from TP2 x DP2:\n" + "\n".join(bad)


def test_context_parallel_matches_one_rank(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "model", layers=2)
    bad = run_two_ranks(_worker, (path, str(tmp_path)), tmp_path)
    assert not bad, "CP=2 differs from CP=1:\n" + "\n".join(bad)
