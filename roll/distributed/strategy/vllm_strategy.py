"""``vllm``: generation on vLLM's V1 engine, one engine per worker (``actor_infer`` or an LLM judge).

Run against vLLM 0.24.0 on H100/H200 (docs/strategies.md says what ran); everything that does not
need vLLM lives in ``engine_requests``/``engine_options`` and is tested on CPU.

The worker owns ``tensor_parallel_size`` devices and the engine runs TP across them. The engine core
runs inside the worker process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): for TP=1 the model too
("uni" executor), for TP>1 vLLM's own worker processes ("mp"). With ``distributed_executor_backend:
ray`` vLLM's Ray executor starts one GPU worker (a Ray actor) per device on the bundles of this
worker's placement group that the resource manager names (``ray_executor_env``), on one node or
across whole nodes; this worker then holds no GPU, and the calls below cross vLLM's message queue. In-process, the model-update calls
(``collective_rpc`` with bucket metadata and CUDA IPC handles) reach the model directly or through
vLLM's pickled worker queue, with no third process and no msgpack restrictions in between.
``vllm.LLM`` is used rather than ``AsyncLLM`` because Ray calls a worker's methods on one thread,
so a synchronous engine needs no event loop in the actor, and ``LLM`` offers
``sleep``/``wake_up``/``collective_rpc``/``reset_prefix_cache`` directly. Requests go through
``llm.llm_engine`` (``add_request``/``step``/``abort_request``, all by our request ids): one loop
serves batch ``generate``, per-request ``generate_one`` and ``abort`` from another thread alike.

    strategy = VLLMStrategy(role_config, ctx)
    strategy.initialize()                                   # vllm.LLM(...) on the worker's devices
    out = strategy.generate(prompts, SamplingParams(n=8, max_new_tokens=1024))
    strategy.offload_states()                               # llm.sleep(level=sleep_level)
    strategy.reload_states()                                # llm.wake_up(...)

Model update (the receiver on this worker calls these; each is one ``self.workers.call`` of a
``RollWorkerExtension`` method, i.e. one ``collective_rpc`` into every TP worker)::

    strategy.join_model_update_group(host, port, prefix, rank_offset, world_size)
    strategy.receive_bucket(prefix, meta)         # broadcast link: every TP worker receives + loads
    strategy.take_checksums(prefix)               # after the link's last bucket: checksums in order
    strategy.load_shared_bucket(meta, handle)     # colocated link: map the sender's buffer instead
    strategy.finish_model_update(version)         # reset prefix cache, wake the KV cache, record it
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from roll.configs.role import RoleConfig
from roll.configs.strategy_configs import VLLMConfig
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.engine_options import EngineOptions, vllm_engine_options
from roll.distributed.strategy.engine_requests import (
    Completion,
    CompletionCollector,
    RequestPlan,
    RequestRegistry,
    aborted_completion,
    completions_from_vllm,
    completions_to_batch,
    require_unit_temperature,
    rows_to_tensor,
    scoring_requests,
    vllm_generate_requests,
    vllm_prompt_logprobs,
)
from roll.distributed.strategy.engine_startup import ENGINES, start_engine
from roll.distributed.strategy.engine_vision import VisionTokens, vision_tokens, vllm_prompts
from roll.distributed.strategy.generation import (
    capped,
    prompt_token_lists,
    response_width,
)
from roll.distributed.strategy.vllm_worker_extension import RollWorkerExtension, VLLMWorkerCalls
from roll.distributed.transport.engine_receive import shareable_bucket
from roll.models.vision import has_vision_inputs

EXTENSION = "roll.distributed.strategy.vllm_worker_extension.RollWorkerExtension"
_ABORTED = object()


class VLLMStrategy:
    """One vLLM engine per worker; see the module docstring for an example."""

    def __init__(self, role_config: RoleConfig, ctx: WorkerContext) -> None:
        self.role_config = role_config
        self.ctx = ctx
        self.config: VLLMConfig = role_config.strategy_args.strategy_config
        self.llm: Any = None
        self.workers = VLLMWorkerCalls(None)  # calls into the TP workers (their engine: initialize)
        self.pad_token_id: int | None = None
        self.vision = VisionTokens()  # a vision-language model's tokens and logit_bias (engine_vision)
        self.weight_version: int | None = None
        self.registry = RequestRegistry()
        self._vllm: Any = None
        self._lock = threading.Lock()  # one thread adds to / steps the engine at a time
        self._finished: dict[str, Any] = {}  # request id -> RequestOutput (or _ABORTED)
        self._asleep: set[str] = set()  # memory tags released by sleep: "weights", "kv_cache"
        self._weights_stale = False  # dummy or level-2-discarded weights: a model update must come first

    # ----------------------------------------------------------------------------------- setup
    def initialize(self) -> None:
        """Start ``vllm.LLM`` after checking every option against the installed ``vllm.EngineArgs``."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process (module docstring)
        # TP>1 worker processes must not be forked from a process that has touched CUDA (a TP=2 test
        # on 2 x H200 failed so: "WorkerProc initialization failed").
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if self.config.workers_on_ray:
            os.environ.update(ray_executor_env(os.environ))
        spans_nodes = self.config.workers_on_ray and int(os.environ.get("ROLL_ENGINE_NODES", "1")) > 1

        def options(seed: int) -> EngineOptions:
            return vllm_engine_options(
                self.config, self.role_config, self.ctx.role, seed, EXTENSION, spans_nodes=spans_nodes
            )

        started = start_engine(ENGINES["vllm"], options, self.role_config, self.ctx)
        self._vllm, self.llm, self.pad_token_id = started.module, started.engine, started.pad_token_id
        self.vision = vision_tokens(self.role_config.model_args.model_name_or_path)
        # One call at a time wherever calls cross vLLM's message queue (TP > 1, or Ray's executor).
        in_process = self.config.tensor_parallel_size == 1 and not self.config.workers_on_ray
        self.workers = VLLMWorkerCalls(self.llm, serialize=not in_process)
        if self.vision.model_type == "qwen3_omni_moe":
            self.workers.call(RollWorkerExtension.roll_fix_mrope_positions)  # vllm_omni_positions
        self._weights_stale = self.config.load_format == "dummy"

    def dp_layout(self) -> tuple[int, int, bool]:
        """Every worker is one data-parallel replica (TP lives inside the engine)."""
        return self.ctx.rank, self.ctx.world_size, True

    # ------------------------------------------------------------------------------ generation
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """``params.n`` samples per prompt row: one engine request of ``n`` per row, all submitted
        before the engine steps, so vLLM batches the whole call. A seed is applied as
        ``seed_mode`` says (see VLLMConfig)."""
        width = response_width(self.ctx, params)
        params = capped(params, width)
        if params.seed is not None and self.config.seed_mode == "step":
            self._ensure_ready()
            self.workers.call(RollWorkerExtension.roll_manual_seed, params.seed)
            params = dataclasses.replace(params, seed=None)
        prompts = prompt_token_lists(batch)
        plan = RequestPlan(self.registry.new_prefix(self.ctx), len(prompts), params.n, per_sample=False)
        extra = {"logit_bias": self.vision.bias} if self.vision.bias else {}  # VL: engine_vision
        requests = [
            (r.request_id, r.prompt_ids, self._sampling({**r.sampling, **extra}))
            for r in vllm_generate_requests(plan, prompts, params)
        ]
        with_images = vllm_prompts(
            batch, prompts, self.vision.image, self.vision.video, self.vision.frames, self.vision.audio
        )  # None: text only
        if with_images is not None:  # one request per row, in row order
            requests = [(rid, prompt, sampling) for (rid, _, sampling), prompt in zip(requests, with_images)]
        collector = CompletionCollector(plan)
        for rid, output in self._run(requests).items():
            collector.add(rid, self._completions(output, params.n, params.logprobs))
        completions = collector.ordered()
        return completions_to_batch(
            batch, completions, params.n, self.pad_token_id, width, params.logprobs, params.temperature
        ).to("cpu")

    def generate_one(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[Completion]:
        """``params.n`` samples of one prompt as separate requests (``<request_id>-0-<j>``), so
        ``abort([request_id])`` from another thread stops them; aborted samples come back empty with
        ``finish_reason == "abort"``. Safe to call from several threads at once, so a seed is always
        the requests' own (``seed_mode`` applies to ``generate``)."""
        params = capped(params, response_width(self.ctx, params))
        plan = RequestPlan(request_id or self.registry.new_prefix(self.ctx), 1, params.n, per_sample=True)
        requests = [
            (r.request_id, r.prompt_ids, self._sampling(r.sampling))
            for r in vllm_generate_requests(plan, [prompt_ids], params)
        ]
        collector = CompletionCollector(plan)
        for rid, output in self._run(requests).items():
            collector.add(rid, self._completions(output, 1, params.logprobs))
        return collector.ordered()

    def abort(self, request_ids: list[str] | None = None) -> list[str]:
        """Abort in-flight requests (all when None; an id also matches ``<id>-...``); the engine
        loop applies it before its next step. Returns the request ids marked."""
        return self.registry.request_abort(request_ids)

    def compute_log_probs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs": [B, R]} from vLLM's prompt log-probs over prompt + response (no entropy).

        vLLM scores prompts with the raw model distribution (temperature 1), so batches sampled at
        another temperature are refused rather than scored inconsistently with the trainer.
        """
        require_unit_temperature(batch, self.ctx.role, "vllm")
        if has_vision_inputs(batch):
            raise ValueError(
                f"{self.ctx.role}: vllm scores text rows only; score rows with images on hf_infer or fsdp2_train"
            )
        reqs = scoring_requests(batch)
        sampling = self._sampling(
            {"n": 1, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "detokenize": False}
        )
        ids = RequestPlan(self.registry.new_prefix(self.ctx), len(reqs), 1, per_sample=False).request_ids()
        outputs = self._run([(rid, req.token_ids, sampling) for rid, req in zip(ids, reqs)])
        if any(outputs[rid] is _ABORTED for rid in ids):
            raise RuntimeError(f"{self.ctx.role}: a scoring request was aborted")
        rows = [vllm_prompt_logprobs(outputs[rid], req) for rid, req in zip(ids, reqs)]
        return {"log_probs": rows_to_tensor(rows, batch["responses"].shape[1])}

    # ----------------------------------------------------------------------- the request loop
    def _sampling(self, kwargs: dict[str, Any]) -> Any:
        final_only = self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        return self._vllm.SamplingParams(**kwargs, output_kind=final_only)

    @staticmethod
    def _completions(output: Any, count: int, logprobs: bool) -> list[Completion]:
        if output is _ABORTED:
            return [aborted_completion() for _ in range(count)]
        return completions_from_vllm(output, logprobs)

    def _run(self, requests: list[tuple[str, list[int], Any]]) -> dict[str, Any]:
        """Submit ``(request id, prompt ids, vllm.SamplingParams)`` and step the engine until all
        have finished or were aborted; returns their outputs by request id."""
        self._ensure_ready()
        engine = self.llm.llm_engine
        ids = [rid for rid, _, _ in requests]
        self.registry.add(ids)
        results: dict[str, Any] = {}
        try:
            with self._lock:
                # vLLM keeps our id as the request's external id: outputs and aborts use it.
                for rid, prompt, sampling in requests:  # a dict: a prompt with images (engine_vision)
                    prompt = prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt}
                    engine.add_request(rid, prompt, sampling)
            pending = set(ids)
            while pending:
                busy = self._step(engine)
                for rid in [r for r in pending if r in self._finished]:
                    results[rid] = self._finished.pop(rid)
                    pending.discard(rid)
                if pending and not busy and not any(r in self._finished for r in pending):
                    raise RuntimeError(
                        f"vLLM has no unfinished requests but {len(pending)} of ours never finished"
                    )
        finally:
            self.registry.forget(ids)
        return results

    def _step(self, engine: Any) -> bool:
        """Apply pending aborts, then one engine step; finished outputs go to ``_finished``."""
        with self._lock:
            aborts = self.registry.take_aborts()
            if aborts:
                engine.abort_request(aborts)
                for rid in aborts:
                    self._finished.setdefault(rid, _ABORTED)
                    self.registry.finish(rid)
            if not engine.has_unfinished_requests():
                return False
            for output in engine.step():
                rid = output.request_id
                if output.finished and rid in self.registry:
                    self._finished[rid] = output
                    self.registry.finish(rid)
            return True

    def _ensure_ready(self) -> None:
        if self.llm is None:
            raise RuntimeError(f"{self.ctx.role}: call initialize() first")
        if self._weights_stale:
            raise RuntimeError(
                f"{self.ctx.role}: the engine holds no real weights (load_format=dummy or sleep_level=2); "
                "run a model update before generating"
            )
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()

    # --------------------------------------------------------------------------- offload
    def offload_states(self) -> None:
        """``llm.sleep(level)``: level 1 keeps the weights in CPU memory, level 2 drops them (the
        next model update restores them); both drop the KV cache. A no-op for sleep_level 0."""
        if self.config.sleep_level == 0 or self._asleep:
            return
        self.llm.sleep(level=self.config.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        if self.config.sleep_level == 2:
            self._weights_stale = True

    def reload_states(self) -> None:
        """Level 1: wake everything. Level 2: wake only the weights' memory, so the model update
        that must follow has room; the KV cache comes back in ``finish_model_update``."""
        if not self._asleep:
            return
        tags = ["weights"] if self.config.sleep_level == 2 else ["weights", "kv_cache"]
        self.llm.wake_up(tags=tags)
        self._asleep -= set(tags)

    # ---------------------------------------------------------------------- model update
    def model_update_ranks(self) -> int:
        """Ranks this worker adds to a broadcast group: one per TP worker of its engine."""
        return self.config.tensor_parallel_size

    def join_model_update_group(
        self, host: str, port: int, prefix: str, rank_offset: int, world_size: int, backend: str = "nccl"
    ) -> list[int]:
        """Every TP worker joins the sender's group (store at host:port) as ``rank_offset + tp rank``."""
        return self.workers.call(
            RollWorkerExtension.roll_init_update_group, host, port, prefix, rank_offset, world_size, backend
        )

    def leave_model_update_group(self) -> None:
        self.workers.call(RollWorkerExtension.roll_destroy_update_group)

    def receive_bucket(self, group: str, meta: Any, verify: bool = False) -> None:
        """Every TP worker receives the next bucket broadcast on ``group`` (a data group it joined)
        into that group's buffer and loads it, queued on its device without waiting; the checksums
        come from ``take_checksums(group)``."""
        self._wake_weights()
        self.workers.call(RollWorkerExtension.roll_receive_bucket, group, meta, verify)

    def take_checksums(self, group: str) -> list[tuple[int, int]]:
        """Wait for the buckets received on ``group`` to load; their per-tensor checksums, in order."""
        return _agreed(self.workers.call(RollWorkerExtension.roll_take_checksums, group))

    def load_shared_bucket(
        self, meta: Any, handle: Any, verify: bool = False
    ) -> list[tuple[int, int]] | None:
        """Colocated: every TP worker maps the sender's buffer (on this worker's device) and loads it."""
        if self.config.workers_on_ray:  # refused before launch (placement.check_ray_engines_own_devices)
            raise RuntimeError(
                f"{self.ctx.role}: an engine on Ray's executor takes no colocated model update"
            )
        self._wake_weights()
        device_index = self.ctx.device.index if self.ctx.is_cuda else None
        return _agreed(
            self.workers.call(RollWorkerExtension.roll_load_shared_bucket, meta, handle, device_index, verify)
        )

    def finish_model_update(self, version: int) -> None:
        """After the last bucket: forget cached prefixes and encoder outputs (both came from the old weights), wake
        the KV cache if it still sleeps, and record the version in every TP worker."""
        self.workers.call(RollWorkerExtension.roll_finish_update, version)
        self._forget_cached_outputs()
        self._weights_stale = False
        self.weight_version = version
        if "kv_cache" in self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep.discard("kv_cache")

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-named tensors (e.g. views into a bucket the worker received itself): CUDA
        tensors reach the TP workers by CUDA IPC (no copy when they are views into one buffer this
        process owns), CPU tensors by value. Counts as a complete model update."""
        self._wake_weights()
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        if self.config.tensor_parallel_size == 1 and not self.config.workers_on_ray:
            self.workers.call(RollWorkerExtension.roll_load_tensors, named)  # the model is in this process
        elif named and named[0][1].is_cuda and not self.config.workers_on_ray:
            meta, flat, handle = shareable_bucket(named)
            self.workers.call(
                RollWorkerExtension.roll_load_shared_bucket, meta, handle, flat.device.index, False
            )
        else:
            self.workers.call(
                RollWorkerExtension.roll_load_tensors, [(name, tensor.cpu()) for name, tensor in named]
            )
        self._forget_cached_outputs()
        self._weights_stale = False

    def _forget_cached_outputs(self) -> None:
        """After new weights: the cached prefixes' KV and the cached vision-encoder outputs (vLLM
        keeps an image's embeddings for later requests with the same image) came from the old
        weights. Without the encoder reset a VL engine went on using the old tower's embeddings
        (tests/test_vllm_vl_gpu.py, 2026-11-28)."""
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def _wake_weights(self) -> None:
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")


def ray_executor_env(env: Mapping[str, str]) -> dict[str, str]:
    """vLLM's variables for its Ray executor, from what the resource manager gave this worker
    (``env``): the bundles of the worker's placement group that hold its devices, in device_mapping
    order (vLLM's GPU worker of rank i on the i-th), and each GPU worker's share of its device (1/k
    when k roles time-share it). vLLM 0.24's default Ray executor (V2: its message queues, no Ray
    compiled graph) is named, not left to vLLM's default. Without the resource manager's variables
    (an engine started in a placement group of one's own) vLLM takes the group's first bundles."""
    out = {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": env.get("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1")}
    if env.get("ROLL_ENGINE_BUNDLES"):
        out["VLLM_RAY_BUNDLE_INDICES"] = env["ROLL_ENGINE_BUNDLES"]
    if env.get("ROLL_ENGINE_DEVICE_SHARE"):
        out["VLLM_RAY_PER_WORKER_GPUS"] = env["ROLL_ENGINE_DEVICE_SHARE"]
    return out


def _agreed(results: list[Any]) -> Any:
    """The TP workers' common answer (they all receive full buckets, so their checksums agree)."""
    if any(r != results[0] for r in results[1:]):
        raise RuntimeError(f"TP workers disagree on a received bucket: {results}")
    return results[0] if results else None
