"""Load a stream of full HF-named tensors (a model update) into this rank's megatron chunks.

The sender yields whole HF tensors (``hf_io.export_hf_weights`` of actor_train, or any HF
checkpoint); each receiving rank keeps only what its chunks own, cut to its TP / EP shard with the
same tables and slicing as ``hf_io.load_hf_weights``. Tensors that fuse into one parameter (q/k/v,
gate/up) are held until all of them have arrived, then dropped.

>>> count = load_named_tensors(chunks, trainer.iter_hf_weights())   # parameters written
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from roll.models.megatron import hf_io
from roll.models.megatron import weight_mapping as wm


class _TensorSource:
    """hf_io's checkpoint-reader interface over tensors held in memory."""

    dir = "<model update>"

    def __init__(self) -> None:
        self.files: dict[str, torch.Tensor] = {}

    def where(self, name: str) -> str:
        return f"tensor {name!r} of the model update"

    def shape(self, name: str) -> list[int]:
        return list(self.files[name].shape)

    def read(self, name: str, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        tensor = self.files[name]
        if dim is None:
            return tensor
        return tensor[start:stop] if dim == 0 else tensor[:, start:stop]


def load_named_tensors(model_chunks: list[Any], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy the shards this rank owns of each incoming tensor into its parameters; returns how many
    parameters were written. Unknown names raise ``hf_io.CheckpointError``."""
    models = [hf_io.unwrap(chunk) for chunk in model_chunks]
    info = models[0].roll_hf_info
    known = wm.expected_hf_names(info) | set(wm.OUTPUT.hf)
    entries: list[tuple[wm.BoundWeight, torch.Tensor]] = []
    waiting: dict[str, set[int]] = {}  # HF name -> entries that still need it
    for model in models:
        bound, params = hf_io._bind_chunk(model, info)
        for weight in bound:
            for name in weight.hf:
                waiting.setdefault(name, set()).add(len(entries))
            entries.append((weight, params[weight.mcore]))
    source = _TensorSource()
    written = 0
    for name, tensor in named_tensors:
        if name not in known:
            raise hf_io.CheckpointError(f"{source.where(name)} is not a {info.model_type} weight")
        if name not in waiting:
            continue  # owned by another pipeline stage / expert-parallel rank
        source.files[name] = tensor
        for index in sorted(waiting[name]):
            weight, param = entries[index]
            if all(h in source.files for h in weight.hf):
                hf_io._load_weight(source, weight, param, info)
                written += 1
                for h in weight.hf:
                    waiting[h].discard(index)
        for h in [h for h in source.files if not waiting[h]]:
            del source.files[h]
    return written
