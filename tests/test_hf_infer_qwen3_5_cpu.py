"""Qwen3.5-MoE on hf_infer (transformers' model, CPU, fp32): its log-probs of image rows and a text
row equal transformers' own forward with the 3-D rope positions, and ``generate`` with images
(left-padded prompts through the Gated DeltaNet layers' cache) reports the log-probs a forward
over prompt + response gives."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "megatron"))

from tiny_qwen3_5 import build_tiny_qwen3_5_dir  # noqa: E402
from vl_cases import hf_log_probs, vl_batch  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402


def _hf_infer(model: Path):
    from roll.distributed.strategy.hf_strategy import HFInferStrategy

    config = RoleConfig(
        model_args=ModelArgs(model_name_or_path=str(model), dtype="fp32"),
        strategy_args=StrategyArgs("hf_infer", {}),
        infer_batch_size=2,
    )
    ctx = WorkerContext(
        role="actor_infer", rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), seed=1
    )
    strategy = HFInferStrategy(config, ctx)
    strategy.initialize()
    return strategy


def test_hf_infer_scores_and_generates_qwen3_5_with_images(tmp_path: Path) -> None:
    model = build_tiny_qwen3_5_dir(tmp_path / "model", moe=True)
    batch = vl_batch(model, tmp_path)
    strategy = _hf_infer(model)
    got = strategy.compute_log_probs(batch)["log_probs"]
    assert float((got - hf_log_probs(model, batch)).abs().max()) < 1e-5
    prompts = batch.select(["prompts", "prompt_mask", "multi_modal_inputs", "multi_modal_data"])
    out = strategy.generate(
        prompts, SamplingParams(n=1, max_new_tokens=6, temperature=1.0, seed=0, logprobs=True)
    )
    mask = out["response_mask"].bool()
    scored = strategy.compute_log_probs(out)["log_probs"]
    assert torch.allclose(scored[mask], out["infer_logprobs"][mask], atol=1e-4)
