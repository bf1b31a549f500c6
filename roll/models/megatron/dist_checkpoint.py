"""megatron_train's dist checkpoint: model chunks + optimizer (+ step count) under ``path/megatron``.

Sharded by global parameter, so a checkpoint loads into any TP / PP / VPP / DP layout:

>>> save(strategy.model, strategy.optimizer, strategy.step_count, "ckpt/step_10")
>>> strategy.step_count = load(strategy.model, strategy.optimizer, "ckpt/step_10")

With LoRA (``lora``: ``roll.models.megatron.lora.layout``) the checkpoint holds the trainable
parameters (the adapters) and their optimizer state, and the layout in its common state
(``common.pt``); the frozen base comes from the model's weights again on resume. A load whose
layout differs (LoRA on / off, another rank or other modules) is one ``CheckpointError`` naming
that file and both layouts.
"""

from __future__ import annotations

import os
from typing import Any

from roll.core.errors import CheckpointError
from roll.models.lora import describe_layout

SUBDIR = "megatron"
# How megatron-core (0.16.1) shards a checkpoint; save and load must agree, so it is also stored in
# the checkpoint. "fully_reshardable": the distributed optimizer's flat DP shards are gathered and
# saved like a plain optimizer's state, one tensor per parameter, keyed and TP/PP-sharded like the
# parameter itself, so the checkpoint loads into any TP / PP / VPP / DP layout. Its default,
# "fully_sharded_model_space", is refused by 0.16.1's dist-checkpointing once DP > 1
# ("ShardedTensor.flattened_range is not supported"); "dp_reshardable" saves flat buffers that
# only reload with the same TP / PP layout. "chained_optim_avoid_prefix": the state of a
# ChainedOptimizer's members (dense + expert optimizers of an MoE) is keyed by parameter alone,
# not by member index. No key here depends on the layout (a load adds its own "dp_cp_group").
# Cost of "fully_reshardable": while saving and loading, every DP rank holds its model shard's
# whole optimizer state (fp32 param + two Adam moments, 12 bytes per parameter) in host memory.
METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "chained_optim_avoid_prefix": True,
    "singleton_local_shards": False,
}


def save(
    model: list[Any], optimizer: Any, step_count: int, path: str, lora: dict[str, Any] | None = None
) -> None:
    """Write the checkpoint under ``path/megatron``; collective over every rank of the role. The
    "fully_reshardable" choice is stored in the checkpoint (megatron's ``content_metadata``)."""
    from megatron.core import dist_checkpointing

    target = os.path.join(path, SUBDIR)
    os.makedirs(target, exist_ok=True)
    state = _sharded_state_dict(model, optimizer, step_count, False, dict(METADATA), trained_only=bool(lora))
    state["lora"] = lora
    dist_checkpointing.save(state, target, content_metadata=dict(METADATA))


def load(
    model: list[Any], optimizer: Any, path: str, lora: dict[str, Any] | None = None, key: str = "model_args"
) -> int:
    """Fill ``model`` and ``optimizer`` from ``path/megatron`` (any layout); returns the step count.
    ``key``: where the LoRA keys of this run are set (for the layout-mismatch error)."""
    from megatron.core import dist_checkpointing

    target = os.path.join(path, SUBDIR)
    if not os.path.isdir(target):
        raise FileNotFoundError(f"{target}: no megatron checkpoint (save_checkpoint writes one here)")
    common = dist_checkpointing.load_common_state_dict(target)
    saved = common.get("lora")
    if saved != lora:  # a LoRA checkpoint holds only the adapters, a full one every weight
        raise CheckpointError(
            f"{os.path.join(target, 'common.pt')}: saved with LoRA {describe_layout(saved)} but "
            f"{key} asks for {describe_layout(lora)}; resume with the lora_* keys the "
            "checkpoint was saved with"
        )
    _check_optimizer_count(common["optimizer"], optimizer)
    _allocate_optimizer_state(optimizer)
    template = _sharded_state_dict(model, optimizer, 0, True, dict(METADATA), trained_only=bool(lora))
    state = dist_checkpointing.load(template, target)
    for i, chunk in enumerate(model):
        _load_model_state(chunk.module, state[f"model{i}"], strict=not lora)
    _load_optimizer_state(optimizer, state["optimizer"])
    return int(state["step_count"])


