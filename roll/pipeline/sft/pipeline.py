"""The SFT step loop: ``actor_train`` (fsdp2_train or megatron_train) trained on chat data.

    config = load_sft_config("examples/config/sft_config.yaml")
    check_sft_config(config)             # roll.launch.checks, as the launcher does
    run_dir = run_sft_pipeline(config)   # metrics.jsonl, curves, checkpoints/, hf_model/

Each step draws ``per_device_train_batch_size x gradient_accumulation_steps x DP`` conversations
(epochs of shuffled rows from a generator seeded with ``seed``) and takes one optimizer step on
the mean negative log-likelihood of all their assistant tokens (one token mean over the step,
whatever the micro-batches, ranks or packing). Every ``eval_steps`` the held-out loss
(and, with ``generation_eval``, sampled accuracy) is logged. Checkpoints reuse the RLVR machinery
(``roll.pipeline.common.checkpoint``: manifest, atomic rename, verified resume) and hold the
trainer's states, the sampler position and the RNG, so a resumed run continues bit-identically.
"""

from __future__ import annotations

import logging
from pathlib import Path

from roll.configs.sft_config import SFTPipelineConfig
from roll.pipeline.common.checkpoint import checkpoint_root, read_state, resolve_resume, save_checkpoint
from roll.pipeline.common.output_dir import claim_output_dir
from roll.pipeline.common.run_log import setup_logging
from roll.pipeline.common.timing import StageTimer
from roll.pipeline.sft.chat_data import to_sft_batch
from roll.pipeline.sft.run import SFTRun, build_sft_run, shutdown_sft_run
from roll.pipeline.sft.stages import generation_accuracy, sft_loss, step_loss, validation_loss
from roll.utils.atomic_io import write_dir_durably
from roll.utils.rng import rng_state, set_rng_state

logger = logging.getLogger("roll")


def run_sft_pipeline(config: SFTPipelineConfig) -> Path:
    """Train for ``config.max_steps`` steps, validate, checkpoint, export; returns the run directory."""
    run = None
    lock = claim_output_dir(config)
    try:
        setup_logging(Path(config.output_dir))
        checkpoint = resolve_resume(config)  # verified against its manifest before any model loads
        run = build_sft_run(config)
        start = resume(run, checkpoint)
        run.tracker = _tracker(run, start)
        if start == 0 and config.eval_steps:
            run.tracker.log(evaluate(run), step=0)
        for step in range(start + 1, config.max_steps + 1):
            timer = StageTimer()
            rows = run.sampler.take()
            batch = to_sft_batch([run.train[i] for i in rows], run.tokenizer.pad_token_id)
            with timer("train"):
                per_rank = run.trainer.train_step(batch, sft_loss, seed=config.seed + step)
            metrics = {
                f"train/{k}": sum(m[k] for m in per_rank) / len(per_rank)
                for k in per_rank[0]
                if k not in ("loss", "nll_sum", "loss_tokens")
            }
            metrics["train/loss"] = step_loss(per_rank)
            metrics["train/tokens"] = float(batch["loss_mask"].sum())
            if config.eval_steps and (step % config.eval_steps == 0 or step == config.max_steps):
                with timer("validation"):
                    metrics |= evaluate(run)
            run.tracker.log(metrics | timer.metrics(), step)
            if config.save_steps and step % config.save_steps == 0:
                save_step(run, step)
        finish(run)
        return run.run_dir
    finally:
        shutdown_sft_run(run)
        lock.release()


def evaluate(run: SFTRun) -> dict[str, float]:
    metrics = {}
    if run.val:
        metrics["val/loss"] = validation_loss(run)
    if run.config.generation_eval is not None:
        metrics["val/accuracy"] = generation_accuracy(run)
    return metrics


def resume(run: SFTRun, path: Path | None) -> int:
    """Restore the trainer, sampler position and RNG from the verified checkpoint ``path``;
    returns its step (0 when ``path`` is None)."""
    if path is None:
        return 0
    state = read_state(path)
    run.trainer.load_checkpoint(str(path))
    run.sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    logger.info("resumed from %s at step %d", path, state["step"])
    return state["step"]


def save_step(run: SFTRun, step: int) -> Path:
    state = {"step": step, "sampler": run.sampler.state_dict(), "rng": rng_state()}
    path = save_checkpoint(
        checkpoint_root(run.config),
        step,
        state,
        lambda tmp: run.trainer.save_checkpoint(str(tmp)),
        run.config.checkpoint_config.max_to_keep,
    )
    logger.info("checkpoint: %s", path)
    return path


def finish(run: SFTRun) -> None:
    """Export the trained model as a Hugging Face checkpoint (written into ``.tmp-hf_model``,
    renamed into place once complete) and draw the curves."""
    out = run.run_dir / "hf_model"
    with write_dir_durably(out) as tmp:
        run.trainer.save_hf_checkpoint(str(tmp))
        run.tokenizer.save_pretrained(str(tmp))
    plot = run.tracker.finish()
    logger.info("final model: %s; curves: %s", out, plot)


def _tracker(run: SFTRun, start: int):
    from roll.utils.tracking import Tracker

    return Tracker(run.config, run.run_dir, resume_step=start)
