"""What the ``vllm`` and ``sglang`` strategies share, none of which needs an engine installed.

* the requests of one generate call, with their sampling parameters (``engine_sampling``);
* request bookkeeping: request ids per prompt row (and per sample), a thread-safe registry of
  in-flight requests for ``abort``, and a collector that takes outputs in completion order and
  hands them back in prompt order (row ``i * n + j`` is sample ``j`` of prompt ``i``);
* output conversion: each engine's output objects -> ``Completion`` -> the Batch layout of
  ``roll.distributed.strategy.base`` (through ``generation.build_generation_batch``);
* scoring (prompt log-probs).

Engine start-up options live in ``engine_options``; handing weights to engine processes lives in
``roll.distributed.transport.engine_receive``.

Two ways of getting ``n`` samples per prompt are supported: one request that asks the engine for
``n`` outputs (vLLM's batch ``generate``) or ``n`` requests of one output each (SGLang, and vLLM's
per-request API, so each sample can be aborted on its own)::

    plan = RequestPlan("actor_infer0-3", num_rows=2, n=4, per_sample=True)
    collector = CompletionCollector(plan)
    for rid, completion in finished_in_any_order:
        collector.add(rid, [completion])
    batch = completions_to_batch(prompts, collector.ordered(), n=4, pad_token_id=0, response_length=64)
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.engine_sampling import sglang_sampling_params, vllm_sampling_kwargs
from roll.models.logprobs import batch_temperature

FINISH_REASONS = ("stop", "length", "abort")


# --------------------------------------------------------------------------- request bookkeeping


@dataclass(frozen=True)
class RequestPlan:
    """The engine requests of one generate call: ``per_sample`` submits ``n`` requests of one output
    per prompt row (ids ``<prefix>-<row>-<sample>``), otherwise one request of ``n`` outputs per row
    (ids ``<prefix>-<row>``)."""

    prefix: str
    num_rows: int
    n: int
    per_sample: bool

    def request_ids(self) -> list[str]:
        if self.per_sample:
            return [f"{self.prefix}-{i}-{j}" for i in range(self.num_rows) for j in range(self.n)]
        return [f"{self.prefix}-{i}" for i in range(self.num_rows)]

    def locate(self, request_id: str) -> tuple[int, int | None]:
        """(row, sample) of a request id of this plan; sample is None for one-request-per-row."""
        if not request_id.startswith(self.prefix + "-"):
            raise KeyError(f"request id {request_id!r} does not belong to plan {self.prefix!r}")
        parts = request_id[len(self.prefix) + 1 :].split("-")
        expected = 2 if self.per_sample else 1
        if len(parts) != expected or not all(p.isdigit() for p in parts):
            raise KeyError(f"malformed request id {request_id!r} for plan {self.prefix!r}")
        row = int(parts[0])
        sample = int(parts[1]) if self.per_sample else None
        if row >= self.num_rows or (sample is not None and sample >= self.n):
            raise KeyError(
                f"request id {request_id!r} is outside plan {self.prefix!r} ({self.num_rows} x {self.n})"
            )
        return row, sample


@dataclass(frozen=True)
class EngineRequest:
    """One request of a generate call as the strategy submits it: our request id, the prompt's
    token ids and the engine's sampling options (``vllm.SamplingParams`` kwargs / SGLang's dict)."""

    request_id: str
    prompt_ids: list[int]
    sampling: dict[str, Any]


def vllm_generate_requests(
    plan: RequestPlan, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> list[EngineRequest]:
    """The requests the ``vllm`` strategy submits for ``prompts`` (one per row of ``plan``): one
    request of ``n`` per row seeded ``seed + row * n``, or with ``plan.per_sample`` ``n`` requests
    of one seeded ``seed + row * n + sample``. ``benchmarks/rollout.py``'s raw row sends the same."""
    ids = iter(plan.request_ids())
    out = []
    for i, prompt in enumerate(prompts):
        if plan.per_sample:
            for j in range(plan.n):
                kwargs = vllm_sampling_kwargs(params, n=1, seed_offset=i * plan.n + j)
                out.append(EngineRequest(next(ids), list(prompt), kwargs))
        else:
            out.append(
                EngineRequest(next(ids), list(prompt), vllm_sampling_kwargs(params, seed_offset=i * plan.n))
            )
    return out


