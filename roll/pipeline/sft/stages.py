"""The SFT loss and the validation stages (held-out loss, optional sampled accuracy)."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from roll.core.batch import Batch
from roll.pipeline.sft.chat_data import to_sft_batch

if TYPE_CHECKING:
    from roll.pipeline.sft.run import SFTRun


def _token_mean_nll(
    outputs: dict[str, torch.Tensor], batch: Batch, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    mask = batch["loss_mask"].to(outputs["log_probs"].dtype)
    nll = -(outputs["log_probs"] * mask).sum()
    loss = nll / mask.sum().clamp(min=1.0)
    return loss, {"nll_sum": float(nll.detach()), "loss_tokens": float(mask.sum())}


# Mean negative log-likelihood of the step's assistant tokens (``loss_mask``). Declared token-mean,
# so the strategies weight each micro-batch by its share of the step's trained tokens over all DP
# ranks (``roll.models.microbatch.loss_weights``): the gradient is that of the token mean over the
# whole step, however rows are split into micro-batches, token-budget micro-batches or packed rows.
# ``nll_sum`` / ``loss_tokens`` let the driver report that same mean (``step_loss``).
sft_loss = functools.partial(_token_mean_nll, loss_agg_mode="token-mean")


def step_loss(per_rank: list[dict[str, float]]) -> float:
    """The step's token-mean NLL from the trainer's per-rank metrics: every rank averages its
    micro-batches' metrics over the same number of micro-batches, so the ratio of the sums is exact."""
    return sum(m["nll_sum"] for m in per_rank) / max(sum(m["loss_tokens"] for m in per_rank), 1e-12)


def validation_loss(run: SFTRun, rows_per_call: int = 64) -> float:
    """Token-mean NLL of the held-out conversations' assistant tokens (no gradient). Calls are
    padded to a multiple of the DP size with rows whose loss mask is zero."""
    dp = run.trainer.dp_size
    size = max(dp, rows_per_call // dp * dp)
    total = tokens = 0.0
    for start in range(0, len(run.val), size):
        examples = run.val[start : start + size]
        batch = to_sft_batch(examples + examples[:1] * (-len(examples) % dp), run.tokenizer.pad_token_id)
        batch.tensors["loss_mask"][len(examples) :] = 0
        log_probs = run.trainer.compute_log_probs(batch)["old_log_probs"]
        total -= float((log_probs * batch["loss_mask"]).sum())
        tokens += float(batch["loss_mask"].sum())
    return total / max(tokens, 1.0)


def generation_accuracy(run: SFTRun) -> float:
    """Mean rule reward of one answer per ``generation_eval`` row, generated with Hugging Face
    ``generate`` from the trainer's current weights (exported to ``<output_dir>/.eval_model``)."""
    from transformers import AutoModelForCausalLM

    from roll.pipeline.rewards.registry import load_reward_fn
    from roll.pipeline.sft.evaluate import accuracy

    gen = run.config.generation_eval
    lines = Path(gen.file_name).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()][: gen.max_samples]
    rows = [
        {"messages": r[run.config.data.messages_key], "ground_truth": str(r[gen.ground_truth])} for r in rows
    ]
    path = run.run_dir / ".eval_model"
    run.trainer.save_hf_checkpoint(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    try:
        return accuracy(
            model,
            run.tokenizer,
            rows,
            gen.temperature,
            gen.max_new_tokens,
            run.config.seed,
            load_reward_fn(gen.reward_fn),
        )
    finally:
        shutil.rmtree(path, ignore_errors=True)
