"""Engine-neutral helpers every inference strategy (hf, megatron_infer, vllm, sglang) shares.

An engine turns prompt token lists into response token lists (and their log-probs); these
helpers turn those lists into the Batch layout of ``roll.distributed.strategy.base``:

>>> prompts = prompt_token_lists(batch)                        # left padding stripped
>>> responses, logps = engine_generate(prompts, n=4)            # B * 4 lists, prompt-major
>>> out = build_generation_batch(batch, responses, logps, n=4, pad_token_id=0, response_length=512,
...                              temperature=0.8)
>>> out["responses"].shape                                      # [B * 4, 512]
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.models.logprobs import TEMPERATURE_KEY
from roll.models.positions import make_position_ids

# Fields build_generation_batch writes; a prompt batch's own copies of these are replaced.
GENERATED_FIELDS = (
    "prompts",
    "prompt_mask",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "infer_logprobs",
)


def prompt_token_lists(batch: Batch) -> list[list[int]]:
    """Each row's prompt token ids without its left padding (``prompts`` where ``prompt_mask`` is 1)."""
    prompts, mask = batch["prompts"].cpu(), batch["prompt_mask"].cpu().bool()
    return [row[row_mask].tolist() for row, row_mask in zip(prompts, mask)]


def sampling_temperature(temperature: float) -> float:
    """The temperature log-probs are scored with: the sampler's, or 1.0 for greedy (T <= 0)."""
    return temperature if temperature > 0 else 1.0


def build_generation_batch(
    prompt_batch: Batch,
    responses: list[list[int]],
    logprobs: list[list[float]] | None,
    n: int,
    pad_token_id: int,
    response_length: int,
    *,
    temperature: float = 1.0,
) -> Batch:
    """B * n rows in prompt order (row i*n + j is sample j of prompt i) with the base.py fields.

    ``responses`` hold the generated ids of each sample (EOS included when the engine stopped on
    it); ones longer than ``response_length`` are cut. ``logprobs``, when given, are the per-token
    log-probs the engine sampled with (``infer_logprobs``; 0 on padding); with None the batch has no
    ``infer_logprobs``. The prompt batch's other tensors and non-tensors are repeated n times; its
    meta is kept, with ``meta["temperature"]`` set to the temperature log-probs are scored with.
    """
    rows = len(prompt_batch)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(responses) != rows * n:
        raise ValueError(
            f"expected {rows} prompts x {n} samples = {rows * n} responses, got {len(responses)}"
        )
    if logprobs is not None and len(logprobs) != len(responses):
        raise ValueError(f"got {len(logprobs)} log-prob lists for {len(responses)} responses")
    device = prompt_batch["prompts"].device
    resp, resp_mask, resp_logp = _pad_responses(responses, logprobs, pad_token_id, response_length)
    prompts = prompt_batch["prompts"].repeat_interleave(n, dim=0)
    prompt_mask = prompt_batch["prompt_mask"].repeat_interleave(n, dim=0)
    attention_mask = torch.cat([prompt_mask.long(), resp_mask.to(device)], dim=1)
    tensors = {
        k: v.repeat_interleave(n, dim=0) for k, v in prompt_batch.tensors.items() if k not in GENERATED_FIELDS
    }
    tensors.update(
        prompts=prompts,
        prompt_mask=prompt_mask,
        responses=resp.to(device),
        response_mask=resp_mask.to(device),
        input_ids=torch.cat([prompts, resp.to(device)], dim=1),
        attention_mask=attention_mask,
        position_ids=make_position_ids(attention_mask),
    )
    if resp_logp is not None:
        tensors["infer_logprobs"] = resp_logp.to(device)
    non_tensors = {k: np.repeat(v, n) for k, v in prompt_batch.non_tensors.items()}
    meta = {**prompt_batch.meta, TEMPERATURE_KEY: sampling_temperature(temperature)}
    return Batch(tensors, non_tensors, meta)


def _pad_responses(
    responses: list[list[int]], logprobs: list[list[float]] | None, pad_token_id: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Right-pad to ``width`` (cutting longer ones): (ids [N, W], mask [N, W], log-probs [N, W] or None)."""
    count = len(responses)
    ids = torch.full((count, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(count, width, dtype=torch.long)
    logp = None if logprobs is None else torch.zeros(count, width, dtype=torch.float32)
    for row, tokens in enumerate(responses):
        length = min(len(tokens), width)
        if length:
            ids[row, :length] = torch.as_tensor(tokens[:length], dtype=torch.long)
            mask[row, :length] = 1
        if logp is not None:
            if len(logprobs[row]) != len(tokens):
                raise ValueError(
                    f"response {row}: {len(tokens)} tokens but {len(logprobs[row])} log-probs from the engine"
                )
            if length:
                logp[row, :length] = torch.as_tensor(logprobs[row][:length], dtype=torch.float32)
    return ids, mask, logp


def response_width(ctx: WorkerContext, params: SamplingParams) -> int:
    """R of the generation Batch: the run's ``response_length`` (``max_new_tokens`` without a run)."""
    return ctx.response_length if ctx.response_length is not None else params.max_new_tokens


def capped(params: SamplingParams, max_new_tokens: int) -> SamplingParams:
    """A copy of ``params`` generating at most ``max_new_tokens`` tokens."""
    return dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, max_new_tokens))


def stop_token_ids(config_eos: int | list[int] | None, tokenizer, params: SamplingParams) -> list[int]:
    """Token ids that end a response: the model config's EOS id(s), the tokenizer's EOS (both left
    out with ``params.ignore_eos``) and the request's ``stop_token_ids``, sorted."""
    ids: set[int] = set()
    if not params.ignore_eos:
        ids.update(config_eos if isinstance(config_eos, list) else [] if config_eos is None else [config_eos])
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
    ids.update(params.stop_token_ids or [])
    return sorted(ids)
