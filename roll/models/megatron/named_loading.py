"""Load a stream of full HF-named tensors (a model update) into this rank's megatron chunks.

The sender yields whole HF tensors (``hf_io.export_hf_weights`` of actor_train, or any HF
checkpoint); each receiving rank keeps only what its chunks own, cut to its TP / EP shard with the
same tables and slicing as ``hf_io.load_hf_weights``. Tensors that fuse into one parameter (q/k/v,
gate/up) are held until all of them have arrived, then dropped, also across the buckets of one
update (several calls).

>>> loader = NamedTensorLoader(chunks)
>>> count = loader.load(trainer.iter_hf_weights())   # parameters written
>>> loader.finish()                                  # raises if a fused parameter's parts are missing
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from roll.core.errors import CheckpointError
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


class NamedTensorLoader:
    """Copy the shards this rank owns of each incoming tensor into its parameters, over several
    calls (unknown names raise ``CheckpointError``): one model update arrives as a stream of buckets,
    each loaded by its own call, and the parts of a fused parameter (q/k/v, gate/up) may arrive in
    different buckets. Parts still waiting for a sibling at the end of a call are copied (the
    caller reuses the bucket's buffer) and held until the sibling comes; ``finish()`` raises if any
    part is still waiting, instead of leaving that parameter silently stale.

    >>> loader = NamedTensorLoader(chunks)
    >>> for bucket in buckets: loader.load(bucket)
    >>> loader.finish()
    """

    def __init__(self, model_chunks: list[Any]) -> None:
        models = [hf_io.unwrap(chunk) for chunk in model_chunks]
        self.info = models[0].roll_hf_info
        self.known = wm.expected_hf_names(self.info) | set(wm.OUTPUT.hf)
        self.entries: list[tuple[wm.BoundWeight, torch.Tensor]] = []
        self.waiting: dict[str, set[int]] = {}  # HF name -> entries that still need it
        for model in models:
            bound, params = hf_io._bind_chunk(model, self.info)
            for weight in bound:
                for name in weight.hf:
                    self.waiting.setdefault(name, set()).add(len(self.entries))
                self.entries.append((weight, params[weight.mcore]))
        self.source = _TensorSource()

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write every parameter whose parts have all arrived; returns how many were written.

        Parts that arrived in this call and still wait for a sibling are copied once, here (the
        caller reuses the bucket's buffer); parts held from earlier calls are left as they are.
        Calls may run on different CUDA streams (one per model-update link): a held copy made on
        one stream and consumed on another is marked in use by the consuming stream before it is
        dropped, so the allocator cannot hand its memory out before that stream has read it."""
        source, written = self.source, 0
        arrived: set[str] = set()
        for name, tensor in named_tensors:
            name = wm.module_name(self.info, name)  # a vision-language checkpoint's names too
            if name not in self.known:
                if self.info.skipped(name):
                    continue  # a layer roll does not build (DeepSeek-V3's multi-token prediction)
                raise CheckpointError(f"{source.where(name)} is not a {self.info.model_type} weight")
            if name not in self.waiting:
                continue  # owned by another pipeline stage / expert-parallel rank
            source.files[name] = tensor
            arrived.add(name)
            for index in sorted(self.waiting[name]):
                weight, param = self.entries[index]
                if all(h in source.files for h in weight.hf):
                    hf_io._load_weight(source, weight, param, self.info)
                    written += 1
                    for h in weight.hf:
                        self.waiting[h].discard(index)
            for h in [h for h in source.files if not self.waiting[h]]:
                _drop(source.files.pop(h), held=h not in arrived)
        for name in arrived & set(source.files):
            source.files[name] = source.files[name].clone()  # held past this call
        return written

    def pending(self) -> list[str]:
        """HF names received but still waiting for the other parts of their fused parameter."""
        return sorted(self.source.files)

    def finish(self) -> None:
        """Forget the held parts; raise if any fused parameter was left incomplete."""
        pending = self.pending()
        self.source.files.clear()
        if pending:
            raise CheckpointError(
                f"model update ended with {len(pending)} tensor(s) whose fused parameter never got all "
                f"its parts (first: {pending[0]!r}); that parameter was not written"
            )


def _drop(tensor: torch.Tensor, held: bool) -> None:
    """Forget a part that has been written; a copy held from an earlier call (possibly made on
    another stream) stays allocated until the current stream's reads of it have run."""
    if held and tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
