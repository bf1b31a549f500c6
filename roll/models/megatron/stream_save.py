"""Write a megatron-core dist checkpoint straight from HF safetensors, one parameter at a time.

Each rank builds its model chunks on the ``meta`` device (no memory; ``meta_chunks``) and takes
their ``sharded_state_dict()``: the keys, global shapes, offsets and replicas megatron's loader
expects, swiglu ``linear_fc1`` factories, expert keys and router buffers included. Nothing holds
data yet. ``save_from_hf`` hands that dict to megatron's ``dist_checkpointing.save`` with a save
strategy (``StreamingSaveStrategy``) that writes PyTorch's distributed-checkpoint format as
megatron's own ``torch_dist`` strategy does, but asks for each tensor only when the writer is
about to write it: the planner's ``resolve_data`` reads that parameter's slices of the HF files
(``hf_io.weight_value``, the loader of the strategies), hands out the view the ShardedTensor
describes, and the writer (``StreamingFileSystemWriter``) writes it and drops it before it asks
for the next. Items come in the plan's order, so the two halves of a swiglu ``linear_fc1`` come one
after the other and share one read (the last parameter value is kept for the next request).

So a rank holds one parameter value at a time (plus, while it is read, the HF pieces it is fused
from); ``HFSource.peak_bytes`` is the most parameter-value bytes that were alive at once. The
result is an ordinary ``torch_dist`` checkpoint (PyTorch's ``.distcp`` files and ``.metadata``,
megatron's ``metadata.json`` and ``common.pt``): ``dist_checkpointing.load`` reads it unchanged.

>>> chunks = meta_chunks(hf_config, megatron_cfg, torch.bfloat16)
>>> source = save_from_hf(chunks, "/models/Qwen2.5-7B", "/ckpt/q7/mcore")   # collective
>>> source.peak_bytes
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from roll.core.errors import CheckpointError
from roll.models.megatron import hf_io
from roll.models.megatron import weight_mapping as wm

BACKEND, VERSION = "torch_dist", 1  # what megatron's loader looks up in the checkpoint's metadata.json


# ------------------------------------------------------------------------------------ meta model
@contextlib.contextmanager
def _no_embedding_sync() -> Iterator[None]:
    """A model whose last pipeline stage holds a copy of tied embeddings all-reduces that copy
    with the first stage when it is built; on ``meta`` there is nothing to reduce (the copy's
    value comes from the HF embedding, like any other parameter's)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    with mock.patch.object(LanguageModule, "_is_in_embd_group", lambda self: False):
        yield


def meta_chunks(hf_config: Any, cfg: Any, dtype: torch.dtype) -> list[Any]:
    """This rank's model chunks (``build_model_chunks``) with their weights on the ``meta`` device.

    megatron's parallel state must be set up for ``cfg``. Parameters are created without a
    device (``use_cpu_initialization``), so ``torch.device("meta")`` takes them; modules that name
    the CPU explicitly (roll's ``TorchNorm``) keep their small vectors in memory.
    """
    from roll.models.megatron.model_builder import (
        build_model_chunks,
        transformer_config_from_hf,
    )

    config = transformer_config_from_hf(hf_config, cfg, dtype)
    config.use_cpu_initialization = True
    with torch.device("meta"), _no_embedding_sync():
        return build_model_chunks(hf_config, cfg, dtype, transformer_config=config)


def sharded_state_dict(chunks: list[Any]) -> dict[str, Any]:
    """The dict ``convert`` saves and loads: ``model{i}`` -> chunk i's sharded state dict."""
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def _storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (meta storages have no data pointer, but each is its own)."""
    return tensor.untyped_storage()._cdata


def sharded_tensors(sharded: dict[str, Any]) -> Iterator[Any]:
    """Every ShardedTensor of ``sharded`` after its factories are built (in place)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)
    return (v for v in nested_values(sharded) if isinstance(v, ShardedTensor))


