"""LoRA adapters on megatron-core's tensor-parallel linear layers (``megatron_train``).

HF target names map onto the fused megatron modules of each decoder layer (``TARGETS``):
``q_proj`` / ``k_proj`` / ``v_proj`` -> ``self_attention.linear_qkv`` (any of the three adapts the
whole fused layer, so its adapter covers q, k and v), ``o_proj`` -> ``self_attention.linear_proj``,
``gate_proj`` / ``up_proj`` -> ``mlp.linear_fc1`` (both halves), ``down_proj`` -> ``mlp.linear_fc2``.
MoE expert MLPs get no adapters (``all-linear`` on an MoE layer adapts its attention only), nor do
Gated DeltaNet (linear-attention) layers' attention (Qwen3-Next: its full-attention layers get them).

The adapted layer keeps its module and parameter names (the HF weight tables and megatron's
checkpoints see the same ``weight``) and gains ``lora_A`` [r, in] and ``lora_B`` [out, r], with
``y = base(x) + scale * B A dropout(x)``, ``scale = alpha / r``, B zero at start. Sharded as the
weight is:

- column-parallel (weight [out/TP, in]): A [r, in] whole on every TP rank, B [out/TP, r] this
  rank's rows. ``h = dropout(x) A^T`` then enters the TP region as the base's input does: without
  sequence parallelism by ``copy_to_tensor_model_parallel_region`` (identity forward, its
  gradient all-reduced over TP, so A's gradient and x's LoRA gradient are complete on every rank),
  under SP by ``gather_from_sequence_parallel_region`` over the sequence shards ([s/TP, b, r] ->
  [s, b, r]; backward reduce-scatter); A's gradient is then this rank's sequence part and is
  summed over TP by ``finalize_model_grads`` (A is marked ``sequence_parallel`` like the norms).
- row-parallel (weight [out, in/TP], output summed over TP): A [r, in/TP] this rank's columns, B
  [out, r] whole. ``h = dropout(x) A^T`` is a partial sum; it is reduced with the base's own
  reduction (all-reduce, or reduce-scatter onto the sequence shards under SP) before ``B``:
  reduce(x W^T) + reduce(x A^T) B^T = reduce(x (W + B A)^T), exactly, B being the same on every
  rank -- at the price of a [s, b, r] collective instead of a second [s, b, out] one. Under SP, B's
  gradient is this rank's sequence part (marked ``sequence_parallel``, summed over TP).

A is drawn whole (kaiming-uniform, as peft) from a seed of the layer's global number and module,
then sliced, so every layout (TP, PP, DP) starts from the same adapters.

>>> names = apply_lora(chunks, ["q_proj", "v_proj"], rank=8, alpha=16.0)   # before DDP / optimizer
>>> merged_weight(module)        # this TP rank's W + scale * B A, for the HF export
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch import nn

from roll.configs.errors import ConfigError
from roll.configs.role import LORA_ALL_LINEAR
from roll.models.lora import ADAPTER_NAMES, merge

ATTENTION = ("self_attention.linear_qkv", "self_attention.linear_proj")
MLP = ("mlp.linear_fc1", "mlp.linear_fc2")
# HF module name -> the megatron module of a decoder layer that holds it (fused where HF is not).
TARGETS = {
    "q_proj": ATTENTION[0],
    "k_proj": ATTENTION[0],
    "v_proj": ATTENTION[0],
    "o_proj": ATTENTION[1],
    "gate_proj": MLP[0],
    "up_proj": MLP[0],
    "down_proj": MLP[1],
}


def megatron_targets(targets: list[str], path: str) -> list[str]:
    """The megatron modules (``TARGETS`` values, in layer order) that ``targets`` adapt; an unknown
    name is a ConfigError on ``path`` listing the valid ones."""
    if LORA_ALL_LINEAR in targets:
        return [*ATTENTION, *MLP]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ConfigError(
            path,
            f"{unknown[0]!r} is no linear module megatron_train can adapt; it takes "
            f"{', '.join(TARGETS)} or {LORA_ALL_LINEAR}",
        )
    chosen = {TARGETS[t] for t in targets}
    return [m for m in (*ATTENTION, *MLP) if m in chosen]


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (not an HF weight)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def layout(config: Any, targets: list[str], rank: int, path: str) -> dict[str, Any]:
    """What a checkpoint's adapters depend on: the rank and every module of the whole model
    (``config``: its TransformerConfig) that ``targets`` adapt, the same on every rank whatever the
    parallel layout. MLP targets named on a model without a dense MLP layer are a ConfigError."""
    from roll.models.megatron.gated_delta_net import linear_attention_pattern
    from roll.models.megatron.model_builder import moe_layer_pattern

    modules = megatron_targets(targets, path)
    dense = [not moe for moe in moe_layer_pattern(config)]
    full_attention = [not linear for linear in linear_attention_pattern(config)]
    if LORA_ALL_LINEAR not in targets and set(modules) & set(MLP) and not any(dense):
        raise ConfigError(
            path,
            "gate_proj/up_proj/down_proj: every layer of this model is MoE and expert MLPs carry no "
            "adapters; target the attention (q_proj, k_proj, v_proj, o_proj)",
        )
    names = [
        f"decoder.layers.{i}.{m}"
        for i in range(config.num_layers)
        for m in modules
        if (m in ATTENTION and full_attention[i]) or (m in MLP and dense[i])
    ]
    return {"rank": rank, "modules": names}


def apply_lora(
    chunks: list[nn.Module],
    targets: list[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    *,
    seed: int = 0,
    path: str = "model_args.lora_target",
) -> list[str]:
    """Freeze every parameter of ``chunks`` (GPTModels, before DDP) and adapt the targeted linear
    modules of their decoder layers; returns the adapted module names (global layer numbers)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP as DenseMLP

    modules = megatron_targets(targets, path)
    for chunk in chunks:
        chunk.requires_grad_(False)
    adapted = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for name in modules:
                owner = layer.mlp if name in MLP else layer.self_attention
                if name in MLP and not isinstance(owner, DenseMLP):
                    continue  # MoE layer: experts carry no adapters
                if name in ATTENTION and isinstance(owner, GatedDeltaNet):
                    continue  # linear-attention layer: its attention carries no adapters
                leaf = name.rsplit(".", 1)[-1]
                if not hasattr(owner, leaf):
                    raise ConfigError(path, f"this model's attention has no {leaf} (multi-latent attention)")
                if not isinstance(getattr(owner, leaf), (ColumnParallelLinear, RowParallelLinear)):
                    raise ConfigError(
                        path,
                        f"LoRA adapts megatron's Column/RowParallelLinear, not {type(getattr(owner, leaf)).__name__} "
                        "(TransformerEngine's layer spec); set strategy_args.strategy_config.attention_backend: "
                        "local for the plain-torch spec, or remove the lora_* keys",
                    )
                full = f"decoder.layers.{layer.layer_number - 1}.{name}"
                swiglu = name == MLP[0] and bool(layer.config.gated_linear_unit)
                seed_here = zlib.crc32(f"{seed}:{full}".encode())
                adapt(getattr(owner, leaf), rank, alpha, dropout, seed=seed_here, swiglu=swiglu)
                adapted.append(full)
    return adapted


