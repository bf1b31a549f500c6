"""``sglang``: generation on SGLang's offline ``Engine``, one engine per worker (``actor_infer`` or
an LLM judge).

Written against SGLang 0.5.16, whose engine calls the GPU tests (tests/test_sglang_*gpu.py) run
(docs/strategies.md lists the SGLang names used). Everything that does not need SGLang lives in
``engine_requests``/``engine_options`` and is tested on CPU. A Qwen2.5-VL engine's scheduler
processes split each video's grid per temporal patch before its vision tower (``sglang_frames``).

``sglang.Engine`` starts its scheduler processes (TP across the worker's ``tensor_parallel_size``
visible devices) from inside the worker. Each sample is its own request (``rid`` =
``<prefix>-<row>-<sample>``), so SGLang's radix cache shares the prompt and every sample can be
aborted alone. ``Engine.generate`` drives the engine's event loop until the batch is done, so calls
are serialized; ``abort`` from another thread is posted onto that loop.

    strategy = SGLangStrategy(role_config, ctx)
    strategy.initialize()                                   # sglang.Engine(model_path=..., tp_size=...)
    out = strategy.generate(prompts, SamplingParams(n=8, max_new_tokens=1024))
    strategy.offload_states()                               # release_memory_occupation(["kv_cache", "weights"])
    strategy.reload_states()                                # resume_memory_occupation(["weights"])

Model update (``model_update_transport``, per trainer rank's link):

- from a trainer rank on this worker's device: ``load_shared_bucket`` maps the sender's buffer
  (``transport.engine_receive.EngineReceiver``, as vLLM's workers do) and hands the views to
  ``Engine.update_weights_from_tensor`` (CUDA IPC into the schedulers);
- from one on another device, ``distributed`` (``auto``'s choice): SGLang's schedulers join the
  link's data group themselves (``init_weights_update_group``) and receive each bucket with
  ``update_weights_from_distributed(group, meta)`` (one broadcast per bucket, its tensors back to
  back: ``load_format="flattened_bucket"``) into fresh tensors that their model loads;
- ``tensor``: this worker receives each bucket itself (as for ``hf_infer``) and calls
  ``load_weights`` with views into its buffer, which goes on by ``update_weights_from_tensor``.

Then ``finish_model_update(version)``. Control calls into the engine are ``SGLangEngineCalls``.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from roll.configs.role import RoleConfig
from roll.configs.strategy_configs import SGLangConfig
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.engine_options import EngineOptions, sglang_engine_options
from roll.distributed.strategy.engine_requests import (
    Completion,
    CompletionCollector,
    RequestPlan,
    RequestRegistry,
    completion_from_sglang,
    completions_to_batch,
    require_unit_temperature,
    rows_to_tensor,
    scoring_requests,
    sglang_generate_requests,
)
from roll.distributed.strategy.engine_startup import ENGINES, start_engine
from roll.distributed.strategy.generation import capped, prompt_token_lists, response_width
from roll.distributed.strategy.sglang_engine_calls import SGLangEngineCalls
from roll.distributed.strategy.sglang_frames import sglang_engine_class
from roll.distributed.strategy.sglang_vision import SGLangVision, sglang_vision
from roll.distributed.strategy.sglang_weight_names import sglang_weight_names
from roll.distributed.transport.engine_receive import EngineReceiver, shareable_tensors

MEMORY_TAGS = ["kv_cache", "weights"]
# SGLang's schedulers keep each image's and video's vision-encoder output for later requests with
# the same pixels (SGLANG_VLM_CACHE_SIZE_MB, 100 by default), and neither flush_cache nor a weight
# update clears it: after a model update they fed the old tower's embeddings (seen on H200: a
# Qwen2.5-VL sampled like its old weights after load_weights). A vision-language engine starts with
# it off (0), as SGLang does for rl_on_policy_target; a run that sets it keeps its value.
VLM_CACHE_ENV = "SGLANG_VLM_CACHE_SIZE_MB"


class SGLangStrategy:
    """One SGLang engine per worker; see the module docstring for an example."""

    def __init__(self, role_config: RoleConfig, ctx: WorkerContext) -> None:
        self.role_config = role_config
        self.ctx = ctx
        self.config: SGLangConfig = role_config.strategy_args.strategy_config
        self.engine: Any = None
        self.pad_token_id: int | None = None
        self.weight_version: int | None = None
        self.vision = SGLangVision()  # a vision-language model's tokens (sglang_vision); inert for text
        self.registry = RequestRegistry()
        self.update_groups: set[str] = set()  # SGLang groups joined, one per trainer rank's link
        self._lock = threading.Lock()  # Engine.generate runs the engine's loop: one call at a time
        self._released: set[str] = set()
        self._weights_stale = False
        self._needs_flush = False  # weights changed since the radix cache was last flushed
        self.engine_calls = SGLangEngineCalls(None)  # typed control calls (their engine: initialize)
        # A colocated bucket's views go straight to Engine.update_weights_from_tensor.
        self.receiver = EngineReceiver(ctx.device, self.engine_calls.update_weights_from_tensor, reshare=True)

    # ----------------------------------------------------------------------------------- setup
    def initialize(self) -> None:
        """Start ``sglang.Engine`` after checking every option against the installed ``ServerArgs``."""

        def options(seed: int) -> EngineOptions:
            return sglang_engine_options(self.config, self.role_config, self.ctx.role, seed)

        self.vision = sglang_vision(self.role_config.model_args.model_name_or_path)
        if self.vision.model_type:
            os.environ.setdefault(VLM_CACHE_ENV, "0")  # before the schedulers start: they read it
        engine_class = functools.partial(sglang_engine_class, model_type=self.vision.model_type)
        started = start_engine(ENGINES["sglang"], options, self.role_config, self.ctx, engine_class)
        self.engine, self.pad_token_id = started.engine, started.pad_token_id
        self.engine_calls.engine = self.engine
        self.engine_calls.rename = sglang_weight_names(self.vision.model_type)
        self._weights_stale = self.config.load_format == "dummy"

    def shutdown(self) -> None:
        """Stop the engine's scheduler and detokenizer processes (the worker may then exit).

        SGLang's ``Engine.shutdown`` kills every child process of this process, and a scheduler
        that dies makes the engine kill its parent: one SGLang engine per process, as roll's
        workers have."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def dp_layout(self) -> tuple[int, int, bool]:
        """Every worker is one data-parallel replica (TP lives inside the engine)."""
        return self.ctx.rank, self.ctx.world_size, True

    # ------------------------------------------------------------------------------ generation
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """``params.n`` samples per prompt row, one request each, in one ``Engine.generate`` call;
        rows with images or videos send them with their expanded ids (``sglang_vision``)."""
        width = response_width(self.ctx, params)
        params = capped(params, width)
        prompts = prompt_token_lists(batch)
        plan = RequestPlan(self.registry.new_prefix(self.ctx), len(prompts), params.n, per_sample=True)
        media = self.vision.request_kwargs(batch, prompts, params.n)  # rows' images/videos ({}: text)
        completions = self._generate(plan, prompts, params, media)
        return completions_to_batch(
            batch, completions, params.n, self.pad_token_id, width, params.logprobs, params.temperature
        ).to("cpu")

    def generate_one(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[Completion]:
        """``params.n`` samples of one prompt (``rid`` = ``<request_id>-0-<j>``); ``abort([request_id])``
        from another thread stops them, keeping what was generated (``finish_reason == "abort"``)."""
        params = capped(params, response_width(self.ctx, params))
        plan = RequestPlan(request_id or self.registry.new_prefix(self.ctx), 1, params.n, per_sample=True)
        return self._generate(plan, [list(prompt_ids)], params)

    def abort(self, request_ids: list[str] | None = None) -> list[str]:
        """Abort in-flight requests (all when None; an id also matches ``<id>-...``) by posting
        ``tokenizer_manager.abort_request(rid)`` onto the engine's loop. Returns the ids aborted."""
        ids = self.registry.request_abort(request_ids)
        for rid in self.registry.take_aborts():
            self.engine_calls.abort(rid)
        return ids

    def compute_log_probs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs": [B, R]} from SGLang's input log-probs over prompt + response (no entropy);
        batches sampled at a temperature other than 1 are refused, as for ``vllm``."""
        require_unit_temperature(batch, self.ctx.role, "sglang")
        reqs = scoring_requests(batch)
        extra = self.vision.scoring_kwargs(batch, [r.token_ids for r in reqs])  # VL rows: sglang_vision
        self._ensure_ready()
        with self._lock:
            outputs = self.engine.generate(
                input_ids=[r.token_ids for r in reqs],
                sampling_params=[{"max_new_tokens": 1, "temperature": 1.0} for _ in reqs],
                return_logprob=True,
                logprob_start_len=[max(r.start - 1, 0) for r in reqs],
                **extra,
            )
        rows = [self.vision.response_logprobs(out, req) for out, req in zip(outputs, reqs)]
        return {"log_probs": rows_to_tensor(rows, batch["responses"].shape[1])}

    def _generate(
        self, plan: RequestPlan, prompts: list[list[int]], params: SamplingParams, media: dict | None = None
    ) -> list[Completion]:
        """``plan.n`` samples of each prompt row, one request each (``sglang_generate_requests``);
        ``media``: the requests' ``image_data``/``video_data`` (``SGLangVision.request_kwargs``)."""
        self._ensure_ready()
        context = getattr(self.engine.tokenizer_manager, "context_len", None)
        requests = sglang_generate_requests(plan, prompts, params, context)
        ids = [r.request_id for r in requests]
        # A vision-language model's responses hold no vision tokens (sglang_vision).
        bias = {"logit_bias": self.vision.logit_bias()} if self.vision.excluded else {}
        inputs, sampling = [r.prompt_ids for r in requests], [{**r.sampling, **bias} for r in requests]
        self.registry.add(ids)
        try:
            with self._lock:
                outputs = self.engine.generate(
                    input_ids=inputs,
                    sampling_params=sampling,
                    return_logprob=params.logprobs,
                    rid=ids,
                    **(media or {}),
                )
        finally:
            self.registry.forget(ids)
        if isinstance(outputs, dict):  # a single request comes back unwrapped
            outputs = [outputs]
        collector = CompletionCollector(plan)
        for rid, out in zip(ids, outputs):
            got = out.get("meta_info", {}).get("id", rid)
            if got != rid:
                raise RuntimeError(f"SGLang returned request {got!r} where {rid!r} was expected")
            collector.add(rid, [completion_from_sglang(out, params.logprobs)])
        return collector.ordered()

    def _ensure_ready(self) -> None:
        if self.engine is None:
            raise RuntimeError(f"{self.ctx.role}: call initialize() first")
        if self._weights_stale:
            raise RuntimeError(
                f"{self.ctx.role}: the engine holds no real weights (load_format=dummy or released); "
                "run a model update before generating"
            )
        self._resume([t for t in MEMORY_TAGS if t in self._released])
        if self._needs_flush:
            self.engine_calls.flush_cache()
            self._needs_flush = False

    # --------------------------------------------------------------------------- offload
    def offload_states(self) -> None:
        """Release the KV cache, and the weights too for actor_infer (they come back by model
        update; other roles keep theirs, as SGLang does not back them up by default)."""
        tags = self._offload_tags()
        if not tags or self._released:
            return
        self.engine_calls.release_memory(tags)
        self._released = set(tags)
        if "weights" in tags:
            self._weights_stale = True

    def reload_states(self) -> None:
        """Bring back the weights' memory first (for the model update that follows); the KV cache
        comes back in ``finish_model_update`` (or right away when no update is coming)."""
        if "weights" in self._released:
            self._resume(["weights"])
        else:
            self._resume(sorted(self._released))

    def _offload_tags(self) -> list[str]:
        if not self.config.enable_memory_saver:
            return []
        return MEMORY_TAGS if self.ctx.role == "actor_infer" else ["kv_cache"]

    def _resume(self, tags: list[str]) -> None:
        if tags:
            self.engine_calls.resume_memory(tags)
            self._released -= set(tags)

    # ---------------------------------------------------------------------- model update
    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Hand full HF-named tensors to ``Engine.update_weights_from_tensor`` (CUDA tensors cross
        to the schedulers by IPC; SGLang shards them). The radix cache is flushed once the KV cache
        is back (``finish_model_update`` or the next generation)."""
        self._resume(["weights"] if "weights" in self._released else [])
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        if named and named[0][1].is_cuda:  # SGLang shares them by CUDA IPC: they must lie in memory we own
            named = shareable_tensors(named)
        self.engine_calls.update_weights_from_tensor(named)
        self._weights_stale = False
        self._needs_flush = True

    def load_shared_bucket(
        self, meta: Any, handle: Any, verify: bool = False
    ) -> list[tuple[int, int]] | None:
        """Colocated: map the sender's buffer on this worker's device and load the bucket (a CUDA
        bucket is copied into a buffer of ours first: SGLang shares it on by CUDA IPC)."""
        self._resume(["weights"] if "weights" in self._released else [])
        sums = self.receiver.load_shared(meta, handle, verify=verify)
        self._weights_stale = False
        self._needs_flush = True
        return sums

    def model_update_ranks(self) -> int:
        """Ranks this worker adds to a link's group: one per TP scheduler."""
        return self.config.tensor_parallel_size

    def uses_engine_group(self, colocated: bool) -> bool:
        """Whether a trainer rank's link comes through SGLang's own group (see the module
        docstring); "distributed" from a rank on this worker's device cannot work (NCCL refuses
        two ranks on one device), and the pre-launch checks refuse it first."""
        transport = self.config.model_update_transport
        if colocated and transport == "distributed":
            raise RuntimeError(
                f"{self.ctx.role}: strategy_config.model_update_transport is 'distributed', but a trainer "
                "rank shares this worker's device; use 'auto' (CUDA IPC from that rank) or 'tensor'"
            )
        return not colocated and transport != "tensor"

    def init_weights_update_group(
        self, host: str, port: int, rank_offset: int, world_size: int, group_name: str, backend: str = "nccl"
    ) -> None:
        """SGLang's own group with the sender's store at host:port: its TP schedulers join as
        ``rank_offset + tp rank``. One per trainer rank that feeds this engine (SGLang keeps them by name)."""
        self.engine_calls.init_weights_update_group(host, port, rank_offset, world_size, group_name, backend)
        self.update_groups.add(group_name)

    def update_weights_from_distributed(self, group_name: str, meta: Any) -> None:
        """Receive one bucket on SGLang's group ``group_name`` (one broadcast of its tensors back to
        back) and load it; returns once the schedulers have loaded it."""
        if group_name not in self.update_groups:
            raise RuntimeError(
                f"update_weights_from_distributed on {group_name!r} before init_weights_update_group "
                f"(joined: {sorted(self.update_groups)})"
            )
        self._resume(["weights"] if "weights" in self._released else [])
        self.engine_calls.update_weights_from_distributed(meta, group_name)
        self._weights_stale = False
        self._needs_flush = True

    def finish_model_update(self, version: int) -> None:
        """After the last bucket: bring back the KV cache, flush the radix cache (its KV came from
        the old weights) and record the version."""
        self._resume(sorted(self._released))
        self.engine_calls.flush_cache()
        self._needs_flush = False
        self._weights_stale = False
        self.weight_version = version
