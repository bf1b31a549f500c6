"""Copy full, HF-named tensors into a model's parameters in place (the receiving end of a model update).

>>> copy_into(model.state_dict(keep_vars=True), trainer.iter_hf_weights())   # any subset, dtype, device
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from roll.models.checkpoint_names import CheckpointNames


def copy_into(
    targets: dict[str, torch.Tensor],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    names: CheckpointNames | None = None,
) -> int:
    """``target.copy_(tensor)`` for each (name, tensor) of a name -> tensor table (a model's
    ``state_dict(keep_vars=True)``, which a caller loading many buckets builds once; tied weights may
    come under either name), cast to the target's dtype and device. With ``names`` (the model's
    ``CheckpointNames``) a checkpoint's name loads too: an expert's tensor into its slice of the
    model's stacked experts. A KeyError names an unknown tensor and a ValueError a shape mismatch
    before anything is copied. Returns how many were copied. The copies go out as one multi-tensor
    launch per call (``torch._foreach_copy_``), not one kernel per tensor: a MoE model's update has
    thousands of small expert tensors."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None and names is not None:
            target = names.module_view(targets, name)
        if target is None:
            sample = ", ".join(list(targets)[:5])
            raise KeyError(
                f"load_weights: unknown tensor {name!r}; the model has e.g. {sample} ({len(targets)} names)"
            )
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        dsts.append(target.detach())
        srcs.append(tensor.to(device=target.device, dtype=target.dtype))
    if dsts:
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)
    return len(dsts)


def tied_duplicate_names(model: nn.Module) -> set[str]:
    """``state_dict`` names whose tensor is the same object as an earlier name's (e.g. the LM head
    of a tied embedding): the names ``save_pretrained`` leaves out."""
    seen: set[int] = set()
    duplicates: set[str] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            duplicates.add(name)
        seen.add(id(tensor))
    return duplicates
