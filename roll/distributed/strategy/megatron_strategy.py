"""``megatron_train``: megatron-core training (TP / PP / VPP / SP / EP / DP, distributed optimizer).

>>> strategy = MegatronTrainStrategy(role_config, ctx)       # ctx: this rank of actor_train
>>> strategy.initialize()                                     # parallel state, HF weights, optimizer
>>> old = strategy.compute_log_probs(batch)["log_probs"]      # [B, R], same on every rank
>>> metrics = strategy.train_step(batch.split(2), loss_fn)    # {"loss", ..., "grad_norm", "lr"}
>>> strategy.offload_states(); ...; strategy.reload_states()  # share the GPUs with actor_infer

Data: the micro-batches given to ``train_step`` / the batch given to ``compute_log_probs`` are this
rank's data-parallel shard; the TP / CP / PP peers of a DP group receive the same rows (the cluster
dispatches the DP chunk to every rank of the group). ``dp_layout()`` names the rank whose outputs
count, though every rank returns the same outputs.

Each micro-batch runs through ``get_forward_backward_func()`` (1F1B, interleaved with VPP); on the
last stage the response log-probs and entropies are computed vocab-parallel and handed to the
pipeline's ``LossFn`` as {"log_probs", "entropy"} [b, R]. Micro-batches are packed rows by default
and re-formed by ``max_tokens_per_microbatch`` when set (``roll.models.packing``,
``roll.models.microbatch``); each micro-batch loss is weighted by its share of the mini-batch's
``loss_agg_mode`` normaliser over all DP ranks (``loss_weights``), so the step's gradient is that of
the loss aggregated over the whole mini-batch. Then gradients are clipped to
``max_grad_norm``, the LR set from ``roll.utils.lr_schedule`` and the optimizer steps. A value head
(critic) is not supported here: use fsdp2_train for the critic.

LoRA (``model_args.lora_rank``, ``roll.models.megatron.lora``): adapters on the targeted
column/row-parallel layers, added after the HF weights load and before DDP, so only they get
gradient buffers and optimizer state; ``iter_hf_weights`` and the HF export merge them into each TP
shard before the gather, and checkpoints hold the adapters and their optimizer state
(docs/megatron.md "LoRA").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from roll.configs.role import RoleConfig
from roll.configs.strategy_configs import MegatronConfig
from roll.core.batch import Batch
from roll.core.loss import LossFn
from roll.core.worker_context import WorkerContext
from roll.models.logprobs import batch_temperature
from roll.models.megatron import dist_checkpoint, lora, parallel
from roll.models.megatron.families import padded_rows_only
from roll.models.megatron.forward import (
    PackedMicroBatch,
    pack_micro_batches,
    packing_enabled,
    response_logprobs,
    run_schedule,
    seq_multiple_for,
    shape_sync_group,
)
from roll.models.megatron.hf_io import unwrap
from roll.models.megatron.offload import StateOffloader
from roll.models.megatron.runtime import (
    broadcast_metrics,
    build_chunks,
    forward_log_probs,
)
from roll.models.microbatch import loss_agg_mode_of, loss_weights, rebudget
from roll.models.vision import response_excluded_tokens
from roll.utils.lr_schedule import build_lr_lambda
from roll.utils.start_marks import init_span


class MegatronTrainStrategy:
    """Training side of megatron-core for one rank of a role (see the module docstring)."""

    def __init__(self, role_config: RoleConfig, ctx: WorkerContext) -> None:
        self.role_config = role_config
        self.ctx = ctx
        self.config: MegatronConfig = role_config.strategy_args.strategy_config
        self.hf_config: Any = None
        self.model: list[torch.nn.Module] = []  # DDP-wrapped GPTModel chunks
        self.optimizer: Any = None
        self.offloader: StateOffloader | None = None
        self.step_count = 0
        self._loader = None  # NamedTensorLoader of the model update in progress
        # What the adapters' checkpoints depend on (lora.layout); None without lora_rank.
        self.lora_layout: dict[str, Any] | None = None
        # LR factor per optimizer step, over the schedule length the driver computed; None (a
        # linear/cosine schedule without a length): the learning rate stays constant.
        total = ctx.total_optimizer_steps
        self._lr_lambda = (
            build_lr_lambda(role_config.training_args, total) if total or _constant(role_config) else None
        )

    # ------------------------------------------------------------------------------------- setup
    def initialize(self, hf_config: Any = None) -> None:
        """Parallel state, model (HF weights of ``model_name_or_path``; random weights of
        ``hf_config``'s architecture when given, for benchmarks), DDP, optimizer."""
        self.hf_config, chunks = build_chunks(self.role_config, self.ctx, self.config, hf_config)
        if self.config.freeze_moe_router:
            freeze_routers(chunks)
        if self.role_config.model_args.freeze_module_prefix:
            from roll.models.megatron.qwen2_5_vl import freeze_vision_tower

            path = f"{self.ctx.role}.model_args.freeze_module_prefix"
            freeze_vision_tower(chunks, self.role_config.model_args.freeze_module_prefix, path)
        if self.role_config.model_args.uses_lora:
            self.lora_layout = self._apply_lora(chunks)
        with init_span("megatron.ddp_optimizer"):
            self.model = _wrap_ddp(chunks, self.config)
            self.optimizer = _build_optimizer(self.model, self.role_config, self.config)
        _configure_schedule(self.model)
        self.offloader = StateOffloader(self.model, self.optimizer)

    def _apply_lora(self, chunks: list[torch.nn.Module]) -> dict[str, Any]:
        """Adapters on ``lora_target`` (everything else frozen), A drawn from the run's seed, the
        same in every layout; returns the checkpoint layout."""
        args = self.role_config.model_args
        path = f"{self.ctx.role}.model_args.lora_target"
        layout = lora.layout(chunks[0].config, args.lora_target, args.lora_rank, path)
        alpha = args.lora_alpha if args.lora_alpha is not None else float(args.lora_rank)
        lora.apply_lora(
            chunks, args.lora_target, args.lora_rank, alpha, args.lora_dropout, seed=self.ctx.seed, path=path
        )
        return layout

    def dp_layout(self) -> tuple[int, int, bool]:
        return parallel.dp_layout()

    def _vocab_size(self) -> int:
        """The HF vocab (a vision-language config keeps it in ``text_config``)."""
        from roll.models.megatron.families import language_config

        return language_config(self.hf_config).vocab_size

    # ----------------------------------------------------------------------------------- forward
    def compute_log_probs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs", "entropy"} [B, R] (CPU) at the batch's sampling temperature."""
        self.offloader.ensure_params_loaded()
        size = max(1, self.role_config.infer_batch_size)
        return forward_log_probs(self.model, batch, self.config, self._vocab_size(), size, self.hf_config)

    # ---------------------------------------------------------------------------------- training
    def train_step(self, micro_batches: list[Batch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over this DP rank's ``micro_batches``; metrics on every rank."""
        from megatron.core import parallel_state as ps

        self.offloader.ensure_loaded()
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        packed = self._prepare(micro_batches, loss_fn)
        temperature = batch_temperature(packed[0].batch)
        tp_group = ps.get_tensor_model_parallel_group()
        vocab, excluded = self._vocab_size(), response_excluded_tokens(self.hf_config)

        def loss_maker(mb: PackedMicroBatch, logits: torch.Tensor):
            outputs = response_logprobs(logits, mb, tp_group, temperature, vocab, excluded)
            loss, metrics = loss_fn(outputs, mb.batch)
            payload = {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}
            return loss * mb.loss_scale, payload

        _check_micro_batch_count(len(packed), len(self.model))
        payloads = run_schedule(self.model, packed, loss_maker, forward_only=False)
        lr = self._apply_lr()
        _, grad_norm, _ = self.optimizer.step()
        self.step_count += 1
        metrics = None
        if payloads:
            metrics = {k: sum(p[k] for p in payloads) / len(payloads) for k in payloads[0]}
        metrics = broadcast_metrics(metrics)
        return {**metrics, "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": lr}

    def _prepare(self, micro_batches: list[Batch], loss_fn: LossFn) -> list[PackedMicroBatch]:
        """Micro-batches re-formed by the token budget, laid out for the model, each with the loss
        weight that keeps the mini-batch's ``loss_agg_mode`` over micro-batches and DP ranks."""
        from megatron.core import parallel_state as ps

        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.ctx.is_cuda else torch.device("cpu")
        )
        # Rows are exchanged over DP only (CP peers hold the same rows); the loss weights count over
        # DP x CP, as DDP averages over it (megatron scales each loss by the CP size).
        budget = self.config.max_tokens_per_microbatch
        micro_batches = rebudget(micro_batches, budget, ps.get_data_parallel_group())
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        weights = loss_weights(micro_batches, loss_agg_mode_of(loss_fn), dp_cp)
        packed = pack_micro_batches(
            micro_batches,
            seq_multiple_for(self.config),
            device,
            shape_sync_group(self.config),
            packed=packing_enabled(self.config, padded_rows_only(self.hf_config)),
        )
        for mb, weight in zip(packed, weights):
            mb.loss_scale = weight * len(packed)  # the schedule divides by the micro-batch count
        return packed

    def _apply_lr(self) -> float:
        """LR (and weight decay, 0 for biases and norms via megatron's ``wd_mult``) of this step,
        as megatron's OptimizerParamScheduler would set them."""
        args = self.role_config.training_args
        factor = self._lr_lambda(self.step_count) if self._lr_lambda else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = group.get("max_lr", args.learning_rate) * factor
            group["weight_decay"] = args.weight_decay * group.get("wd_mult", 1.0)
        return args.learning_rate * factor

    # --------------------------------------------------------------------------------- offload
    def offload_states(self) -> None:
        """Move params / grads / optimizer state to CPU per ``offload_params/grads/optimizer``."""
        cfg = self.config
        self.offloader.offload(
            params=cfg.offload_params, grads=cfg.offload_grads, optimizer=cfg.offload_optimizer
        )

    def reload_states(self) -> None:
        self.offloader.reload()

    # ---------------------------------------------------------------------------------- weights
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors; every rank must iterate (TP gathers are collective)."""
        from roll.models.megatron.hf_io import export_hf_weights

        # Parameters only: a colocated trainer's gradients and optimizer state stay offloaded
        # through the update and the generation that follows.
        self.offloader.ensure_params_loaded()
        self._finish_param_gather()
        yield from export_hf_weights([unwrap(c) for c in self.model])

    def _finish_param_gather(self) -> None:
        """All-gather the parameters the last optimizer step left sharded; collective over DP.

        With ``overlap_param_gather`` megatron's distributed optimizer writes only this DP rank's
        shard after ``step()`` and defers the all-gather of the others to the next forward's
        pre-hooks, so code reading parameters directly (exports, checkpoints) would see the other
        ranks' shards from the step before. ``force_sync`` gathers synchronously and marks each
        bucket group as dispatched with no pending handle, so the next forward's pre-hooks find
        nothing to wait for; the next ``finish_grad_sync`` re-arms them as usual.
        """
        for chunk in self.model:
            ddp = chunk.ddp_config
            if ddp.use_distributed_optimizer and ddp.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Full HF-named tensors (any subset), possibly one bucket per call: parts of a fused
        parameter are held across calls until complete (see ``finish_model_update``)."""
        from roll.models.megatron.named_loading import NamedTensorLoader

        self.offloader.ensure_loaded()
        if self._loader is None:
            self._loader = NamedTensorLoader([unwrap(c) for c in self.model])
        self._loader.load(named_tensors)
        self.optimizer.reload_model_params()

    def finish_model_update(self, version: int) -> None:
        """End of one model update: raise if a fused parameter never got all its parts."""
        loader, self._loader = self._loader, None
        if loader is not None:
            loader.finish()

    def save_hf_checkpoint(self, path: str) -> None:
        from roll.models.loading import model_path
        from roll.models.megatron.hf_io import save_hf_checkpoint

        self.offloader.ensure_loaded()
        self._finish_param_gather()
        chunks = [unwrap(c) for c in self.model]
        save_hf_checkpoint(
            chunks, self.hf_config, path, tokenizer_dir=model_path(self.role_config.model_args)
        )

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Model + optimizer (+ step) as a megatron dist checkpoint under ``path/megatron``: sharded
        by global parameter, so it loads into any TP / PP / VPP / DP layout (see
        ``roll.models.megatron.dist_checkpoint``)."""
        self.offloader.ensure_loaded()
        self._finish_param_gather()  # the model part of the checkpoint is read from the params
        dist_checkpoint.save(self.model, self.optimizer, self.step_count, path, lora=self.lora_layout)

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote into this strategy's layout (any TP / PP / VPP /
        DP): weights, optimizer state (main params, Adam moments, step) and ``step_count``."""
        self.offloader.ensure_loaded()
        key = f"{self.ctx.role}.model_args"
        self.step_count = dist_checkpoint.load(
            self.model, self.optimizer, path, lora=self.lora_layout, key=key
        )


def _constant(role_config: RoleConfig) -> bool:
    args = role_config.training_args
    return args.lr_scheduler_type == "constant" and args.warmup_ratio == 0


def _check_micro_batch_count(count: int, chunks: int) -> None:
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if chunks > 1 and count < pp:
        raise ValueError(
            f"virtual pipeline parallelism needs at least PP={pp} micro-batches per step, got {count}; "
            "lower per_device_train_batch_size or raise gradient_accumulation_steps"
        )


def freeze_routers(chunks: list[torch.nn.Module]) -> int:
    """``freeze_moe_router``: the MoE routers' parameters stop requiring gradients before DDP and
    the optimizer are built, so they get no gradient buffer, no Adam state and never change.
    Returns how many tensors were frozen."""
    frozen = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.router." in name:
                param.requires_grad_(False)
                frozen += 1
    return frozen


def _wrap_ddp(chunks: list[torch.nn.Module], cfg: Any) -> list[torch.nn.Module]:
    """megatron DDP around each chunk (grads reduced in fp32; buckets only on the first chunk)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]


def _build_optimizer(model: list[torch.nn.Module], role_config: RoleConfig, cfg: Any) -> Any:
    """megatron's Adam (torch AdamW without TE/apex) with fp32 main params, clipping at max_grad_norm."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from roll.models.loading import torch_dtype

    args = role_config.training_args
    dtype = torch_dtype(role_config.model_args.dtype)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.learning_rate,
        min_lr=args.learning_rate * args.min_lr_ratio,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_epsilon,
        clip_grad=args.max_grad_norm,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        overlap_param_gather=cfg.overlap_param_gather,
    )
    return get_megatron_optimizer(opt_config, model)


def _configure_schedule(model: list[torch.nn.Module]) -> None:
    """Hooks megatron's schedules call: grad-sync suppression between micro-batches and finalize."""
    from megatron.core.distributed import finalize_model_grads

    config = model[0].config
    no_sync = [m.no_sync for m in model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if any(getattr(m.ddp_config, "overlap_param_gather", False) for m in model):
        sync = [m.start_param_sync for m in model]
        config.param_sync_func = sync[0] if len(sync) == 1 else sync
