"""``sglang``: generation on SGLang's offline ``Engine``, one engine per worker (``actor_infer`` or
an LLM judge).

Written against SGLang 0.5.x; the engine calls have not been run on this project's machines (see
docs/strategies.md for the exact SGLang names used). Everything that does not need SGLang lives in
``engine_requests``/``engine_options`` and is tested on CPU.

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

Model update: the receiver on this worker receives each bucket itself (as for ``hf_infer``) and
calls ``load_weights`` (or ``load_shared_bucket`` when colocated), which hands the tensors to
``Engine.update_weights_from_tensor`` (CUDA IPC into the schedulers); then
``finish_model_update(version)``. SGLang's own NCCL path is ``init_weights_update_group`` +
``update_weights_from_distributed(meta)``; it needs a sender that builds SGLang's group and
broadcasts tensor by tensor (see docs/strategies.md).
"""

from __future__ import annotations

import importlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from roll.configs.role import RoleConfig
from roll.configs.strategy_configs import SGLangConfig
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.engine_options import (
    dataclass_field_names,
    import_engine,
    sglang_engine_options,
)
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
    sglang_input_logprobs,
    shareable_bucket,
)
from roll.distributed.strategy.generation import capped, prompt_token_lists, response_width
from roll.models.tokenizer import load_tokenizer

MEMORY_TAGS = ["kv_cache", "weights"]


