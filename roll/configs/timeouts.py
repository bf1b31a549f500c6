"""``worker_timeouts``: how long the driver waits for one call on a role's workers, by stage.

A call that has not returned by then is taken for a hung worker (a stopped process, a collective
that waits for a dead peer, a deadlocked engine): the driver names the role and the ranks that did
not answer, stops the workers and ends the run (``roll.distributed.scheduler.watchdog``). The
defaults are generous; lower them to notice a hang sooner, raise them for very large models.

    worker_timeouts: {generate_s: 1800, train_s: 3600}
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# A timeout must leave room for one real call and still end a hang within a day.
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 86_400.0


@dataclass
class WorkerTimeoutsConfig:
    """Seconds per worker call, by the stage the call belongs to (see ``watchdog.METHOD_STAGES``)."""

    # Starting a role: building its strategy and loading the model.
    startup_s: float = 1800.0
    # Rollouts, validation included.
    generate_s: float = 1800.0
    # Reference, old-policy and value log-probs.
    log_probs_s: float = 1800.0
    # Reward workers scoring a batch (a model or an LLM judge may be slow).
    reward_s: float = 1800.0
    # One train step (every PPO epoch of it).
    train_s: float = 1800.0
    # Sending the trainer's weights into the engines, and the probe after it.
    model_update_s: float = 600.0
    # Saving or loading a checkpoint, and the Hugging Face export.
    checkpoint_s: float = 1800.0
    # Every other call: offloading and reloading states, layouts, metrics.
    call_s: float = 300.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
                raise ValueError(
                    f"{f.name}: must be between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g} seconds, got {value}"
                )
