"""The per-call watchdog: every worker call gets a deadline when the driver submits it.

The deadline is the submission time plus the ``worker_timeouts`` entry of the stage the method
belongs to (``METHOD_STAGES``; anything not listed is a small call, ``call_s``). ``get_all`` in
``cluster.py`` waits no longer than the nearest deadline; a call past its deadline raises
``WorkerTimeout`` naming the role, the ranks that did not answer, the method and the config key,
and the role's workers are killed (a hung rank usually holds its peers in a collective).

    deadline = Deadline.start(config.worker_timeouts, "train_step")   # 1800 s by default
    deadline.remaining()                                               # seconds left, >= 0
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from roll.configs.timeouts import WorkerTimeoutsConfig

# Worker method -> field of WorkerTimeoutsConfig.
METHOD_STAGES: dict[str, str] = {
    "initialize": "startup_s",
    "init_process_group": "startup_s",
    "model_update_connect_sender": "startup_s",
    "model_update_connect_receiver": "startup_s",
    "generate": "generate_s",
    "compute_log_probs": "log_probs_s",
    "compute_values": "log_probs_s",
    "compute_rewards": "reward_s",
    "train_step": "train_s",
    "model_update_send": "model_update_s",
    "model_update_receive": "model_update_s",
    "model_update_verify": "model_update_s",
    "model_update_probe_log_probs": "model_update_s",
    "save_checkpoint": "checkpoint_s",
    "load_checkpoint": "checkpoint_s",
    "save_hf_checkpoint": "checkpoint_s",
}
DEFAULT_STAGE = "call_s"


@dataclass(frozen=True)
class Deadline:
    """When a call on ``method`` must have returned, and which config key says so."""

    method: str
    key: str
    timeout_s: float
    at: float  # time.monotonic() deadline

    @classmethod
    def start(cls, timeouts: WorkerTimeoutsConfig, method: str) -> Deadline:
        key = METHOD_STAGES.get(method, DEFAULT_STAGE)
        timeout_s = float(getattr(timeouts, key))
        return cls(method, f"worker_timeouts.{key}", timeout_s, time.monotonic() + timeout_s)

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at