class SGLangStrategy:
    """One SGLang engine per worker; see the module docstring for an example."""

    def __init__(self, role_config: RoleConfig, ctx: WorkerContext) -> None:
        self.role_config = role_config
        self.ctx = ctx
        self.config: SGLangConfig = role_config.strategy_args.strategy_config
        self.engine: Any = None
        self.pad_token_id: int | None = None
        self.weight_version: int | None = None
        self.registry = RequestRegistry()
        self.group_name: str | None = None
        self._lock = threading.Lock()  # Engine.generate runs the engine's loop: one call at a time
        self._calls = itertools.count()
        self._released: set[str] = set()
        self._weights_stale = False
        self._needs_flush = False  # weights changed since the radix cache was last flushed
        self._ipc: Any = None

    # ----------------------------------------------------------------------------------- setup
    def initialize(self) -> None:
        """Start ``sglang.Engine`` after checking every option against the installed ``ServerArgs``."""
        role = self.ctx.role
        sglang = import_engine("sglang", role, "sglang")
        server_args = importlib.import_module("sglang.srt.server_args").ServerArgs
        options = sglang_engine_options(self.config, self.role_config, role, self.ctx.seed + self.ctx.rank)
        # Also checked before launch where the driver imports SGLang (roll.launch.roles); here for
        # drivers without it: only this process is sure to have the engine that will run.
        options.check(dataclass_field_names(server_args), "SGLang", "sglang")
        self.engine = sglang.Engine(**options.kwargs)
        margs = self.role_config.model_args
        self.pad_token_id = load_tokenizer(margs.model_name_or_path, margs.trust_remote_code).pad_token_id
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
        """``params.n`` samples per prompt row, one request each, in one ``Engine.generate`` call."""
        width = response_width(self.ctx, params)
        params = capped(params, width)
        prompts = prompt_token_lists(batch)
        plan = RequestPlan(self._prefix(), len(prompts), params.n, per_sample=True)
        completions = self._generate(plan, prompts, params)
        return completions_to_batch(
            batch, completions, params.n, self.pad_token_id, width, params.logprobs, params.temperature
        ).to("cpu")

    def generate_one(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[Completion]:
        """``params.n`` samples of one prompt (``rid`` = ``<request_id>-0-<j>``); ``abort([request_id])``
        from another thread stops them, keeping what was generated (``finish_reason == "abort"``)."""
        params = capped(params, response_width(self.ctx, params))
        plan = RequestPlan(request_id or self._prefix(), 1, params.n, per_sample=True)
        return self._generate(plan, [list(prompt_ids)], params)

    def abort(self, request_ids: list[str] | None = None) -> list[str]:
        """Abort in-flight requests (all when None; an id also matches ``<id>-...``) by posting
        ``tokenizer_manager.abort_request(rid)`` onto the engine's loop. Returns the ids aborted."""
        ids = self.registry.request_abort(request_ids)
        manager = self.engine.tokenizer_manager
        for rid in self.registry.take_aborts():
            self.engine.loop.call_soon_threadsafe(manager.abort_request, rid)
        return ids

    def compute_log_probs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs": [B, R]} from SGLang's input log-probs over prompt + response (no entropy);
        batches sampled at a temperature other than 1 are refused, as for ``vllm``."""
        require_unit_temperature(batch, self.ctx.role, "sglang")
        reqs = scoring_requests(batch)
        self._ensure_ready()
        with self._lock:
            outputs = self.engine.generate(
                input_ids=[r.token_ids for r in reqs],
                sampling_params=[{"max_new_tokens": 1, "temperature": 1.0} for _ in reqs],
                return_logprob=True,
                logprob_start_len=[max(r.start - 1, 0) for r in reqs],
            )
        rows = [sglang_input_logprobs(out, req) for out, req in zip(outputs, reqs)]
        return {"log_probs": rows_to_tensor(rows, batch["responses"].shape[1])}

    def _prefix(self) -> str:
        return f"{self.ctx.role}{self.ctx.rank}-{next(self._calls)}"

    def _generate(
        self, plan: RequestPlan, prompts: list[list[int]], params: SamplingParams
    ) -> list[Completion]:
        """``plan.n`` samples of each prompt row, one request each (``sglang_generate_requests``)."""
        self._ensure_ready()
        context = getattr(self.engine.tokenizer_manager, "context_len", None)
        requests = sglang_generate_requests(plan, prompts, params, context)
        ids = [r.request_id for r in requests]
        inputs, sampling = [r.prompt_ids for r in requests], [r.sampling for r in requests]
        self.registry.add(ids)
        try:
            with self._lock:
                outputs = self.engine.generate(
                    input_ids=inputs, sampling_params=sampling, return_logprob=params.logprobs, rid=ids
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
            self.engine.flush_cache()
            self._needs_flush = False

    # --------------------------------------------------------------------------- offload
    def offload_states(self) -> None:
        """Release the KV cache, and the weights too for actor_infer (they come back by model
        update; other roles keep theirs, as SGLang does not back them up by default)."""
        tags = self._offload_tags()
        if not tags or self._released:
            return
        _ok(self.engine.release_memory_occupation(tags=tags), "release_memory_occupation")
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
            _ok(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")
            self._released -= set(tags)

    # ---------------------------------------------------------------------- model update
    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Hand full HF-named tensors to ``Engine.update_weights_from_tensor`` (CUDA tensors cross
        to the schedulers by IPC; SGLang shards them). The radix cache is flushed once the KV cache
        is back (``finish_model_update`` or the next generation)."""
        from roll.distributed.model_update.bucket import unpack_bucket

        self._resume(["weights"] if "weights" in self._released else [])
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        flat = None
        if named and named[0][1].is_cuda:  # SGLang shares them by CUDA IPC: they must lie in a buffer we own
            meta, flat, _ = shareable_bucket(named)
            named = unpack_bucket(meta, flat)
        _ok(
            self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=False),
            "update_weights_from_tensor",
        )
        del flat  # kept alive until the schedulers have loaded from it
        self._weights_stale = False
        self._needs_flush = True

    def load_shared_bucket(
        self, meta: Any, handle: Any, verify: bool = False
    ) -> list[tuple[int, int]] | None:
        """Colocated: map the sender's buffer on this worker's device and load the bucket."""
        from roll.distributed.model_update.bucket import unpack_bucket
        from roll.distributed.model_update.checksum import bucket_checksums
        from roll.distributed.model_update.ipc import IpcCache

        self._ipc = self._ipc or IpcCache()
        device = self.ctx.device if handle.kind == "cuda" else torch.device("cpu")
        flat = self._ipc.open(handle, device)[: meta.nbytes]
        sums = [tuple(s) for s in bucket_checksums(meta, flat).tolist()] if verify else None
        self.load_weights(iter(unpack_bucket(meta, flat)))
        return sums

    def init_weights_update_group(
        self, host: str, port: int, rank_offset: int, world_size: int, group_name: str, backend: str = "nccl"
    ) -> None:
        """SGLang's own NCCL group: its TP schedulers join as ``rank_offset + tp rank``."""
        result = self.engine.init_weights_update_group(
            master_address=host,
            master_port=port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        _ok(result, "init_weights_update_group")
        self.group_name = group_name

    def update_weights_from_distributed(self, meta: Any) -> None:
        """Receive one bucket on SGLang's group: the sender broadcasts each tensor in ``meta``'s order."""
        if self.group_name is None:
            raise RuntimeError("update_weights_from_distributed before init_weights_update_group")
        self._resume(["weights"] if "weights" in self._released else [])
        result = self.engine.update_weights_from_distributed(
            names=[t.name for t in meta.tensors],
            dtypes=[str(t.dtype).removeprefix("torch.") for t in meta.tensors],
            shapes=[list(t.shape) for t in meta.tensors],
            group_name=self.group_name,
            flush_cache=False,
        )
        _ok(result, "update_weights_from_distributed")
        self._weights_stale = False
        self._needs_flush = True

    def finish_model_update(self, version: int) -> None:
        """After the last bucket: bring back the KV cache, flush the radix cache (its KV came from
        the old weights) and record the version."""
        self._resume(sorted(self._released))
        self.engine.flush_cache()
        self._needs_flush = False
        self._weights_stale = False
        self.weight_version = version


def _ok(result: Any, call: str) -> None:
    """SGLang answers control calls with ``(success, message)`` (or an object with ``success``)."""
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"SGLang {call} failed: {result[1] if len(result) > 1 else ''}")
    if getattr(result, "success", True) is False:
        raise RuntimeError(f"SGLang {call} failed: {getattr(result, 'message', '')}")
