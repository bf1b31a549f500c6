"""Score responses with a rule reward, each sample under a time limit that cannot hang the run.

A reward function may never return (a sympy ``simplify`` on a hostile expression, a regex with
catastrophic backtracking). Signals cannot interrupt it inside a Ray actor thread, and a Python
thread cannot be killed, so samples are scored in spawned worker processes: a sample that runs past
``timeout_s`` scores 0.0, its worker is killed and replaced, and the timeout is counted.

    scorer = RewardScorer("math_rule", {"last_number_fallback": True}, timeout_s=5.0)
    scores = scorer.score(responses, ground_truths)   # list[float], same order
    scorer.stats                                       # {"scored": .., "timeouts": .., "errors": ..}
    result = scorer.score_detailed(responses, ground_truths)  # + per-sample errors and timeouts
    scorer.close()

A sample whose function raises, or returns anything but a finite number (None, a string, NaN,
inf) or one beyond ``max_abs_reward`` in magnitude, scores 0.0 and is an error with its message
(``checked_score``); the reward worker reports errors and timeouts, the pipeline counts both as
failures and stops past ``max_error_fraction``. Given ``max_failures``, ``score_detailed`` stops
once more samples than that have failed: the pending ones are not sent, the running ones are
killed (``ScoreResult.skipped``), so a hanging function costs one ``timeout_s``, not one per sample.

``score_batch`` does the same with one scorer kept per (reward, kwargs, timeout) in this process,
so workers are started once per reward worker, not once per batch. ``reward_fn`` is a name from
``roll.pipeline.rewards.registry`` or a ``"package.module:function"`` path.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection, wait
from typing import Any

from roll.configs.errors import ConfigError, did_you_mean
from roll.configs.role import DEFAULT_MAX_ABS_REWARD
from roll.pipeline.rewards.registry import REWARD_FUNCTIONS, get_reward_spec

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0
MAX_ERROR_MESSAGE = 300


def checked_score(value: Any, max_abs: float = DEFAULT_MAX_ABS_REWARD) -> float:
    """``value`` as a float; TypeError / ValueError unless it is a finite number of magnitude at
    most ``max_abs``."""
    if value is None or isinstance(value, (str, bytes)):
        raise TypeError(f"returned {_short(repr(value))}, not a number")
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"returned a {type(value).__name__}, not a number") from None
    if not math.isfinite(score):
        raise ValueError(f"returned {score}, not a finite number")
    if abs(score) > max_abs:
        raise ValueError(f"returned {score:g}, beyond max_abs_reward={max_abs:g}")
    return score


def allowed_failures(max_error_fraction: float, samples: int) -> int:
    """How many of ``samples`` may fail before a run stops: more than ``max_error_fraction`` of
    them ends it (the epsilon keeps 0.29 * 100 at 29, not 28)."""
    return math.floor(max_error_fraction * samples + 1e-9)


def _short(text: str) -> str:
    return text if len(text) <= MAX_ERROR_MESSAGE else text[: MAX_ERROR_MESSAGE - 3] + "..."


@dataclass
class ScoreResult:
    """Scores in input order; ``errors[i]`` is "" or the message of sample i's error;
    ``timeouts[i]`` says it ran past the time limit (it scores 0.0; a failure, not an error);
    ``skipped[i]`` that it was not scored because the call stopped early (see ``max_failures``)."""

    scores: list[float]
    errors: list[str] = field(default_factory=list)
    timeouts: list[bool] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    # Samples with an error or a timeout so far, counted as they come (checked after every result).
    failed: int = 0


# The keyword a rule reward receives a row's ``reward_context`` as; not one of its reward_kwargs.
ROW_CONTEXT = "context"


def resolve_target(reward_fn: str, path: str = "reward_fn") -> str:
    """The ``module:function`` of a rule reward (a registry name or a path given as is)."""
    if reward_fn not in REWARD_FUNCTIONS and ":" in reward_fn:
        return reward_fn
    spec = get_reward_spec(reward_fn, path)
    if spec.kind != "rule":
        raise ConfigError(
            path, f"{reward_fn!r} is a {spec.kind} reward; it is scored by its own strategy, not here"
        )
    return spec.target


def load_target(target: str, path: str = "reward_fn") -> Callable[..., float]:
    module_name, _, fn_name = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(path, f"cannot load reward function {target!r}: {exc}") from exc


def reward_options(reward_fn: str, path: str = "reward_fn") -> list[str] | None:
    """The ``reward_kwargs`` keys a reward takes (None: any, the function has ``**kwargs``). A rule
    reward takes its function's parameters after (response, ground_truth); a model reward the keys
    of its spec's ``options`` table."""
    spec = REWARD_FUNCTIONS.get(reward_fn)
    if spec is not None and spec.kind == "model":
        if spec.options is None:
            return []
        module_name, _, name = spec.options.partition(":")
        return list(getattr(importlib.import_module(module_name), name))
    params = list(inspect.signature(load_target(resolve_target(reward_fn, path), path)).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params[2:] if p.kind in named and p.name != ROW_CONTEXT]


