"""What every sandbox backend takes and returns (``roll.pipeline.rewards.sandbox`` picks one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class SandboxError(RuntimeError):
    """The sandbox could not run the program (not the program failing)."""


@dataclass(frozen=True)
class Limits:
    time_limit_s: float = 2.0  # wall clock, from start to end; CPU seconds are capped at this + 1
    memory_mb: int = 512  # address space (RLIMIT_AS)
    output_bytes: int = 1 << 20  # stdout is cut here; a larger file write ends the program


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None: killed for time
    stdout: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


class Sandbox(Protocol):
    """A backend: made from its SandboxConfig once per process, then ``run`` from any thread."""

    def __init__(self, config: Any) -> None: ...

    @staticmethod
    def unavailable_reason() -> str | None:
        """Before launch: None if this backend can run here, else one line saying what is missing."""
        ...

    def run(self, code: str, stdin: str, limits: Limits) -> SandboxResult: ...
