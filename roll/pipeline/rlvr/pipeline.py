"""The RLVR step loop. Read ``run_pipeline`` top to bottom: that is the whole algorithm.

config = load_config("examples/config/rlvr_config.yaml")
check_before_launch(config)   # roll.launch.checks: what the launcher checks before any worker starts
run_pipeline(config)
"""

from __future__ import annotations

import logging
from pathlib import Path

from roll.configs.pipeline_config import RLVRConfig
from roll.core.roles import TRAINER_ROLES
from roll.pipeline.common.checkpoint import checkpoint_root, read_state, resolve_resume, save_checkpoint
from roll.pipeline.common.output_dir import claim_output_dir
from roll.pipeline.common.run_log import setup_logging
from roll.pipeline.common.timing import StageTimer
from roll.pipeline.rlvr import stages
from roll.pipeline.rlvr.perf import memory_metrics, record_launch, startup_metrics, throughput_metrics
from roll.pipeline.rlvr.rollout_source import RolloutSource
from roll.pipeline.rlvr.run import RLVRRun
from roll.pipeline.rlvr.start import build_run, shutdown
from roll.utils.atomic_io import write_dir_durably
from roll.utils.gc_pauses import GcPauses
from roll.utils.rng import rng_state, set_rng_state

logger = logging.getLogger("roll")


def run_pipeline(config: RLVRConfig) -> Path:
    """Train, validate and checkpoint for ``config.max_steps`` steps; returns the run directory."""
    run = rollouts = gc_pauses = None
    lock = claim_output_dir(config)  # refuses a second run on output_dir, or one over an old run
    finished = False
    try:
        setup_logging(Path(config.output_dir))
        checkpoint = resolve_resume(config)  # verified against its manifest before any model loads
        startup = StageTimer()
        record_launch(startup)
        run = build_run(config, startup)
        with startup("first_sync"):
            start = resume(run, checkpoint)
        run.tracker = _tracker(run, start)
        first = validate_first(run, start, startup)  # step 0; start-up phases not logged yet
        rollouts = RolloutSource(run)  # async_generation_ratio 1: generates one step ahead
        gc_pauses = GcPauses()  # the driver's garbage-collection pauses, logged per step
        for step in range(start + 1, config.max_steps + 1):
            timer = StageTimer()
            # generate + reward, in DAPO rounds when dynamic_sampling is on; overlong shaping
            # (rollout_dump: written to its dir, or read from there instead in replay mode)
            batch, sampling_metrics = rollouts.take(step, timer)
            with timer("reference"):
                batch = stages.compute_reference_log_probs(run, batch)
            with timer("old_log_probs"):
                batch = stages.compute_old_log_probs(run, batch)  # or the train forward's (auto)
            batch = stages.compute_off_policy_weights(run, batch)
            with timer("values"):
                batch = stages.compute_values(run, batch)
            with timer("advantages"):
                batch, adv_metrics = stages.compute_advantages_stage(run, batch)
            with timer("train"):
                batch, train_metrics = stages.train_models(run, batch, step)
            with timer("wait_rollouts"):
                rollouts.settle()  # async: step + 1 finishes generating before the weights change
            with timer("model_update"):
                update_metrics = update_inference_weights(run, step)
            metrics = stages.rollout_metrics(run, batch) | sampling_metrics
            metrics |= adv_metrics | train_metrics | update_metrics
            if config.eval_steps and (step % config.eval_steps == 0 or step == config.max_steps):
                with timer("validation"):
                    metrics |= stages.run_validation(run, step)
            metrics |= throughput_metrics(run, batch, timer.times) | memory_metrics(run) | run.swaps.take()
            metrics |= gc_pauses.take()
            run.tracker.log(metrics | timer.metrics() | first, step)
            first = {}
            if config.save_steps and step % config.save_steps == 0:
                save_step(run, step, rollouts.sampler_state())
        finish(run)
        finished = True
        return run.run_dir
    finally:
        # After an error or a signal the workers are killed at once (a graceful stop would queue
        # behind calls that may never return), which also ends a rollout thread still waiting.
        shutdown(run, graceful=finished)
        if rollouts is not None:
            rollouts.close()
        if gc_pauses is not None:
            gc_pauses.close()
        lock.release()