def check_reward_kwargs(reward_fn: str, reward_kwargs: dict[str, Any], path: str = "reward_kwargs") -> None:
    """Raise a ConfigError naming any key of ``reward_kwargs`` the reward function does not accept
    (run before launch by roll.launch.files: a misspelt key would fail every sample)."""
    reward_path = path.rsplit(".", 1)[0] + ".reward_fn" if "." in path else "reward_fn"
    accepted = reward_options(reward_fn, reward_path)
    if accepted is None:
        return
    for key in reward_kwargs:
        if key not in accepted:
            raise ConfigError(
                f"{path}.{key}",
                f"{reward_fn!r} takes no such option{did_you_mean(str(key), accepted)}; "
                f"its options: {', '.join(accepted) or 'none'}",
            )


def _worker_main(fd: int, target: str, kwargs: dict[str, Any], max_abs: float) -> None:
    """Worker process: load the function, say ready, then score (index, response, truth, context)
    messages; a row's ``context`` goes to a function that takes the keyword ``context`` (others
    never see it: a math row of a vision-language file may carry one its reward does not read)."""
    conn = Connection(fd)
    fn = load_target(target)
    takes_context = ROW_CONTEXT in inspect.signature(fn).parameters
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        index, response, truth, context = msg
        extra = {ROW_CONTEXT: context} if takes_context and context is not None else {}
        try:
            conn.send((index, checked_score(fn(response, truth, **kwargs, **extra), max_abs), None))
        except Exception as exc:  # a failing sample scores 0.0 and is counted, the run goes on
            conn.send((index, 0.0, _short(f"{type(exc).__name__}: {exc}")))


class _Worker:
    """One scoring process, started as ``python -m`` this module (not multiprocessing spawn, which
    re-runs the parent's ``__main__``: a Ray worker's or a script's), talking over a socket pair."""

    def __init__(self, target: str, kwargs: dict[str, Any], max_abs: float = DEFAULT_MAX_ABS_REWARD):
        self.conn, child = Pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        argv = [
            sys.executable,
            "-m",
            __name__,
            str(child.fileno()),
            target,
            json.dumps(kwargs),
            repr(max_abs),
        ]
        self.process = subprocess.Popen(argv, env=env, pass_fds=[child.fileno()])
        child.close()
        try:
            if not self.conn.poll(WORKER_START_TIMEOUT_S):
                raise EOFError
            self.conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(
                f"reward worker for {target!r} did not start (exit code {self.process.returncode})"
            ) from None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self.conn.close()