class _LoRA:
    """What column- and row-parallel adapted layers share; mixed in before the megatron class."""

    lora_scale: float
    lora_row: bool
    lora_swiglu: bool

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, bias = super().forward(x, *args, **kwargs)
        return out + self._lora_update(x).to(out.dtype), bias

    def _lora_update(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        group = self.tp_group
        h = self.lora_dropout(x).to(self.lora_A.dtype) @ self.lora_A.t()
        if self.lora_row:  # partial sums over TP: the base's own reduction
            if self.sequence_parallel:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
            else:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
        elif self.sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(
                h, tensor_parallel_output_grad=True, group=group
            )
        else:
            h = mappings.copy_to_tensor_model_parallel_region(h, group=group)
        return (h @ self.lora_B.t()) * self.lora_scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The base's checkpoint entries plus the adapters, the TP-sharded one cut like the weight."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": 1, "lora_A": 1} if self.lora_row else {"weight": 0, "bias": 0, "lora_B": 0}
        state = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axes,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {})["dp_cp_group"],
        )
        if self.lora_swiglu:  # B's rows are [gate shard; up shard], like the weight's (MLP does that)
            key = f"{prefix}lora_B"
            singleton = (metadata or {}).get("singleton_local_shards", False)
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets, singleton)
        return state


