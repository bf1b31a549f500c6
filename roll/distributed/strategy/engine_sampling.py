"""roll's ``SamplingParams`` in each engine's words: ``vllm.SamplingParams(**kwargs)`` and SGLang's
``sampling_params`` dict.

What the two engines share is one table (``SHARED``): a roll field, its name in each engine, and
the value to send (or None to leave the engine's default). What only one engine has (vLLM's ``n``,
``logprobs``, ``detokenize`` and optional ``top_k``; SGLang's ``n=1`` and ``top_k=-1`` for off)
is written in that engine's function.

    vllm_sampling_kwargs(SamplingParams(n=4, top_k=50, seed=1), seed_offset=8)
    # {"n": 4, "max_tokens": 512, ..., "top_k": 50, "seed": 9, "logprobs": 0, "detokenize": False}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from roll.core.sampling import SamplingParams


class SharedParam(NamedTuple):
    field: str  # roll's SamplingParams field
    vllm: str  # its name in vllm.SamplingParams
    sglang: str  # its name in SGLang's sampling_params
    value: Callable[[Any, int], Any]  # (roll's value, seed offset) -> what to send; None: leave out


def _as_is(value: Any, _: int) -> Any:
    return value


def _list_if_set(value: Any, _: int) -> Any:
    return list(value) if value else None


SHARED = [
    SharedParam("max_new_tokens", "max_tokens", "max_new_tokens", _as_is),
    SharedParam("temperature", "temperature", "temperature", _as_is),
    SharedParam("top_p", "top_p", "top_p", _as_is),
    SharedParam("repetition_penalty", "repetition_penalty", "repetition_penalty", _as_is),
    SharedParam("min_new_tokens", "min_tokens", "min_new_tokens", lambda v, _: v if v > 0 else None),
    SharedParam("stop", "stop", "stop", _list_if_set),
    SharedParam("stop_token_ids", "stop_token_ids", "stop_token_ids", _list_if_set),
    # With a seed, each request gets seed + offset so no two samples of a batch share one.
    SharedParam("seed", "seed", "sampling_seed", lambda v, offset: None if v is None else v + offset),
    SharedParam("ignore_eos", "ignore_eos", "ignore_eos", lambda v, _: True if v else None),
]


def shared_sampling(params: SamplingParams, engine: str, seed_offset: int) -> dict[str, Any]:
    """The ``SHARED`` parameters under ``engine``'s names ("vllm" or "sglang"), after checking
    ``params``."""
    if params.n < 1:
        raise ValueError(f"SamplingParams.n must be >= 1, got {params.n}")
    if params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {params.max_new_tokens}")
    out: dict[str, Any] = {}
    for row in SHARED:
        value = row.value(getattr(params, row.field), seed_offset)
        if value is not None:
            out[getattr(row, engine)] = value
    return out


def vllm_sampling_kwargs(
    params: SamplingParams, n: int | None = None, seed_offset: int = 0
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request of ``n`` samples (default
    ``params.n``).

    ``logprobs=0`` asks vLLM for the sampled token's log-prob only. ``top_k`` is left out when off,
    because vLLM changed its "off" value from -1 to 0 (both are accepted by current releases). With
    a seed, the request gets ``seed + seed_offset`` (vLLM adds the sample index for n > 1), so
    callers pass ``row * n`` and no two samples of a batch share a seed.
    """
    kwargs = shared_sampling(params, "vllm", seed_offset)
    kwargs["n"] = params.n if n is None else n
    kwargs["logprobs"] = 0 if params.logprobs else None
    kwargs["detokenize"] = bool(params.stop)  # text is only needed to match stop strings
    if params.top_k > 0:
        kwargs["top_k"] = params.top_k
    return kwargs


def sglang_sampling_params(params: SamplingParams, seed_offset: int = 0) -> dict[str, Any]:
    """One request's ``sampling_params`` dict for ``sglang.Engine.generate`` (always ``n=1``: we
    submit one request per sample). With a seed, the request gets ``seed + seed_offset``; callers
    pass ``row * n + sample`` so the samples of a batch differ."""
    out = shared_sampling(params, "sglang", seed_offset)
    out["n"] = 1
    out["top_k"] = params.top_k if params.top_k > 0 else -1
    return out
