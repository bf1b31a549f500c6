"""``megatron_infer``: forward-only megatron-core model for ``reference`` log-probs and, without
vLLM/SGLang, ``actor_infer`` generation with a KV cache.

>>> strategy = MegatronInferStrategy(role_config, ctx)
>>> strategy.initialize()                                      # parallel state + HF weights, no optimizer
>>> ref = strategy.compute_log_probs(batch)["log_probs"]       # [B, R] on every rank
>>> out = strategy.generate(prompt_batch, SamplingParams(n=4, max_new_tokens=256, temperature=1.0))
>>> strategy.load_weights(actor_train_strategy.iter_hf_weights())   # model update, resharded here

Generation is our own KV-cached loop (``roll.models.megatron.kv_generate``) over megatron's
``StaticInferenceContext``: megatron-core 0.16.1's inference engines expect TransformerEngine or
its dynamic batching kernels, neither of which the GPU machines here have. It supports TP and PP
(not VPP, not sequence parallelism). ``infer_logprobs`` follow ``hf_infer``'s definition.

A vision-language model (Qwen2.5-VL, ``roll.models.megatron.qwen2_5_vl``) scores rows with images
here (``reference``); it does not generate with them (ROLL's Qwen2.5-VL files generate with vLLM).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from roll.configs.role import RoleConfig
from roll.configs.strategy_configs import MegatronConfig
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.generation import (
    build_generation_batch,
    capped,
    prompt_token_lists,
    response_width,
    stop_token_ids,
)
from roll.models.megatron import parallel
from roll.models.megatron.forward import shape_sync_group
from roll.models.megatron.kv_generate import generate_tokens, make_stop_check
from roll.models.megatron.runtime import (
    build_chunks,
    forward_log_probs,
    move_params,
)
from roll.models.vision import is_vision_config


class MegatronInferStrategy:
    """Inference side of megatron-core for one rank of a role (see the module docstring)."""

    def __init__(self, role_config: RoleConfig, ctx: WorkerContext) -> None:
        self.role_config = role_config
        self.ctx = ctx
        self.config: MegatronConfig = role_config.strategy_args.strategy_config
        self.hf_config = None
        self.chunks: list[torch.nn.Module] = []
        self.tokenizer = None
        self._offloaded = False
        self._loader = None  # NamedTensorLoader of the model update in progress

    def initialize(self) -> None:
        from roll.models.tokenizer import load_tokenizer

        self.hf_config, self.chunks = build_chunks(self.role_config, self.ctx, self.config)
        for chunk in self.chunks:
            chunk.eval()
            chunk.requires_grad_(False)
        model_args = self.role_config.model_args
        self.tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.trust_remote_code)

    def dp_layout(self) -> tuple[int, int, bool]:
        return parallel.dp_layout()

    def _vocab_size(self) -> int:
        """The HF vocab (a vision-language config keeps it in ``text_config``)."""
        from roll.models.megatron.families import language_config

        return language_config(self.hf_config).vocab_size

    def compute_log_probs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs", "entropy"} [B, R] (CPU) at the batch's sampling temperature."""
        self._ensure_loaded()
        size = max(1, self.role_config.infer_batch_size)
        return forward_log_probs(self.chunks, batch, self.config, self._vocab_size(), size, self.hf_config)

    @torch.no_grad()
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        """``params.n`` samples per prompt (row i*n + j is sample j of prompt i), ``infer_batch_size``
        prompts at a time, padded to ``pipeline.response_length`` (``max_new_tokens`` without one)."""
        if is_vision_config(self.hf_config):  # the pre-launch check refuses this layout first
            raise ValueError(
                f"{self.ctx.role}: megatron_infer does not generate with a vision-language model "
                "(its KV-cached loop takes no images); generate with vllm"
            )
        self._ensure_loaded()
        width = response_width(self.ctx, params)
        params = capped(params, width)
        prompts = prompt_token_lists(batch)
        eos_ids = self._eos_ids(params)
        stop = make_stop_check(params.stop or [], self.tokenizer, params.min_new_tokens)
        step = max(1, self.role_config.infer_batch_size)
        responses: list[list[int]] = []
        logprobs: list[list[float]] = []
        for i in range(0, len(prompts), step):
            rows = [p for p in prompts[i : i + step] for _ in range(params.n)]
            toks, logps = generate_tokens(
                self.chunks,
                rows,
                params,
                eos_ids,
                self._vocab_size(),
                self.tokenizer.pad_token_id,
                stop,
                shape_sync_group(self.config),
            )
            responses += toks
            logprobs += logps
        return build_generation_batch(
            batch,
            responses,
            logprobs if params.logprobs else None,
            params.n,
            self.tokenizer.pad_token_id,
            width,
            temperature=params.temperature,
        ).to("cpu")

    def _eos_ids(self, params: SamplingParams) -> list[int]:
        return stop_token_ids(getattr(self.hf_config, "eos_token_id", None), self.tokenizer, params)

    # --------------------------------------------------------------------- offload / model update
    def offload_states(self) -> None:
        """Weights to CPU and the CUDA cache emptied (no-op on CPU)."""
        if self.ctx.is_cuda and not self._offloaded:
            move_params(self.chunks, "cpu")
            self._offloaded = True

    def reload_states(self) -> None:
        if self._offloaded:
            move_params(self.chunks, self.ctx.device)
            self._offloaded = False

    def _ensure_loaded(self) -> None:
        self.reload_states()

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights this rank's replica holds, by HF name (TP rank 0 of each replica yields them
        gathered): what a model update's verification pass compares against the trainer's stream.
        Collective over the engine's TP / expert-TP groups: every rank must iterate."""
        from roll.models.megatron.hf_io import export_hf_weights

        self._ensure_loaded()
        yield from export_hf_weights(self.chunks, every_replica=True)

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Full HF-named tensors (any subset); each rank keeps its TP / PP / EP shard. A model
        update calls this once per bucket: parts of a fused parameter (q/k/v, gate/up) are held
        across calls until complete, and ``finish_model_update`` checks none is left waiting."""
        from roll.models.megatron.named_loading import NamedTensorLoader

        self._ensure_loaded()
        if self._loader is None:
            self._loader = NamedTensorLoader(self.chunks)
        self._loader.load(named_tensors)

    def finish_model_update(self, version: int) -> None:
        """End of one model update: raise if a fused parameter never got all its parts."""
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.finish()