# (shape, stride, storage offset) of a ShardedTensor's data within its parameter's value.
View = tuple[tuple[int, ...], tuple[int, ...], int]


def bind_sharded(
    chunks: list[Any], sharded: dict[str, Any], where: str
) -> list[tuple[Any, wm.BoundWeight, torch.Tensor, View]]:
    """Each ShardedTensor of ``sharded`` (the chunks' dict on ``meta``; factories are built in
    place) with the HF binding of the parameter its data belongs to, that (meta) parameter and
    the view of it the data is. CheckpointError naming ``where`` for a ShardedTensor that holds
    no parameter with an HF mapping."""
    models = [hf_io.unwrap(c) for c in chunks]
    info = models[0].roll_hf_info
    params: dict[int, tuple[wm.BoundWeight, torch.Tensor]] = {}
    for model in models:
        bound, tensors = hf_io._bind_chunk(model, info)
        params.update((_storage_key(tensors[w.mcore]), (w, tensors[w.mcore])) for w in bound)
    out = []
    for sh in sharded_tensors(sharded):
        if _storage_key(sh.data) not in params:
            raise CheckpointError(
                f"{where}: no HF tensor makes megatron's {sh.key!r} (offset {sh.global_offset})"
            )
        weight, param = params[_storage_key(sh.data)]
        view = (tuple(sh.data.shape), sh.data.stride(), sh.data.storage_offset() - param.storage_offset())
        out.append((sh, weight, param, view))
    return out


# ----------------------------------------------------------------------------------- HF source
class HFSource:
    """Makes the data of each ShardedTensor this rank saves, from the HF files, on request.

    Keyed as PyTorch's writer asks: (sharded key, global offset). Each entry knows its parameter's
    HF binding (``weight_mapping.BoundWeight``) and where its data sits in the parameter (shape,
    stride and offset of the view the ShardedTensor holds, e.g. the gate half of ``linear_fc1``).
    Every parameter's HF tensors are checked against its shape before anything is written.
    """

    def __init__(self, chunks: list[Any], hf_dir: str | Path, sharded: dict[str, Any], stack: ExitStack):
        from megatron.core.dist_checkpointing.mapping import is_main_replica

        self.info = hf_io.unwrap(chunks[0]).roll_hf_info
        self.ckpt = hf_io._Checkpoint(hf_dir, stack, self.info)
        hf_io._check_checkpoint_names(self.ckpt, self.info)
        self.items: dict[tuple[str, tuple[int, ...]], tuple[wm.BoundWeight, torch.Tensor, View]] = {}
        checked = set()
        for sh, weight, param, view in bind_sharded(chunks, sharded, str(hf_dir)):
            if weight.mcore not in checked:  # the HF tensors' shapes, before anything is written
                hf_io.weight_value(self.ckpt, weight, self.info, param.shape, read=False)
                checked.add(weight.mcore)
            if is_main_replica(sh.replica_id):
                self.items[(sh.key, tuple(sh.global_offset))] = (weight, param, view)
        self._last: tuple[wm.BoundWeight, torch.Tensor] | None = None
        self.live_bytes = 0
        self.peak_bytes = 0
        self.reads = 0

    def __call__(self, key: str, offset: tuple[int, ...]) -> torch.Tensor:
        """The data of the ShardedTensor ``key`` at ``offset`` (a view of its parameter's value)."""
        weight, param, (shape, stride, storage_offset) = self.items[(key, tuple(offset))]
        if self._last is None or self._last[0] is not weight:
            self._last = None  # drop the previous value before reading the next
            self._last = (weight, self._materialize(weight, param))
        return self._last[1].as_strided(shape, stride, storage_offset)

    def _materialize(self, weight: wm.BoundWeight, param: torch.Tensor) -> torch.Tensor:
        value = hf_io.weight_value(self.ckpt, weight, self.info, param.shape)
        self.ckpt.close_files()
        value = value.to(param.dtype).contiguous()
        if value.untyped_storage().nbytes() != value.nbytes:
            value = value.clone()
        self.reads += 1
        self.live_bytes += value.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(value.untyped_storage(), self._release, value.nbytes)
        return value

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def release(self) -> None:
        self._last = None