_CLASSES: dict[type, type] = {}


def _lora_class(base: type) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LoRA{base.__name__}", (_LoRA, base), {})
    return _CLASSES[base]


def adapt(
    module: nn.Module, rank: int, alpha: float, dropout: float, seed: int, swiglu: bool = False
) -> None:
    """Turn one megatron ``ColumnParallelLinear`` / ``RowParallelLinear`` into its LoRA class in
    place (see the module docstring for the shapes and where the TP communication happens).
    ``swiglu``: a gated MLP's ``linear_fc1``, whose TP shards are [gate shard; up shard], so its
    B is checkpointed as two halves (megatron's swiglu factory) to reshard across TP."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        set_tensor_model_parallel_attributes,
    )

    row = isinstance(module, RowParallelLinear)
    if not row and not isinstance(module, ColumnParallelLinear):
        raise TypeError(f"LoRA needs a megatron Column/RowParallelLinear, got {type(module).__name__}")
    if (row and not module.input_is_parallel) or (not row and module.gather_output):
        raise ValueError("LoRA: the layer must keep its output (column) / input (row) TP-sharded")
    weight = module.weight
    tp, tp_rank = module.tp_group.size(), module.tp_group.rank()
    full_in = module.input_size
    a_full = torch.empty(rank, full_in, dtype=torch.float32)
    nn.init.kaiming_uniform_(a_full, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    if row:
        width = full_in // tp
        a_full = a_full[:, tp_rank * width : (tp_rank + 1) * width]
    out_rows = module.output_size if row else module.output_size_per_partition
    module.lora_A = nn.Parameter(a_full.to(device=weight.device, dtype=weight.dtype).contiguous())
    module.lora_B = nn.Parameter(torch.zeros(out_rows, rank, dtype=weight.dtype, device=weight.device))
    sharded, whole = (module.lora_A, module.lora_B) if row else (module.lora_B, module.lora_A)
    set_tensor_model_parallel_attributes(sharded, True, 1 if row else 0, 1)
    # Under SP the whole adapter's gradient is this rank's sequence part: summed over TP.
    whole.sequence_parallel = bool(module.sequence_parallel)
    module.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    module.lora_scale = alpha / rank
    module.lora_row = row
    module.lora_swiglu = swiglu
    module.__class__ = _lora_class(type(module))


def is_adapted(module: nn.Module) -> bool:
    return isinstance(module, _LoRA)


def merged_weight(module: nn.Module) -> torch.Tensor:
    """This TP rank's shard of ``W + scale * B A`` (fp32 math, the weight's dtype): B's rows x A's
    columns are exactly the weight shard's rows x columns in either kind."""
    return merge(module.weight, module.lora_A, module.lora_B, module.lora_scale)


def adapted_weights(model: nn.Module) -> dict[str, nn.Module]:
    """The adapted layers of ``model`` by their weight's parameter name (``<module>.weight``), found
    in one pass: what the HF export merges (``merged_weight``) instead of sending the frozen weight;
    empty without LoRA."""
    return {f"{name}.weight": module for name, module in model.named_modules() if is_adapted(module)}