def update_inference_weights(run: RLVRRun, step: int, always: bool = False) -> dict[str, float]:
    """Move actor_train's new weights into actor_infer every ``model_update_frequency`` steps
    (``always``: now, e.g. after a resume, whatever the step). An engine that drops its weights
    when it sleeps (``run.refill_on_wake``) gets them when it next wakes to generate instead."""
    if step % run.config.model_update_frequency and not always:
        return {}
    if run.refill_on_wake:  # the engine drops its weights asleep: its next wake loads these
        run.weight_version = step  # (stages.engine_awake)
        return {}
    with stages.on_devices(run, "actor_infer"):
        return stages.sync_engine_weights(run, step)


def validate_first(run: RLVRRun, start: int, startup: StageTimer) -> dict[str, float]:
    """A fresh run validates and logs step 0, with the start-up phases (``startup/*``, also one
    console line); otherwise those phases are returned, for the first step's row."""
    validate = start == 0 and bool(run.config.eval_steps)
    metrics: dict[str, float] = {}
    if validate:
        with startup("validation"):
            metrics = stages.run_validation(run, step=0)
    phases = startup_metrics(startup)
    shown = ", ".join(f"{k.split('/')[1].removesuffix('_s')} {v:.1f}" for k, v in phases.items())
    logger.info("start-up: %.1f s to the first step (%s)", phases["startup/to_first_step_s"], shown)
    if not validate:
        return phases
    run.tracker.log(metrics | phases, step=0)
    return {}


def resume(run: RLVRRun, path: Path | None) -> int:
    """Restore trainer states, data position and RNG from the verified checkpoint ``path`` (see
    ``resolve_resume``); returns its step (0: fresh, ``path`` None).

    Either way the engines then hold the trainer's weights: a fresh run syncs version 0 before its
    first rollout (engines started with ``load_format: dummy`` have none, and a broken model-update
    path fails here, before any training)."""
    if path is None:
        update_inference_weights(run, 0, always=True)
        return 0
    state = read_state(path)
    for role in TRAINER_ROLES:
        if role in run.clusters:
            with stages.on_devices(run, role):
                run.model(role).load_checkpoint(str(path))
    run.sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    update_inference_weights(run, state["step"], always=True)  # the engines start from pretrain
    logger.info("resumed from %s at step %d", path, state["step"])
    return state["step"]


def save_step(run: RLVRRun, step: int, sampler_state: dict | None = None) -> Path:
    """Checkpoint the trainers, ``sampler_state`` (default: the sampler's position now) and the RNG."""

    def save_roles(tmp: Path) -> None:
        for role in TRAINER_ROLES:
            if role in run.clusters:
                with stages.on_devices(run, role):
                    run.model(role).save_checkpoint(str(tmp))

    sampler = run.sampler.state_dict() if sampler_state is None else sampler_state
    state = {"step": step, "sampler": sampler, "rng": rng_state()}
    root = checkpoint_root(run.config)
    path = save_checkpoint(root, step, state, save_roles, run.config.checkpoint_config.max_to_keep)
    logger.info("checkpoint: %s", path)
    return path


def finish(run: RLVRRun) -> None:
    """Export the final policy as a Hugging Face checkpoint and draw the curves. The export is
    written into ``.tmp-hf_model`` and renamed into place once complete: a run stopped while
    exporting leaves the previous ``hf_model/`` (if any) as it was."""
    out = run.run_dir / "hf_model"
    with write_dir_durably(out) as tmp:
        with stages.on_devices(run, "actor_train"):
            run.model("actor_train").save_hf_checkpoint(str(tmp))
        run.tokenizer.save_pretrained(str(tmp))
        if run.processor is not None:  # a vision-language model's image processor goes with it
            run.processor.image_processor.save_pretrained(str(tmp))
    plot = run.tracker.finish()
    logger.info("final policy: %s; curves: %s", out, plot)


def _tracker(run: RLVRRun, start: int):
    from roll.utils.tracking import Tracker

    return Tracker(run.config, run.run_dir, resume_step=start)
