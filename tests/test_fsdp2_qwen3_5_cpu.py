"""Qwen3.5-MoE on fsdp2_train (transformers' model) with expert parallelism, as ROLL's
qwen3.5-35BA3-sft_fsdp2/sft_config_ep file runs it: two gloo ranks on CPU, ``ep_size: 2`` over the
tiny model's 4 experts (tests/tiny_qwen3_5.py, with ``mtp.*`` tensors as published checkpoints).

- log-probs of image rows and a text row equal transformers' unsplit model (1e-4);
- the weight export (what the model update sends to vLLM, and the HF save) holds the checkpoint's
  tensors under its names (one tensor per expert and projection), bit for bit, without ``mtp.*``;
- a train step has a finite loss and changes the experts of both ranks' slices.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "megatron"))

from gloo_ranks import process_group, spawn_ranks  # noqa: E402
from test_fsdp2_strategy import full_params, make_strategy, policy_loss  # noqa: E402
from tiny_qwen3_5 import build_tiny_qwen3_5_dir  # noqa: E402
from vl_cases import hf_log_probs, vl_batch  # noqa: E402

torch.set_num_threads(1)


def _worker(rank: int, world_size: int, port: int, model_dir: str, out: str) -> None:
    with process_group(rank, world_size, port, init=False):  # the strategy joins
        strategy = make_strategy(model_dir, rank, world_size, ep_size=2)
        batch = torch.load(f"{out}/batch.pt", weights_only=False)
        result = {
            "log_probs": strategy.compute_log_probs(batch)["log_probs"],
            "before": full_params(strategy),
        }
        # Micro-batches with images on both ranks: FSDP2 shards the vision blocks as units, and a rank
        # whose micro-batch has no image would skip their all-gathers (see the report of #30).
        rows = [[0], [1]] if rank == 0 else [[2], [0]]
        result["metrics"] = strategy.train_step([batch.index(r) for r in rows], policy_loss)
        result["after"] = full_params(strategy)
        torch.save(result, f"{out}/rank{rank}.pt")


def test_fsdp2_expert_parallel_qwen3_5_moe_scores_exports_and_trains(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = build_tiny_qwen3_5_dir(tmp_path / "model", moe=True, mtp=True)
    batch = vl_batch(model, tmp_path)
    torch.save(batch, tmp_path / "batch.pt")
    want = hf_log_probs(model, batch)
    spawn_ranks(_worker, 2, str(model), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for result in ranks:
        assert float((result["log_probs"] - want).abs().max()) < 1e-4
        assert torch.isfinite(torch.tensor(result["metrics"]["loss"]))
    stored = {n: t for n, t in load_file(model / "model.safetensors").items() if not n.startswith("mtp.")}
    exported = ranks[0]["before"]
    assert set(exported) == set(stored), sorted(set(exported) ^ set(stored))[:6]
    assert all(torch.equal(exported[n], stored[n]) for n in stored)
    after = ranks[0]["after"]
    for expert in (0, 3):  # one expert of each rank's slice
        name = f"model.language_model.layers.0.mlp.experts.{expert}.down_proj.weight"
        assert not torch.equal(after[name], stored[name]), name


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