def _load_model_state(module: Any, state: dict[str, Any], strict: bool) -> None:
    """``load_state_dict``; not strict (LoRA), every trained parameter must still be in ``state``."""
    result = module.load_state_dict(state, strict=strict)
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    missing = sorted(trained & set(result.missing_keys))
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint lacks {missing[:4]} / has unexpected {result.unexpected_keys[:4]}")


def _sharded_state_dict(
    model: list[Any],
    optimizer: Any,
    step_count: int,
    is_loading: bool,
    metadata: dict[str, Any],
    trained_only: bool = False,
) -> dict[str, Any]:
    """What is saved and what a load fills in; both must be built with the same ``metadata``
    (it picks the optimizer's sharding, hence the checkpoint's keys). The model gets it too, as
    megatron's own checkpointing passes it (its layers read "dp_cp_group", which megatron adds
    to the dict in place -- hence a fresh copy per call -- and TE layers read
    "singleton_local_shards"), so the optimizer's tensors mirror the model's keys."""
    state: dict[str, Any] = {
        f"model{i}": _model_state(c.module, metadata, trained_only) for i, c in enumerate(model)
    }
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=metadata)
    state["step_count"] = step_count
    return state


def _model_state(module: Any, metadata: dict[str, Any], trained_only: bool) -> dict[str, Any]:
    """One chunk's sharded state dict; ``trained_only``: its parameters that require grad (LoRA)."""
    state = module.sharded_state_dict(metadata=metadata)
    if not trained_only:
        return state
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trained}


def _optimizer_members(optimizer: Any) -> list[Any]:
    """The megatron optimizers a ChainedOptimizer holds (dense, expert), or just ``optimizer``."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _check_optimizer_count(saved: Any, optimizer: Any) -> None:
    """The checkpoint's optimizers (a ChainedOptimizer saves {0: dense, 1: expert}) must be this
    layout's: megatron keeps experts in their own optimizer only when expert_model_parallel_size
    > 1, with param groups told apart by that flag, so EP=1 <-> EP>1 cannot load."""
    count = len(saved) if saved and all(isinstance(k, int) for k in saved) else 1
    members = len(_optimizer_members(optimizer))
    if count != members:
        raise ValueError(
            f"the checkpoint holds {count} optimizer(s) (dense / expert), this layout has {members}: "
            "a checkpoint saved with expert_model_parallel_size > 1 loads only with EP > 1, and one "
            "saved with EP = 1 only with EP = 1"
        )


def _allocate_optimizer_state(optimizer: Any) -> None:
    """Give a distributed optimizer that never stepped its Adam state before a checkpoint load.

    With megatron's torch-Adam fallback (no TE / apex) ``DistributedOptimizer.state_dict()``
    asserts on the missing per-parameter "step", so the loading template cannot be built.
    Megatron's own helper allocates the state with one zero-gradient step; what that step writes
    (weight decay on the main params) is overwritten by the load.
    """
    for opt in _optimizer_members(optimizer):
        if hasattr(opt, "_init_optimizer_states_with_dummy_values") and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _load_optimizer_state(optimizer: Any, state: Any) -> None:
    """``optimizer.load_state_dict(state)`` for a "fully_reshardable" checkpoint, in two parts.

    Two bugs of megatron-core 0.16.1's distributed optimizer with torch Adam (no TE / apex):
    ``load_parameter_state_from_fully_reshardable`` copies every key of a parameter's Adam state,
    "step" included, from checkpoint entries that hold no "step" (it comes from the param groups)
    -> KeyError; and ``load_state_dict`` gives every parameter the SAME "step" tensor, which torch
    Adam then increments once per parameter each step (wrong bias correction from the first step
    after a resume). So the param groups (and step) load first, with the parameter state held
    back; then the parameter state loads with each "step" set aside, and each parameter gets its
    own copy back. With TE / apex Adam (no "step" in the state) nothing is set aside; optimizers
    without a distributed parameter state load whole.
    """
    members = _optimizer_members(optimizer)
    parts = [state] if len(members) == 1 else [state[k] for k in sorted(state)]
    held = [part.pop("param_state", None) for part in parts]
    for part in parts:
        part.pop("param_state_sharding_type", None)
    optimizer.load_state_dict(state)
    for opt, param_state in zip(members, held):
        if param_state is None:
            continue
        adam = opt.optimizer.state
        steps = {p: adam[p].pop("step") for p in list(adam) if "step" in adam[p]}
        try:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                adam[p]["step"] = step.clone()
