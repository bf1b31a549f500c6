"""``hf_infer``: transformers' ``generate`` and forward on one full model replica per worker.

Used for ``actor_infer`` on small models and for ``reference`` (log-probs only).

>>> strategy = HFInferStrategy(role_config, ctx)
>>> strategy.initialize()
>>> out = strategy.generate(prompt_batch, SamplingParams(n=4, max_new_tokens=64, temperature=0.8))
>>> ref = strategy.compute_log_probs(out)["log_probs"]                 # [B * 4, R]

``infer_logprobs`` are the log-probs of the sampled tokens under the distribution they were
sampled from: the logits after every processor (repetition penalty, min-new-tokens EOS mask,
temperature, top-k, top-p), renormalised. With top_p = 1, top_k off, repetition_penalty = 1 and
min_new_tokens = 0 they equal ``compute_log_probs`` of the same rows (temperature T).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from roll.configs.role import RoleConfig
from roll.configs.strategy_configs import HFInferConfig
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.generation import (
    build_generation_batch,
    capped,
    response_width,
    stop_token_ids,
)
from roll.models.checkpoint_names import CheckpointNames
from roll.models.loading import load_model
from roll.models.logprobs import batch_temperature, response_log_probs
from roll.models.tokenizer import load_tokenizer
from roll.models.value_model import ValueModel, check_output_kind, response_values
from roll.models.vision import (
    MULTI_MODAL_INPUTS,
    exclude_response_tokens,
    forward_kwargs,
    repeat_rows,
    response_excluded_tokens,
)
from roll.models.weights import copy_into
from roll.utils.rng import device_rng_state, set_device_rng_state


class HFInferStrategy:
    """One full HF model per worker: generate, log-probs (or values), offload and weight loading."""

    def __init__(self, role_config: RoleConfig, ctx: WorkerContext) -> None:
        self.role_config = role_config
        self.ctx = ctx
        self.config: HFInferConfig = role_config.strategy_args.strategy_config
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self._rng_state: dict[str, torch.Tensor] | None = None
        self._targets: dict[str, torch.Tensor] | None = None  # load_weights' name table
        self._names = CheckpointNames()  # the model's module <-> checkpoint names (set on load)

    def initialize(self) -> None:
        """Load the model (``model_args.dtype``) in eval mode on ``ctx.device``; seed sampling with
        ``ctx.seed + ctx.rank`` (one reproducible stream per rank, untouched by other code)."""
        model_args = self.role_config.model_args
        self.model = load_model(model_args, training=False, seed=self.ctx.seed).to(self.ctx.device).eval()
        self.model.requires_grad_(False)
        self._names = CheckpointNames.of(self.model)
        self.tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.trust_remote_code)
        self._rng_state = _seeded_rng_state(self.ctx.seed + self.ctx.rank, self.ctx.device)

    @property
    def is_value_model(self) -> bool:
        return isinstance(self.model, ValueModel)

    def dp_layout(self) -> tuple[int, int, bool]:
        """(dp rank, dp size, whether this rank's outputs are collected): every rank is a replica."""
        return self.ctx.rank, self.ctx.world_size, True

    # ----------------------------------------------------------------------------------- forward
    def compute_log_probs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs", "entropy"} [B, R] at the batch's sampling temperature, on CPU."""
        check_output_kind(self.ctx.role, self.is_value_model, values=False)
        return self._forward(batch)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values [B, R] of a value model (``model_args.model_type: value``), on CPU."""
        check_output_kind(self.ctx.role, self.is_value_model, values=True)
        return self._forward(batch)["values"]

    @torch.no_grad()
    def _forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The model's outputs micro-batched by ``infer_batch_size`` rows."""
        temperature = batch_temperature(batch)
        parts: list[dict[str, torch.Tensor]] = []
        for micro in batch.split(max(1, self.role_config.infer_batch_size)):
            micro = micro.to(self.ctx.device)
            if self.is_value_model:
                parts.append({"values": response_values(self.model, micro)})
            else:
                parts.append(response_log_probs(self.model, micro, temperature))
        return {key: torch.cat([p[key].cpu() for p in parts]) for key in parts[0]}

    # -------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """``params.n`` samples per prompt row (row i*n + j is sample j of prompt i), micro-batched
        by ``infer_batch_size`` prompts. Responses are cut after the first EOS / stop token or
        stop string and padded to ``pipeline.response_length`` (``params.max_new_tokens`` without
        a pipeline). ``params.seed`` restarts the stream for this call only."""
        if self.is_value_model:
            raise ValueError(
                f"{self.ctx.role}: a value model cannot generate (model_args.model_type is 'value')"
            )
        width = response_width(self.ctx, params)
        params = capped(params, width)
        rng = _seeded_rng_state(params.seed, self.ctx.device) if params.seed is not None else self._rng_state
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        with torch.random.fork_rng(devices=[self.ctx.device] if self.ctx.is_cuda else []):
            set_device_rng_state(rng, self.ctx.device)
            for micro in batch.split(max(1, self.role_config.infer_batch_size)):
                toks, logps = self._generate_micro(micro, params)
                responses += toks
                logprobs += logps
            if params.seed is None:
                self._rng_state = device_rng_state(self.ctx.device)
        return build_generation_batch(
            batch,
            responses,
            logprobs if params.logprobs else None,
            params.n,
            self.tokenizer.pad_token_id,
            width,
            temperature=params.temperature,
        ).to("cpu")

    def _generate_micro(
        self, micro: Batch, params: SamplingParams
    ) -> tuple[list[list[int]], list[list[float]]]:
        mask = micro["prompt_mask"].to(self.ctx.device)
        first = int(mask.any(0).long().argmax()) if mask.any() else 0  # drop columns of padding only
        input_ids = micro["prompts"].to(self.ctx.device)[:, first:].repeat_interleave(params.n, dim=0)
        mask = mask[:, first:].repeat_interleave(params.n, dim=0)
        eos_ids = self._eos_ids(params)
        recorder = _SampledLogProbs()
        stops = _StopStrings(params.stop or [], self.tokenizer, input_ids.shape[1], params.min_new_tokens)
        vision = {}  # rows with images: their pixel values and grids, each row's n times
        if MULTI_MODAL_INPUTS in micro:
            rows = {MULTI_MODAL_INPUTS: repeat_rows(micro[MULTI_MODAL_INPUTS], params.n)}
            vision = forward_kwargs(rows, self.ctx.device, input_ids, self.model)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            **vision,
            generation_config=self._generation_config(params, eos_ids),
            logits_processor=LogitsProcessorList(
                [*self._excluded(), *_warpers(params), *([recorder] if params.logprobs else [])]
            ),
            stopping_criteria=StoppingCriteriaList([stops]),
        )
        generated = out[:, input_ids.shape[1] :]
        logps = recorder.finalize(generated) if params.logprobs else torch.zeros(generated.shape)
        rows = generated.tolist()
        lengths = [min(_eos_cut(row, eos_ids), stops.stop_at.get(i, len(row))) for i, row in enumerate(rows)]
        toks = [row[:n] for row, n in zip(rows, lengths)]
        return toks, [row[:n] for row, n in zip(logps.tolist(), lengths)]

    def _excluded(self) -> list[LogitsProcessor]:
        """A vision-language model's vision tokens out of its responses (``roll.models.vision``)."""
        ids = response_excluded_tokens(self.model.config)
        return [_ExcludeTokens(ids)] if ids else []

    def _eos_ids(self, params: SamplingParams) -> list[int]:
        return stop_token_ids(self.model.generation_config.eos_token_id, self.tokenizer, params)

    def _generation_config(self, params: SamplingParams, eos_ids: list[int]) -> GenerationConfig:
        # The warpers are ours (see _warpers) so our log-prob recorder sees the final distribution;
        # generate's own are switched off explicitly (its defaults would add top_k=50).
        return GenerationConfig(
            do_sample=params.temperature > 0,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=params.min_new_tokens,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            typical_p=1.0,
            repetition_penalty=params.repetition_penalty,
            num_return_sequences=1,
            num_beams=1,
            eos_token_id=eos_ids or None,
            pad_token_id=self.tokenizer.pad_token_id,
            use_cache=True,
        )

    # --------------------------------------------------------------------- offload / model update
    def offload_states(self) -> None:
        """Weights to CPU (with ``offload_to_cpu``) and the CUDA cache emptied; no-op on CPU."""
        self._targets = None
        if self.ctx.is_cuda and self.config.offload_to_cpu:
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def reload_states(self) -> None:
        self._targets = None
        self.model.to(self.ctx.device)

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's tensors by the checkpoint's names (a model update's verify pass compares them)."""
        yield from self._names.to_checkpoint(self.model.state_dict().items())

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy full tensors named as the checkpoint names them (or as the modules do) into the
        parameters in place (any subset, any dtype/device). A model update calls this once per
        bucket; the name table is built on the first bucket after the model last moved (offload /
        reload rebuild it)."""
        if self._targets is None:
            self._targets = self.model.state_dict(keep_vars=True)
        copy_into(self._targets, named_tensors, self._names)


def _warpers(params: SamplingParams) -> list[LogitsProcessor]:
    """Temperature, top-k, top-p, in the order transformers applies them; none for greedy."""
    if params.temperature <= 0:
        return []
    warpers: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k is not None and params.top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=params.top_p))
    return warpers


class _ExcludeTokens(LogitsProcessor):
    """First processor: tokens a response must not hold get ``EXCLUDED_LOGIT``, as the forward's
    log-probs give them (``roll.models.logprobs``)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return exclude_response_tokens(scores, self.token_ids)


class _SampledLogProbs(LogitsProcessor):
    """Last processor: keeps each step's log-softmax and, one step later, the log-prob of the token
    that was drawn from it (only one [N, V] step is held at a time)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []
        self._last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._last is not None:
            self.steps.append(self._last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finalize(self, generated: torch.Tensor) -> torch.Tensor:
        """Log-probs [N, G] of the ``generated`` tokens."""
        count = generated.shape[1]
        if len(self.steps) < count and self._last is not None:
            self.steps.append(self._last.gather(-1, generated[:, count - 1 : count]).squeeze(-1))
        if count == 0:
            return torch.zeros(generated.shape, dtype=torch.float32)
        return torch.stack(self.steps[:count], dim=1).cpu()


class _StopStrings(StoppingCriteria):
    """Stops a row once its generated text contains a stop string, remembering where (``stop_at``)."""

    def __init__(self, stop: list[str], tokenizer, prompt_width: int, min_new_tokens: int) -> None:
        self.stop = [s for s in stop if s]
        self.tokenizer = tokenizer
        self.prompt_width = prompt_width
        self.min_new_tokens = min_new_tokens
        # A stop string spans at most len(s) tokens unless tokens decode to nothing; keep slack.
        self.window = max((len(s) for s in self.stop), default=0) + 8
        # row -> number of generated tokens when its text first contained a stop string
        self.stop_at: dict[int, int] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        generated = input_ids.shape[1] - self.prompt_width
        if not self.stop or generated < max(1, self.min_new_tokens):
            return done
        for row in range(input_ids.shape[0]):
            if row in self.stop_at:
                done[row] = True
                continue
            tail = input_ids[row, max(self.prompt_width, input_ids.shape[1] - self.window) :]
            if any(s in self.tokenizer.decode(tail.tolist()) for s in self.stop):
                self.stop_at[row] = generated
                done[row] = True
        return done


def _eos_cut(tokens: list[int], eos_ids: list[int]) -> int:
    """Length up to and including the first EOS / stop token (all of it when there is none)."""
    eos = set(eos_ids)
    for i, token in enumerate(tokens):
        if token in eos:
            return i + 1
    return len(tokens)


def _seeded_rng_state(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return device_rng_state(device)
