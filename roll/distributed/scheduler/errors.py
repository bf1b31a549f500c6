"""Errors of the Ray runtime, each reported as one line the user can act on.

>>> try:
...     actor_train.train_step(batch)
... except WorkerError as err:
...     log.error(err.remote_traceback)   # the worker-side traceback, for the log file
...     raise                             # prints: "actor_train rank 3: ValueError: loss is nan"
"""

from __future__ import annotations

import re

from ray.exceptions import RayActorError, RayError, RayTaskError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The last line of a Python traceback: "ValueError: message" (or a bare "KeyboardInterrupt").
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning))(?::\s?(.*))?$")
_EXIT_DETAIL = re.compile(r"Worker exit detail: ([^.]*\.)")


class WorkerError(RuntimeError):
    """A worker of ``role`` failed: ``str(err)`` is ``"<role> rank <r>: <ExceptionType>: <message>"``.

    ``exc_type`` and ``original_message`` hold the worker's exception; ``remote_traceback`` its full
    traceback text (empty when the process died without one).
    """

    def __init__(
        self,
        role: str,
        rank: int,
        exc_type: str,
        message: str,
        remote_traceback: str = "",
        host: str = "",
    ):
        self.role = role
        self.rank = rank
        self.exc_type = exc_type
        self.original_message = message
        self.remote_traceback = remote_traceback
        # A process that hosted several roles' workers and died: ``on_host``.
        self.host = host
        super().__init__(f"{host or f'{role} rank {rank}'}: {exc_type}: {message}")

    def __reduce__(self):
        return (
            WorkerError,
            (self.role, self.rank, self.exc_type, self.original_message, self.remote_traceback, self.host),
        )

    def on_host(self, host: str) -> WorkerError:
        """The same error, blamed on the process rather than on the role whose call saw it first:
        ``"host process pid <p> on <node> (<role> rank <r>, ...): ActorDiedError: ..."``."""
        return WorkerError(
            self.role, self.rank, self.exc_type, self.original_message, self.remote_traceback, host
        )

    @classmethod
    def from_ray(cls, role: str, rank: int, error: RayError) -> WorkerError:
        """Dig the worker's own exception out of what ``ray.get`` raised."""
        if isinstance(error, RayTaskError):
            cause = error.cause
            while isinstance(cause, RayTaskError):  # an error passed through a nested remote call
                cause = cause.cause
            trace = _ANSI.sub("", str(error))  # Ray's text of the task error: the remote traceback
            exc_type, message = _checkpoint_failure(cause) or (type(cause).__name__, _first_line(str(cause)))
            return cls(role, rank, exc_type, message, trace)
        text = _ANSI.sub("", str(error))
        if isinstance(error, RayActorError) and error.actor_init_failed:
            # Ray keeps only the text of an exception raised in __init__; read its last line.
            exc_type, message = _exception_from_traceback(text)
            return cls(role, rank, exc_type, f"in __init__: {message}", text)
        if isinstance(error, RayActorError):
            detail = _EXIT_DETAIL.search(text)
            why = f" ({detail.group(1)})" if detail else ""
            return cls(role, rank, type(error).__name__, f"the worker process died{why}", text)
        return cls(role, rank, type(error).__name__, _first_line(text), text)


class WorkerTimeout(WorkerError):
    """Workers of ``role`` did not return from ``method`` in time: ``str(err)`` is
    ``"<role> rank(s) <r, ...>: <method> did not answer within <s> s (<config key>); ..."``."""

    def __init__(self, role: str, ranks: list[int], method: str, timeout_s: float, key: str):
        self.role = role
        self.ranks = list(ranks)
        self.rank = self.ranks[0] if self.ranks else -1
        self.method = method
        self.timeout_s = timeout_s
        self.key = key
        self.exc_type = "WorkerTimeout"
        self.original_message = f"{method} did not answer within {timeout_s:g} s ({key})"
        self.remote_traceback = ""
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {', '.join(map(str, self.ranks))}"
        RuntimeError.__init__(
            self,
            f"{role} {who}: {self.original_message}; the workers were stopped (raise {key} for slower calls)",
        )

    def __reduce__(self):
        return (WorkerTimeout, (self.role, self.ranks, self.method, self.timeout_s, self.key))


class PlacementError(RuntimeError):
    """The Ray cluster could not give the devices the plan asked for (e.g. they are held by others)."""


def _checkpoint_failure(cause: BaseException | None) -> tuple[str, str] | None:
    """torch.distributed.checkpoint's ``CheckpointException`` gathers every rank's error; its text
    starts with ``CheckpointException ranks:dict_keys([0, 1])``. The first rank's own error is what
    the user can act on (``OSError: [Errno 28] No space left on device: '<file>'``)."""
    failures = getattr(cause, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    rank, failure = min(failures.items())
    inner = failure[0] if isinstance(failure, tuple) and failure else failure
    if not isinstance(inner, BaseException):
        return None
    ranks = ", ".join(str(r) for r in sorted(failures))
    message = f"{_first_line(str(inner))} (checkpoint rank {rank}; failed on ranks {ranks})"
    return type(inner).__name__, message


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


def _exception_from_traceback(text: str) -> tuple[str, str]:
    for line in reversed(text.splitlines()):
        match = _EXC_LINE.match(line.strip())
        if match and not line.startswith((" ", "\t")):
            return match.group(1).rsplit(".", 1)[-1], (match.group(2) or "").strip() or "(no message)"
    return "Exception", _first_line(text)