def sglang_generate_requests(
    plan: RequestPlan, prompts: Sequence[Sequence[int]], params: SamplingParams, context_len: int | None
) -> list[EngineRequest]:
    """The requests the ``sglang`` strategy submits: ``n`` of one sample per prompt row, request
    ``k = row * n + sample`` seeded ``seed + k``; ``max_new_tokens`` is cut to what fits in
    ``context_len`` (SGLang refuses a request past its context; vLLM stops it there: do the same)."""
    if not plan.per_sample:
        raise ValueError(f"plan {plan.prefix!r}: SGLang requests are one per sample (per_sample=True)")
    rows = [list(p) for p in prompts for _ in range(plan.n)]
    out = []
    for k, (rid, prompt) in enumerate(zip(plan.request_ids(), rows)):
        sampling = sglang_sampling_params(params, seed_offset=k)
        if context_len:
            sampling["max_new_tokens"] = max(1, min(sampling["max_new_tokens"], context_len - len(prompt)))
        out.append(EngineRequest(rid, prompt, sampling))
    return out


@dataclass
class Completion:
    """One sampled response: token ids, the engine's log-prob of each (None if not asked for),
    and why it ended ("stop", "length", "abort")."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probs in one completion"
            )


def aborted_completion() -> Completion:
    """What an aborted request yields when the engine returned nothing for it."""
    return Completion(token_ids=[], logprobs=[], finish_reason="abort")


class CompletionCollector:
    """Collects completions as requests finish (any order) and returns them in prompt order."""

    def __init__(self, plan: RequestPlan):
        self.plan = plan
        self._slots: list[list[Completion | None]] = [[None] * plan.n for _ in range(plan.num_rows)]

    def add(self, request_id: str, completions: Sequence[Completion]) -> None:
        row, sample = self.plan.locate(request_id)
        want = 1 if sample is not None else self.plan.n
        if len(completions) != want:
            raise ValueError(f"request {request_id!r} returned {len(completions)} outputs, expected {want}")
        samples = [sample] if sample is not None else range(self.plan.n)
        for j, completion in zip(samples, completions):
            if self._slots[row][j] is not None:
                raise ValueError(f"request {request_id!r} finished twice (row {row}, sample {j})")
            self._slots[row][j] = completion

    def missing(self) -> list[tuple[int, int]]:
        return [(i, j) for i, row in enumerate(self._slots) for j, c in enumerate(row) if c is None]

    @property
    def done(self) -> bool:
        return not self.missing()

    def ordered(self) -> list[Completion]:
        """Row-major completions (row ``i * n + j`` = sample ``j`` of prompt ``i``)."""
        missing = self.missing()
        if missing:
            raise RuntimeError(f"{len(missing)} samples never finished, first (row, sample) = {missing[0]}")
        return [c for row in self._slots for c in row]  # type: ignore[misc]


@dataclass
class RequestRegistry:
    """Requests in flight on one engine, and the aborts asked for them (thread-safe).

    ``abort`` may be called from another thread than the one driving the engine; the driver applies
    the recorded aborts between engine steps with ``take_aborts``.
    """

    _in_flight: set[str] = field(default_factory=set)
    _to_abort: set[str] = field(default_factory=set)
    _aborted: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _calls: Iterator[int] = field(default_factory=itertools.count)

    def new_prefix(self, ctx: WorkerContext) -> str:
        """A fresh request-id prefix for one call on this worker (``actor_infer0-7``): the ids of
        concurrent calls never clash."""
        return f"{ctx.role}{ctx.rank}-{next(self._calls)}"

    def add(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            ids = set(request_ids)
            clash = ids & self._in_flight
            if clash:
                raise ValueError(f"request ids already in flight: {sorted(clash)[:3]}")
            self._in_flight |= ids

    def finish(self, request_id: str) -> None:
        with self._lock:
            self._in_flight.discard(request_id)
            self._to_abort.discard(request_id)

    def in_flight(self) -> list[str]:
        with self._lock:
            return sorted(self._in_flight)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._in_flight

    def request_abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Mark in-flight requests for abort (all when None); returns the ids marked.

        An id matches itself and every request id it prefixes (``"x"`` matches ``"x-0-3"``), so a
        caller can abort by the id it passed to ``generate_one``. Unknown or already finished ids
        are ignored: a request may finish while its abort is on the way.
        """
        with self._lock:
            if request_ids is None:
                ids = set(self._in_flight)
            else:
                wanted = list(request_ids)
                ids = {r for r in self._in_flight if any(r == w or r.startswith(w + "-") for w in wanted)}
            self._to_abort |= ids
            self._aborted |= ids
            return sorted(ids)

    def take_aborts(self) -> list[str]:
        with self._lock:
            ids, self._to_abort = sorted(self._to_abort), set()
            return ids

    def was_aborted(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._aborted

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop all record of these ids (after their results were handed out)."""
        with self._lock:
            for rid in request_ids:
                self._in_flight.discard(rid)
                self._to_abort.discard(rid)
                self._aborted.discard(rid)


# --------------------------------------------------------------------------- engine outputs


def _normalize_finish_reason(reason: Any) -> str | None:
    if isinstance(reason, Mapping):  # SGLang: {"type": "stop", "matched": ...}
        reason = reason.get("type")
    if reason is None:
        return None
    reason = str(reason)
    return reason if reason in FINISH_REASONS else "stop"


def completions_from_vllm(request_output: Any, want_logprobs: bool = True) -> list[Completion]:
    """``vllm.RequestOutput`` -> one Completion per ``CompletionOutput`` (sorted by ``index``).

    ``CompletionOutput.logprobs`` holds one {token_id: Logprob} mapping per generated token (a list
    of dicts, or vLLM's FlatLogprobs which indexes the same way); we keep the sampled token's.
    """
    out = []
    for comp in sorted(request_output.outputs, key=lambda c: c.index):
        token_ids = [int(t) for t in comp.token_ids]
        logprobs = None
        if want_logprobs:
            if comp.logprobs is None:
                raise RuntimeError("vLLM returned no log-probs although logprobs=0 was requested")
            logprobs = [float(comp.logprobs[t][tok].logprob) for t, tok in enumerate(token_ids)]
        out.append(Completion(token_ids, logprobs, _normalize_finish_reason(comp.finish_reason), comp.text))
    return out


def completion_from_sglang(output: Mapping[str, Any], want_logprobs: bool = True) -> Completion:
    """One ``sglang.Engine.generate`` result dict -> Completion.

    Token ids come from ``output_ids`` (or, when absent, from the log-prob entries);
    ``meta_info.output_token_logprobs`` holds ``(logprob, token_id, text_or_None)`` per token.
    """
    meta = output.get("meta_info", {})
    entries = meta.get("output_token_logprobs") or []
    token_ids = (
        [int(t) for t in output["output_ids"]] if "output_ids" in output else [int(e[1]) for e in entries]
    )
    logprobs = None
    finish = _normalize_finish_reason(meta.get("finish_reason"))
    if want_logprobs and finish == "abort" and len(entries) != len(token_ids):
        # An abort can land between a token and its log-prob: keep the tokens both cover.
        keep = min(len(entries), len(token_ids))
        entries, token_ids = entries[:keep], token_ids[:keep]
    if want_logprobs:
        if len(entries) != len(token_ids):
            raise RuntimeError(
                f"SGLang returned {len(entries)} output log-probs for {len(token_ids)} tokens "
                f"(request {meta.get('id')!r}); was return_logprob=True passed?"
            )
        if any(int(e[1]) != t for e, t in zip(entries, token_ids)):
            raise RuntimeError(
                f"SGLang log-prob entries do not match output_ids (request {meta.get('id')!r})"
            )
        logprobs = [float(e[0]) for e in entries]
    return Completion(token_ids, logprobs, finish, output.get("text"))


def completions_to_batch(
    prompt_batch: Batch,
    completions: Sequence[Completion],
    n: int,
    pad_token_id: int,
    response_length: int,
    with_logprobs: bool = True,
    temperature: float = 1.0,
) -> Batch:
    """Prompt-ordered completions (``len(prompt_batch) * n`` of them) -> the generation Batch
    (``temperature`` is recorded in its meta for the log-prob computations that follow).

    Responses longer than ``response_length`` are cut (their log-probs with them).
    """
    from roll.distributed.strategy.generation import build_generation_batch

    if len(completions) != len(prompt_batch) * n:
        raise ValueError(f"{len(completions)} completions for {len(prompt_batch)} prompts x n={n}")
    responses = [c.token_ids[:response_length] for c in completions]
    logprobs = None
    if with_logprobs:
        missing = [i for i, c in enumerate(completions) if c.logprobs is None]
        if missing:
            raise ValueError(f"completion {missing[0]} has no log-probs")
        logprobs = [c.logprobs[:response_length] for c in completions]  # type: ignore[index]
    return build_generation_batch(
        prompt_batch, responses, logprobs, n, pad_token_id, response_length, temperature=temperature
    )


# --------------------------------------------------------------------------- scoring (prompt log-probs)


@dataclass(frozen=True)
class ScoringRequest:
    """One row of ``compute_log_probs`` as a prefill-only request: the log-probs of ``token_ids``
    at positions ``[start, start + count)`` are the row's response log-probs."""

    token_ids: list[int]
    start: int
    count: int


def require_unit_temperature(batch: Batch, role: str, engine: str) -> None:
    """vLLM and SGLang score prompts with the raw model distribution (temperature 1): refuse a batch
    sampled at another temperature rather than score it inconsistently with the trainer."""
    temperature = batch_temperature(batch)
    if temperature != 1.0:
        raise ValueError(
            f"{role}: {engine} scores with temperature 1 but the batch was sampled at {temperature}; "
            "use hf_infer or megatron_infer for this role"
        )


def scoring_requests(batch: Batch) -> list[ScoringRequest]:
    """Prompt + response tokens of each row, without padding."""
    from roll.distributed.strategy.generation import prompt_token_lists

    prompts = prompt_token_lists(batch)
    lengths = batch["response_mask"].sum(dim=1).tolist()
    responses = batch["responses"]
    out = []
    for i, prompt in enumerate(prompts):
        resp = responses[i, : int(lengths[i])].tolist()
        if not prompt:
            raise ValueError(f"row {i} has an empty prompt; its first response token cannot be scored")
        out.append(ScoringRequest(list(prompt) + resp, len(prompt), len(resp)))
    return out


def rows_to_tensor(rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
    """Right-pad float rows with 0 into a [len(rows), width] float32 tensor."""
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"row {i} has {len(row)} values, more than the width {width}")
        if row:
            out[i, : len(row)] = torch.tensor(list(row), dtype=torch.float32)
    return out


def vllm_prompt_logprobs(request_output: Any, req: ScoringRequest) -> list[float]:
    """Log-probs of ``req``'s scored positions from ``RequestOutput.prompt_logprobs`` (one
    {token_id: Logprob} per prompt token; the first is None)."""
    plp = request_output.prompt_logprobs
    return [float(plp[t][req.token_ids[t]].logprob) for t in range(req.start, req.start + req.count)]


def sglang_input_logprobs(output: Mapping[str, Any], req: ScoringRequest) -> list[float]:
    """Log-probs of ``req``'s scored positions from ``meta_info.input_token_logprobs`` (entries
    ``(logprob, token_id, text)`` for the input from ``logprob_start_len`` on). Entries are matched
    from the end, so the result does not depend on whether SGLang pads the first one with None.
    SGLang 0.5 reports ids >= vocab_size - 1 as 0 (it clips image-token hashes), so an entry id of
    0 matches any token."""
    entries = output["meta_info"]["input_token_logprobs"]
    total = len(req.token_ids)
    if len(entries) < total - req.start:
        raise RuntimeError(f"SGLang returned {len(entries)} input log-probs; {total - req.start} are needed")
    vals = []
    for t in range(req.start, req.start + req.count):
        entry = entries[len(entries) - (total - t)]
        if entry[0] is None or int(entry[1]) not in (req.token_ids[t], 0):
            raise RuntimeError(
                f"SGLang input log-prob at position {t} is {entry}, not one for token {req.token_ids[t]}"
            )
        vals.append(float(entry[0]))
    return vals