# -------------------------------------------------------------------------------- save strategy
def _lazy_planner_class() -> type:
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazySavePlanner(MCoreSavePlanner):
        """megatron's planner, with tensor data made by ``source`` when the writer asks for it."""

        def __init__(self, source: HFSource):
            super().__init__(flatten_state_dict=False)
            self.source = source

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            index = write_item.index
            data = self.source(index.fqn, tuple(index.offset))
            return data.reshape(write_item.tensor_data.chunk.sizes)

    return LazySavePlanner


def _writer_class() -> type:
    import os

    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystemWriter, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.futures import Future

    class StreamingFileSystemWriter(FileSystemWriter):
        """PyTorch's file-system writer (one ``.distcp`` file per rank, the same format), writing
        each item as soon as the planner resolves it and keeping nothing: PyTorch's own loop also
        keeps the last tensor of every key until the file is done (for its safetensors format),
        which for per-layer keys (MoE models) is most of the model."""

        def write_data(self, plan: Any, planner: Any) -> Future:
            file_name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            results = []
            with self.fs.create_stream(self.fs.concat_path(self.path, file_name), "wb") as stream:
                for item in plan.items:
                    data = planner.resolve_data(item)
                    if item.type != WriteItemType.BYTE_IO:
                        data = data.detach().cpu()
                        if data.untyped_storage().nbytes() != data.nbytes:
                            data = data.clone()  # torch.save writes a view's whole storage
                    results.append(
                        _write_item(self.transforms, stream, data, item, file_name, self.serialization_format)
                    )
                    del data
                if self.sync_files:
                    stream.flush()
                    os.fsync(stream.fileno())
            future: Future = Future()
            future.set_result(results)
            return future

    return StreamingFileSystemWriter


def _strategy_class() -> type:
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy

    class StreamingSaveStrategy(SaveShardedStrategy):
        """megatron's ``torch_dist`` format, written one tensor at a time through ``source``.

        As ``TorchDistSaveShardedStrategy``: main replicas only, megatron's ShardedTensors
        translated to PyTorch's, megatron's save planner; but a writer that resolves each tensor
        just before writing it (``StreamingFileSystemWriter``) instead of megatron's, which
        resolves every tensor of the rank before it writes any.
        """

        def __init__(self, source: HFSource):
            super().__init__(BACKEND, VERSION)
            self.source = source

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            import torch.distributed.checkpoint as dcp
            from megatron.core.dist_checkpointing.strategies.torch import (
                _replace_state_dict_keys_with_sharded_keys,
                mcore_to_pyt_state_dict,
            )

            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, keep_only_main_replica=True
            )
            writer = _writer_class()(str(checkpoint_dir), single_file_per_rank=True)
            planner = _lazy_planner_class()(self.source)
            dcp.save(mcore_to_pyt_state_dict(flat, is_loading=False), storage_writer=writer, planner=planner)
            self.source.release()

    return StreamingSaveStrategy


def save_from_hf(chunks: list[Any], hf_dir: str | Path, checkpoint_dir: str | Path) -> HFSource:
    """Write ``chunks``' (built by ``meta_chunks``) dist checkpoint from the HF checkpoint in
    ``hf_dir`` to ``checkpoint_dir``; collective over the default group. Returns the source, whose
    ``peak_bytes`` / ``reads`` tell what was held."""
    from megatron.core import dist_checkpointing

    sharded = sharded_state_dict(chunks)
    with ExitStack() as stack:
        source = HFSource(chunks, hf_dir, sharded, stack)
        dist_checkpointing.save(sharded, str(checkpoint_dir), sharded_strategy=_strategy_class()(source))
    return source
