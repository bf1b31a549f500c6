"""``worker_timeouts``: how long the driver waits for one call on a role's workers, by stage.

A call that has not returned by then is taken for a hung worker (a stopped process, a collective
that waits for a dead peer, a deadlocked engine): the driver names the role and the ranks that did
not answer, stops the workers and ends the run (``roll.distributed.scheduler.watchdog``). The
defaults are generous; lower them to notice a hang sooner, raise them for very large models.

    worker_timeouts: {generate_s: 1800, train_s: 3600}
"""

from __future__ import annotations

from dataclasses import dataclass

from roll.configs.ranges import bounded

# A timeout must leave room for one real call and still end a hang within a day.
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 86_400.0


@dataclass
class WorkerTimeoutsConfig:
    """Seconds per worker call, by the stage the call belongs to (see ``watchdog.METHOD_STAGES``)."""

    # Starting a role: building its strategy and loading the model.
    startup_s: float = bounded(1800.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    # Rollouts, validation included.
    generate_s: float = bounded(1800.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    # Reference, old-policy and value log-probs.
    log_probs_s: float = bounded(1800.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    # Reward workers scoring a batch (a model or an LLM judge may be slow).
    reward_s: float = bounded(1800.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    # One train step (every PPO epoch of it).
    train_s: float = bounded(1800.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    # Sending the trainer's weights into the engines, and the probe after it.
    model_update_s: float = bounded(600.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    # Saving or loading a checkpoint, and the Hugging Face export.
    checkpoint_s: float = bounded(1800.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
    # Every other call: offloading and reloading states, layouts, metrics.
    call_s: float = bounded(300.0, ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)
