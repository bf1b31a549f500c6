"""``fsdp2_train``: HF models trained with torch FSDP2 (``fully_shard``), on GPUs over NCCL or on
CPU over gloo (FSDP2 runs there too; torch 2.13 checked).

>>> strategy = FSDP2TrainStrategy(role_config, ctx)      # one per rank of the role
>>> strategy.initialize()                               # joins/creates the default process group
>>> old = strategy.compute_log_probs(batch)["log_probs"]
>>> metrics = strategy.train_step(batch.split(2), loss_fn)            # one optimizer step
>>> for name, tensor in strategy.iter_hf_weights(): ...               # every rank iterates; rank 0 yields

Every rank must make the same calls with the same number of rows/micro-batches (each forward
all-gathers shards). A vision-language model's ranks may hold different rows (text-only rows on one,
images on another): each forward runs the vision tower as often as any rank's does, on a dummy image
whose outputs are added times 0 where this rank's rows need fewer (``roll.models.vision_tower``), so
the vision blocks' gathers and gradient reductions match and no value changes. Process group: ``initialize`` uses the default group when one exists
(its size must be ``ctx.world_size``); else it creates one from MASTER_ADDR/MASTER_PORT (the
worker sets them), or on a free local port for a single rank. Backend: NCCL for CUDA (gloo for CPU
tensors), gloo on CPU.

Layout: each decoder layer (the classes in the model's ``_no_split_modules``) and then the root
are ``fully_shard``-ed over a 1-D mesh of all ranks ("full_shard"), over a (replicate=W/S, shard=S)
mesh with ``fsdp_size`` S (HSDP: ranks ``r*S .. r*S + S - 1`` shard one replica; gradients are
reduce-scattered in the group and all-reduced between groups), or over a (replicate=W, shard=1)
mesh ("no_shard": full replicas, gradients all-reduced, i.e. DDP). With
``mixed_precision`` the master weights and optimizer are fp32 and the forward/backward run in
``model_args.dtype`` with fp32 gradient reduction; without it everything is ``model_args.dtype``.
``cpu_offload`` (CUDA only) keeps sharded parameters, gradients and optimizer state in CPU memory.

Micro-batches run as packed rows by default (``sequence_packing``; ``roll.models.packing``), are
re-formed by ``max_tokens_per_microbatch`` when set, and each loss is weighted so that the step's
gradient is that of the whole mini-batch's loss (``roll.models.microbatch``; docs/packing.md).

LoRA (``model_args.lora_rank``, ``roll.models.lora``): adapters replace the targeted linear modules
before sharding and only they (and a critic's value head) reach AdamW; ``iter_hf_weights`` and the
HF export merge them into the base weights under the original names, and checkpoints hold only the
trainable parameters and their optimizer state (docs/strategies.md "LoRA").

Ulysses sequence parallelism (``ulysses_size`` N > 1, ``roll.models.ulysses``): ranks
``d * N .. d * N + N - 1`` form Ulysses group ``d`` (data-parallel rank ``d`` of ``world / N``); they
get the same rows, split each micro-batch's columns among them, and exchange them around attention
(all-to-all). FSDP2's mesh is independent of these groups (every rank, or ``fsdp_size`` groups); loss
weights are scaled by N because FSDP2 averages the gradients over all ranks (HSDP too: the mean in
the shard group, then over the replicas) while each group's gradient is the sum over its N ranks.

Expert parallelism (``ep_size`` N > 1, MoE models; ``roll.distributed.strategy.fsdp2_experts``): each
group of N consecutive ranks splits every MoE layer's experts, tokens reach them by all-to-all, and
each expert slice is sharded over the ranks that hold it (its own mesh axis); the dense parameters
keep the mesh above. Full sharding only (no HSDP, ``no_shard``, ``cpu_offload`` or LoRA with it).

LR schedule: ``roll.utils.lr_schedule``, over ``ctx.total_optimizer_steps`` optimizer steps (the
driver computes max_steps x ppo_epochs x mini-batches per step once; linear/cosine need it).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from roll.configs.errors import ConfigError
from roll.configs.role import RoleConfig
from roll.configs.strategy_configs import FSDP2Config
from roll.core.batch import Batch
from roll.core.errors import CheckpointError
from roll.core.loss import LossFn
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.fsdp2_experts import ExpertLayout
from roll.distributed.strategy.fsdp2_gather import iter_full_state
from roll.models.checkpoint_names import CheckpointNames
from roll.models.hf_checkpoint import write_hf_checkpoint
from roll.models.loading import decoder_layers, load_model, torch_dtype
from roll.models.logprobs import batch_temperature, response_log_probs, transformers_detects_packing
from roll.models.lora import apply_lora, describe_layout, hf_name, lora_scales, merged_stream
from roll.models.microbatch import invert, loss_agg_mode_of, loss_weights, rebudget, split_by_tokens
from roll.models.ulysses import check_heads, use_ulysses_attention
from roll.models.ulysses_forward import ulysses_log_probs, ulysses_values
from roll.models.value_model import HEAD_PREFIX, ValueModel, check_output_kind, response_values
from roll.models.vision import check_vision_options, freeze_prefixes, is_vision_config
from roll.models.vision_tower import agreed_tower_calls, idle_tower_calls, tower_calls
from roll.models.weights import tied_duplicate_names
from roll.utils.lr_schedule import build_lr_lambda
from roll.utils.process_group import init_default_group
from roll.utils.start_marks import init_span

TRAINER_STATE = "trainer_state.json"
# ``strategy_config.sharding``: shard across all ranks, or full replicas (DDP-like); see _build_mesh.
SHARDINGS = ("full_shard", "no_shard")


class FSDP2TrainStrategy:
    """Training side of a policy (``log_probs``/``entropy``) or value model (``values``) under FSDP2."""

    def __init__(self, role_config: RoleConfig, ctx: WorkerContext) -> None:
        self.role_config = role_config
        self.ctx = ctx
        self.config: FSDP2Config = role_config.strategy_args.strategy_config
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.step = 0
        self.total_steps: int | None = None
        # Set while a linear/cosine schedule lacks its length (ctx.total_optimizer_steps is None).
        self._schedule_error: str | None = None
        # alpha / rank per LoRA module name; empty without lora_rank (roll.models.lora).
        self.lora_scales: dict[str, float] = {}
        # Ulysses: ranks per sequence, and the groups of the (data-parallel, sequence) layout.
        self.ulysses_size = self.config.ulysses_size
        self.sp_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None
        # Expert parallelism (ep_size > 1): the expert slices' layout; None otherwise.
        self.experts: ExpertLayout | None = None
        # A vision-language model (roll.models.vision): no packing, no Ulysses.
        self.vision = False
        # The model's module <-> checkpoint names (stacked experts): iter_hf_weights gives the latter.
        self._names = CheckpointNames()

    # -------------------------------------------------------------------------------- set up
    def initialize(self) -> None:
        """Process group, model (``roll.models.loading``), FSDP2 sharding, AdamW and LR schedule."""
        if self.ctx.is_cuda:
            torch.cuda.set_device(self.ctx.device)
        init_default_group(
            self.ctx.rank,
            self.ctx.world_size,
            self.ctx.device,
            backend="cpu:gloo,cuda:nccl" if self.ctx.is_cuda else "gloo",
            who=self.ctx.role,
        )
        model_args = self.role_config.model_args
        master = torch.float32 if self.config.mixed_precision else torch_dtype(model_args.dtype)
        with init_span("fsdp2.load"):
            model = load_model(model_args, dtype=master, training=True, seed=self.ctx.seed)
        self.vision = is_vision_config(model.config)
        if self.vision:  # roll.models.vision: padded rows, one rank per sequence
            check_vision_options(self.ctx.role, self.config.sequence_packing is True, self.ulysses_size)
        freeze_prefixes(
            model, model_args.freeze_module_prefix, f"{self.ctx.role}.model_args.freeze_module_prefix"
        )
        self._names = CheckpointNames.of(model)
        if model_args.uses_lora:
            self._apply_lora(model)
        if self.ulysses_size > 1:
            self._init_ulysses(model)
        if self.config.ep_size > 1:
            self._init_experts(model)
        self.mesh = self._build_mesh()
        with init_span("fsdp2.shard"):
            self.model = self._shard(model)
        self.model.train()
        args = self.role_config.training_args
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            # The multi-tensor update, which torch picks only for CUDA tensors: on CPU the per-tensor
            # loop dispatches every op of every DTensor shard (27 -> 7 ms CPU per step, example model).
            foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        try:
            self._set_schedule_length(self.ctx.total_optimizer_steps)
        except ValueError as exc:  # linear/cosine without a length: reported by the first train_step
            self._schedule_error = str(exc)

    def _apply_lora(self, model: torch.nn.Module) -> None:
        """LoRA adapters on ``lora_target`` of the decoder layers, before sharding; everything else
        frozen but a critic's value head (new, so it must learn). A is drawn from the run's seed, the
        same on every rank."""
        args = self.role_config.model_args
        apply_lora(
            model,
            args.lora_target,
            args.lora_rank,
            args.lora_alpha if args.lora_alpha is not None else float(args.lora_rank),
            args.lora_dropout,
            layers=decoder_layers(model),
            seed=self.ctx.seed,
            keep_trainable=(HEAD_PREFIX,) if isinstance(model, ValueModel) else (),
            path=f"{self.ctx.role}.model_args.lora_target",
        )
        self.lora_scales = lora_scales(model)

    def _init_ulysses(self, model: torch.nn.Module) -> None:
        """The (dp, sp) groups (rank = dp rank x N + position in the sequence) and the model's
        attention switched to the all-to-all wrapper; ``ulysses_size`` checked against its heads."""
        size = self.ulysses_size
        path = f"{self.ctx.role}.strategy_args.strategy_config.ulysses_size"
        if self.ctx.world_size % size:
            raise ConfigError(path, f"{size} does not divide the role's {self.ctx.world_size} ranks")
        check_heads(model.config, size, path)
        layout = init_device_mesh(
            self.ctx.device.type, (self.ctx.world_size // size, size), mesh_dim_names=("dp", "sp")
        )
        self.sp_group, self.dp_group = layout.get_group("sp"), layout.get_group("dp")
        use_ulysses_attention(model)

    def _init_experts(self, model: torch.nn.Module) -> None:
        """Keep this rank's expert slices and route the MoE blocks over its EP group
        (``roll.distributed.strategy.fsdp2_experts``); LoRA is not combined with it."""
        if self.lora_scales:
            raise ConfigError(
                f"{self.ctx.role}.strategy_args.strategy_config.ep_size",
                f"{self.config.ep_size} does not run with LoRA (model_args.lora_rank); set ep_size: 1",
            )
        self.experts = ExpertLayout(
            model, self.config.ep_size, self.ctx.world_size, self.ctx.device.type, self.ctx.role
        )

    def _build_mesh(self) -> DeviceMesh:
        """1-D over every rank, or (replicate, shard) with ``shard_size`` ranks on the shard axis
        (``fsdp_size``; 1 for ``no_shard``). The axes' names are what the weight gather reads."""
        world, device_type = self.ctx.world_size, self.ctx.device.type
        shard = self.config.shard_size(world)
        if world % shard:
            path = f"{self.ctx.role}.strategy_args.strategy_config.fsdp_size"
            raise ConfigError(path, f"{shard} does not divide the role's {world} ranks into shard groups")
        if shard == world and self.config.sharding == "full_shard":
            return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))

    def _shard(self, model: torch.nn.Module) -> torch.nn.Module:
        policy = MixedPrecisionPolicy()
        if self.config.mixed_precision:
            compute = torch_dtype(self.role_config.model_args.dtype)
            reduce = torch_dtype(self.config.reduce_dtype)
            policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
        offload = CPUOffloadPolicy() if self.config.cpu_offload and self.ctx.is_cuda else OffloadPolicy()
        kwargs = {
            "mesh": self.mesh,
            "reshard_after_forward": self.config.reshard_after_forward,
            "mp_policy": policy,
            "offload_policy": offload,
        }
        if self.experts is not None:
            self.experts.shard(kwargs)
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def _set_schedule_length(self, total_steps: int | None) -> None:
        """Rebuild the LR schedule for ``total_steps`` optimizer steps, keeping the step count."""
        lr_lambda = build_lr_lambda(self.role_config.training_args, total_steps)
        self.total_steps = total_steps
        self._schedule_error = None
        self.scheduler.lr_lambdas = [lr_lambda for _ in self.optimizer.param_groups]
        for group, base_lr in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base_lr * lr_lambda(self.scheduler.last_epoch)

    def dp_layout(self) -> tuple[int, int, bool]:
        """(dp rank, dp size, whether this rank's outputs are collected): every rank is a DP rank;
        with Ulysses, each group of ``ulysses_size`` ranks is one, collected from its first rank."""
        size = self.ulysses_size
        return self.ctx.rank // size, self.ctx.world_size // size, self.ctx.rank % size == 0

    @property
    def is_value_model(self) -> bool:
        return isinstance(self.model, ValueModel)

    # ----------------------------------------------------------------------------- compute
    @property
    def packing(self) -> bool:
        """``sequence_packing``; null: on where transformers confines attention to each packed
        sequence (its packed-sequence detection from restarting position ids, or flash-attention
        varlen kernels)."""
        if self.config.sequence_packing is None:
            return not self.vision and transformers_detects_packing()
        return self.config.sequence_packing

    def _group(self) -> dist.ProcessGroup | None:
        """The data-parallel ranks (different rows): all ranks, or one rank per Ulysses group."""
        if self.dp_group is not None:
            return self.dp_group
        return dist.group.WORLD if self.ctx.world_size > 1 else None

    def _tower_calls(self, micro_batches: list[Batch]) -> list[int]:
        """Per micro-batch, how often its forward runs a vision-language model's tower on every
        rank (``roll.models.vision_tower``: the ranks agree, so a text-only rank runs it on a dummy
        image and the tower's gathers and gradient reductions match); 0s for a text model."""
        if not self.vision:
            return [0] * len(micro_batches)
        return agreed_tower_calls(micro_batches, dist.group.WORLD if self.ctx.world_size > 1 else None)

    def _forward(self, batch: Batch, tower_runs: int = 0) -> dict[str, torch.Tensor]:
        """The outputs of ``batch``; ``tower_runs``: how often the forward runs the vision tower
        (``_tower_calls``; this rank's rows may need fewer)."""
        with idle_tower_calls(self.model, tower_runs - tower_calls(batch)):
            return self._outputs(batch)

    def _outputs(self, batch: Batch) -> dict[str, torch.Tensor]:
        if self.sp_group is not None:
            if self.is_value_model:
                return {"values": ulysses_values(self.model, batch, self.packing, self.sp_group)}
            return ulysses_log_probs(self.model, batch, batch_temperature(batch), self.packing, self.sp_group)
        if self.is_value_model:
            return {"values": response_values(self.model, batch, self.packing)}
        return response_log_probs(self.model, batch, batch_temperature(batch), packed=self.packing)

    def train_step(self, micro_batches: list[Batch], loss_fn: LossFn) -> dict[str, float]:
        """Forward/backward each micro-batch, clip, AdamW + LR step. Micro-batches are re-formed by
        ``max_tokens_per_microbatch`` when set; each loss is weighted by its share of the
        mini-batch's ``loss_agg_mode`` normaliser over all ranks (``roll.models.microbatch``).

        Returns the micro-batch average of ``loss`` and of loss_fn's metrics (this rank's), plus the
        global ``grad_norm`` (before clipping) and the ``lr`` the step used. A non-finite gradient
        norm skips the update (``skipped`` = 1).
        """
        if self._schedule_error:
            raise ValueError(f"{self._schedule_error}; set WorkerContext.total_optimizer_steps")
        if not micro_batches:
            raise ValueError("train_step needs at least one micro-batch")
        self.model.train()
        micro_batches = rebudget(micro_batches, self.config.max_tokens_per_microbatch, self._group())
        # FSDP2 averages gradients over all ranks; a Ulysses group's N ranks each hold a part of one
        # data-parallel rank's gradient, so the weights (which sum to the DP size) are scaled by N.
        weights = loss_weights(micro_batches, loss_agg_mode_of(loss_fn), self._group())
        weights = [w * self.ulysses_size for w in weights]
        totals: dict[str, float] = {}
        for micro, weight, runs in zip(micro_batches, weights, self._tower_calls(micro_batches)):
            micro = micro.to(self.ctx.device)
            loss, metrics = loss_fn(self._forward(micro, runs), micro)
            (loss * weight).backward()
            for key, value in {"loss": float(loss.detach()), **metrics}.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        out = {key: value / len(micro_batches) for key, value in totals.items()}
        out["lr"] = float(self.optimizer.param_groups[0]["lr"])
        out["grad_norm"] = self._clip_gradients()
        out["skipped"] = float(not math.isfinite(out["grad_norm"]))
        if not out["skipped"]:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def _clip_gradients(self) -> float:
        max_norm = self.role_config.training_args.max_grad_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.experts is not None:  # two meshes: torch's clip_grad_norm_ takes one
            return self.experts.scale_and_clip(params, max_norm if max_norm > 0 else float("inf"))
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def compute_log_probs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """{"log_probs", "entropy"} [B, R] of a policy model, as the training forward computes them."""
        check_output_kind(self.ctx.role, self.is_value_model, values=False)
        return self._infer(batch)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values [B, R] of a value model (``model_args.model_type: value``)."""
        check_output_kind(self.ctx.role, self.is_value_model, values=True)
        return self._infer(batch)["values"]

    @torch.no_grad()
    def _infer(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The training forward's outputs without grad, micro-batched by ``infer_batch_size`` rows
        or, when set, ``infer_max_tokens_per_microbatch`` tokens."""
        self.model.eval()
        budget, order = self.config.infer_max_tokens_per_microbatch, None
        if budget is None:
            micro = batch.split(max(1, self.role_config.infer_batch_size))
        else:
            micro, order = split_by_tokens(batch, budget, self._group())
        parts = [self._forward(m.to(self.ctx.device), n) for m, n in zip(micro, self._tower_calls(micro))]
        self.model.train()
        if not self.config.reshard_after_forward:
            # Training reshards after the backward; a forward without one leaves the parameters
            # gathered (and the model half sharded for state_dict/checkpoints): free them here.
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        out = {key: torch.cat([p[key].float().cpu() for p in parts]) for key in parts[0]}
        return out if order is None else {key: value[invert(order)] for key, value in out.items()}

    # ----------------------------------------------------------------------------- offload
    def offload_states(self) -> None:
        """Gradients freed and optimizer state moved to CPU; parameters stay. No-op on CPU."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.ctx.is_cuda:
            self._move_optimizer_state(torch.device("cpu"))
            torch.cuda.empty_cache()

    def reload_states(self) -> None:
        if self.ctx.is_cuda and not self.config.cpu_offload:
            self._move_optimizer_state(self.ctx.device)

    def _move_optimizer_state(self, device: torch.device) -> None:
        # AdamW keeps "step" on CPU unless capturable; moving it to the GPU would break the step.
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(device, non_blocking=True)
        torch.cuda.synchronize(self.ctx.device)

    # ---------------------------------------------------------------------------- weights
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every ``state_dict`` entry of the HF model (tied names included),
        cast to ``model_args.dtype``, named as the checkpoint names it (a MoE layer's stacked experts
        as one view per expert: what vLLM, SGLang and ``save_pretrained`` expect). The shards are all-gathered a group at a time (one collective
        per ``fsdp2_gather.GATHER_GROUP_BYTES`` of one dtype, not one per tensor: ~40 gloo round trips fewer for
        a small model on CPU), so EVERY rank must exhaust the iterator; only rank 0 yields (on its
        device), the other ranks yield nothing. With LoRA the names are the original model's and
        each target's weight is merged (W + scale * B @ A, in fp32 before the cast), so receivers
        need nothing LoRA-specific."""
        dtype = torch_dtype(self.role_config.model_args.dtype)
        state = self.model.state_dict()
        fulls = iter_full_state(state, self.mesh, self.ctx.device, self.ctx.rank, self.experts)
        if self.lora_scales:
            fulls = merged_stream(fulls, self.lora_scales)
        yield from self._names.to_checkpoint((name, full.to(dtype)) for name, full in fulls)

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors (the same on every rank) into this rank's shards. With LoRA,
        a target's weight goes to its frozen base weight (the adapters are unchanged)."""
        targets = self.model.state_dict()
        adapted = set(self.lora_scales)
        wrapped = {hf_name(name, adapted): name for name in targets}
        with torch.no_grad():
            for name, full in named_tensors:
                name = wrapped.get(name, name)
                if name not in targets:
                    raise KeyError(
                        f"load_weights: unknown tensor {name!r} ({len(targets)} names in the model)"
                    )
                target = targets[name]
                if self.experts is not None and self.experts.is_expert(target):
                    full = self.experts.local_rows(full)
                if tuple(target.shape) != tuple(full.shape):
                    raise ValueError(
                        f"load_weights: {name!r} has shape {tuple(full.shape)}, expected {tuple(target.shape)}"
                    )
                full = full.to(device=target.device if not isinstance(target, DTensor) else self.ctx.device)
                if isinstance(target, DTensor):
                    full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                    target.to_local().copy_(full.to_local())
                else:
                    target.copy_(full)

    def save_hf_checkpoint(self, path: str) -> None:
        """Rank 0 writes safetensors + config.json + generation config + tokenizer (from
        ``model_name_or_path``) under ``path``; the other ranks take part in the gathers. Tied LM
        heads are left out like ``save_pretrained`` does. Tensors and config.json's dtype are
        ``model_args.dtype``."""
        model = self.model.model if self.is_value_model else self.model
        config = copy.deepcopy(model.config)
        config.dtype = torch_dtype(self.role_config.model_args.dtype)
        skip = tied_duplicate_names(self.model)
        tensors = self.iter_hf_weights()
        if self.ctx.rank == 0:
            write_hf_checkpoint(
                path,
                tensors,
                config,
                getattr(model, "generation_config", None),
                tokenizer_dir=self.role_config.model_args.model_name_or_path,
                skip=skip,
            )
        else:
            for _ in tensors:
                pass
        dist.barrier()

    # ------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Model + optimizer shards (torch.distributed.checkpoint) and, from rank 0, the step and
        LR scheduler (``trainer_state.json``). The process RNG is the worker's to save (see
        ``ModelWorker.save_checkpoint``), the same for every strategy."""
        Path(path).mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = self._checkpoint_state(self._state_options())
        state = {"model": model_sd, "optim": optim_sd}
        if self.experts is not None:
            state = self.experts.checkpoint_views(model_sd, optim_sd)
        dcp.save(state, checkpoint_id=path)
        if self.ctx.rank == 0:
            state = {
                "step": self.step,
                "total_steps": self.total_steps,
                "scheduler": self.scheduler.state_dict(),
                "lora": self._lora_layout(),
            }
            Path(path, TRAINER_STATE).write_text(json.dumps(state, default=_no_lambdas))
        dist.barrier()

    def _lora_layout(self) -> dict[str, Any] | None:
        """What a checkpoint's tensors depend on: the adapted module names and their rank (None
        without LoRA)."""
        if not self.lora_scales:
            return None
        return {"rank": self.role_config.model_args.lora_rank, "modules": sorted(self.lora_scales)}

    def _state_options(self) -> StateDictOptions:
        """With LoRA a checkpoint holds the trainable parameters (adapters, a critic's head) and
        their optimizer state; the frozen base comes from ``model_name_or_path`` again on resume, so
        loading sets only those (not strict; ``dcp.load`` already fails on a missing adapter)."""
        lora = bool(self.lora_scales)
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _checkpoint_state(self, options: StateDictOptions) -> tuple[dict, dict]:
        """Model and optimizer state dicts to save or load. torch keeps a tied LM head of a frozen
        embedding under ``ignore_frozen_params`` (it is no parameter name of its own): dropped too."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        if options.ignore_frozen_params:
            trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
            model_sd = {name: t for name, t in model_sd.items() if name in trained}
        return model_sd, optim_sd

    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote (same world size); training then continues
        bit-identically on CPU."""
        trainer_file = Path(path, TRAINER_STATE)
        if not trainer_file.is_file():
            raise FileNotFoundError(f"{path!r} is not an fsdp2_train checkpoint (no {TRAINER_STATE})")
        trainer = json.loads(trainer_file.read_text())
        saved, now = trainer.get("lora"), self._lora_layout()
        if saved != now:  # a LoRA checkpoint holds only the adapters, a full one every weight
            raise CheckpointError(
                f"{trainer_file}: saved with LoRA {describe_layout(saved)} but "
                f"{self.ctx.role}.model_args asks for {describe_layout(now)}; resume with the lora_* keys "
                "the checkpoint was saved with"
            )
        options = self._state_options()
        model_sd, optim_sd = self._checkpoint_state(options)
        state = {"model": model_sd, "optim": optim_sd}
        if self.experts is not None:
            state = self.experts.checkpoint_views(model_sd, optim_sd)
        dcp.load(state, checkpoint_id=path)
        if self.experts is not None:
            state = self.experts.from_checkpoint_view(state)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.step = trainer["step"]
        if trainer["total_steps"] is not None:
            self._set_schedule_length(trainer["total_steps"])
        dist.barrier()


def _no_lambdas(value: object) -> None:
    """JSON fallback: LambdaLR stores its lambdas as None or objects; they are rebuilt on load."""
    return None
