"""``rollout_dump``: write every step's rollouts to a directory, or train on a directory's rollouts
instead of generating (alibaba/ROLL's ``rollout_mock``, for precision alignment between runs).

    rollout_dump: {mode: dump, dir: ./output/rollout_dumps/baseline}     # run 1: generate and keep
    rollout_dump: {mode: replay, dir: ./output/rollout_dumps/baseline}   # run 2: train on the same data

What is written and checked: roll/pipeline/rlvr/rollout_dump.py and docs/dapo_off_policy_async.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from roll.configs.ranges import one_of

MODES = ("none", "dump", "replay")


@dataclass
class RolloutDumpConfig:
    """``mode``: ``none`` (default), ``dump`` (after each step's rollouts are generated and scored,
    write them to ``dir``), ``replay`` (read step k's rollouts from ``dir`` instead of generating and
    scoring them). ``dir`` is required unless ``mode`` is ``none``."""

    mode: str = one_of("none", *MODES)
    dir: str | None = None

    def __post_init__(self) -> None:
        if self.mode != "none" and not self.dir:
            raise ValueError(f"dir: is required with mode {self.mode!r} (the dump directory)")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"