class RewardScorer:
    """A rule reward run in ``num_procs`` worker processes with a per-sample time limit."""

    def __init__(
        self,
        reward_fn: str,
        reward_kwargs: dict[str, Any] | None,
        timeout_s: float,
        num_procs: int = 1,
        max_abs_reward: float = DEFAULT_MAX_ABS_REWARD,
    ):
        if timeout_s <= 0 or num_procs < 1:
            raise ValueError(f"timeout_s must be > 0 and num_procs >= 1, got {timeout_s} and {num_procs}")
        self.target = resolve_target(reward_fn)
        load_target(self.target)  # fail here, with the name, rather than in a worker
        self.kwargs = dict(reward_kwargs or {})
        self.timeout_s = timeout_s
        self.max_abs = max_abs_reward
        # A slot whose process was killed (timeout, early stop) is None until it is needed again.
        self.workers: list[_Worker | None] = [self._start() for _ in range(num_procs)]
        self.stats = {"scored": 0, "timeouts": 0, "errors": 0}

    def _start(self) -> _Worker:
        return _Worker(self.target, self.kwargs, self.max_abs)

    def score(self, responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
        return self.score_detailed(responses, ground_truths).scores

    def score_detailed(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str],
        max_failures: int | None = None,
        contexts: Sequence[dict[str, Any] | None] | None = None,
    ) -> ScoreResult:
        """Scores with each sample's error message and timeout flag (see ``ScoreResult``). Once
        more than ``max_failures`` samples have failed (errors and timeouts), the rest are skipped:
        the run is ending, and a hanging function would otherwise cost ``timeout_s`` per sample.
        ``contexts``: per sample, a dict the function gets as its keyword ``context`` (the row's
        ``reward_context``, e.g. a detection row's options and image size), or None."""
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        contexts = list(contexts) if contexts is not None else [None] * len(responses)
        n = len(responses)
        result = ScoreResult([0.0] * n, [""] * n, [False] * n, [False] * n)
        pending = deque(range(n))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (sample index, start time)
        while pending or busy:
            if max_failures is not None and result.failed > max_failures:
                self._skip(pending, busy, result)
                break
            for slot in range(len(self.workers)):
                if slot not in busy and pending:
                    index = pending.popleft()
                    self._worker(slot).conn.send(
                        (index, responses[index], ground_truths[index], contexts[index])
                    )
                    busy[slot] = (index, time.monotonic())
            self._collect(busy, result)
        self.stats["scored"] += n - sum(result.skipped)
        failed = [i for i, e in enumerate(result.errors) if e]
        if failed:  # the driver logs the warning, once per step and role
            logger.debug(
                "reward %s failed on %d of %d samples, e.g. sample %d: %s",
                self.target, len(failed), n, failed[0], result.errors[failed[0]],
            )  # fmt: skip
        return result

    def _skip(self, pending: deque[int], busy: dict[int, tuple[int, float]], result: ScoreResult) -> None:
        """Stop early: the pending samples are not sent, the running ones' processes are killed."""
        for index in pending:
            result.skipped[index] = True
        pending.clear()
        for slot, (index, _) in list(busy.items()):
            result.skipped[index] = True
            self._drop(slot)
            del busy[slot]
        logger.debug("reward %s: stopped early, %d samples not scored", self.target, sum(result.skipped))

    def _worker(self, slot: int) -> _Worker:
        worker = self.workers[slot]
        if worker is None:
            worker = self.workers[slot] = self._start()
        return worker

    def _collect(self, busy: dict[int, tuple[int, float]], result: ScoreResult) -> None:
        """Wait for the first result or deadline; store results, replace workers past their deadline."""
        deadline = min(start for _, start in busy.values()) + self.timeout_s
        conns = {self._worker(slot).conn: slot for slot in busy}
        for conn in wait(list(conns), timeout=max(0.0, deadline - time.monotonic())):
            slot = conns[conn]
            try:
                index, value, error = conn.recv()
            except EOFError:  # the worker died (e.g. out of memory): count it like an error
                index, value, error = busy[slot][0], 0.0, "reward worker exited"
                self._drop(slot)
            result.scores[index] = value
            if error:
                self.stats["errors"] += 1
                result.failed += 1
                result.errors[index] = error
                logger.debug("reward %s failed on sample %d: %s", self.target, index, error)
            del busy[slot]
        now = time.monotonic()
        for slot, (index, start) in list(busy.items()):
            if now - start >= self.timeout_s:
                logger.debug("reward %s timed out (%.1f s) on sample %d", self.target, self.timeout_s, index)
                self.stats["timeouts"] += 1
                result.failed += 1
                result.scores[index] = 0.0
                result.timeouts[index] = True
                self._drop(slot)
                del busy[slot]

    def _drop(self, slot: int) -> None:
        """Kill the slot's process; a new one starts when the slot is next needed."""
        worker, self.workers[slot] = self.workers[slot], None
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        for worker in self.workers:
            if worker is None:
                continue
            try:
                worker.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            try:
                worker.process.wait(timeout=2)
                worker.conn.close()
            except subprocess.TimeoutExpired:
                worker.kill()
        self.workers = []


_SCORERS: dict[tuple[str, str, float, int], RewardScorer] = {}


def score_batch(
    reward_fn_name: str,
    responses: Sequence[str],
    ground_truths: Sequence[str],
    reward_kwargs: dict[str, Any] | None = None,
    timeout_s: float | None = 10.0,
    num_procs: int = 1,
    stats: dict[str, int] | None = None,
) -> list[float]:
    """Scores of ``responses`` (0.0 for samples past ``timeout_s`` seconds or that raised).

    ``timeout_s=None`` scores in this process with no time limit (for rewards known to be fast).
    When ``stats`` is given, this call's "scored", "timeouts" and "errors" counts are added to it.
    """
    if timeout_s is None:
        fn = load_target(resolve_target(reward_fn_name))
        scores = [
            checked_score(fn(r, t, **(reward_kwargs or {})))
            for r, t in zip(responses, ground_truths, strict=True)
        ]
        if stats is not None:
            stats["scored"] = stats.get("scored", 0) + len(scores)
        return scores
    key = (reward_fn_name, json.dumps(reward_kwargs or {}, sort_keys=True), float(timeout_s), num_procs)
    if key not in _SCORERS:
        _SCORERS[key] = RewardScorer(reward_fn_name, reward_kwargs, timeout_s, num_procs)
    scorer = _SCORERS[key]
    before = dict(scorer.stats)
    scores = scorer.score(responses, ground_truths)
    if stats is not None:
        for name, value in scorer.stats.items():
            stats[name] = stats.get(name, 0) + value - before[name]
    return scores


@atexit.register
def close_all_scorers() -> None:
    """Stop every worker process ``score_batch`` started."""
    while _SCORERS:
        _SCORERS.popitem()[1].close()


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]))
