"""Write an HF safetensors checkpoint from a megatron-core dist checkpoint, part by part.

A dist checkpoint stores global tensors (every TP shard, pipeline stage and expert of a parameter
in one tensor), so the HF tensors are read in the one layout that holds every parameter whole:
TP = PP = EP = 1 (its vocab padded as the checkpoint's), built on the ``meta`` device
(``stream_save.meta_chunks``). The exported parameters, in export order, are cut into parts of at
most ``max_shard_bytes`` of HF tensors (a larger single tensor is a part of its own). Part i is
written by rank ``i % world``: for each part a rank loads just that part's parameters
(``dist_checkpointing.load`` of a sharded state dict holding only their entries, into buffers of
the parameters' shapes), unfuses them into HF tensors (``hf_io._hf_tensors``, the export of the
strategies) and writes them as ``model-0000i-of-0000N.safetensors`` (``model.safetensors`` when
there is one part). Rank 0 writes the index, ``config.json`` and the tokenizer.

So a rank holds one part at a time: its parameters, turned into HF tensors one by one (a fused
parameter's q/k/v or gate/up are copied apart), plus the checkpoint chunk being read. The loads
are collective (every rank takes part in every round, loading
nothing once it has no part left).

>>> chunks = stream_save.meta_chunks(hf_config, whole_model_cfg, torch.bfloat16)   # TP = PP = EP = 1
>>> parts = export_to_hf(chunks, "/ckpt/q7/mcore", "/models/q7-back", max_shard_bytes=2 * 10**9)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from roll.models.megatron import hf_io
from roll.models.megatron import weight_mapping as wm
from roll.models.megatron.stacked_experts import StackedNames, Stacker

# Size suffixes: decimal (KB, MB, GB, TB, as transformers' max_shard_size) and binary (KiB ... TiB).
_UNITS = {"": 1, "B": 1} | {f"{p}B": 1000 ** (i + 1) for i, p in enumerate("KMGT")}
_UNITS |= {f"{p}IB": 1024 ** (i + 1) for i, p in enumerate("KMGT")}


def parse_size(text: str | int) -> int:
    """Bytes from ``1048576``, ``500MB``, ``2GB``, ``4GiB``; ValueError otherwise."""
    if isinstance(text, int):
        value = text
    else:
        stripped = text.strip().upper()
        number = stripped.rstrip("KMGTIB")
        unit = stripped[len(number) :]
        if unit not in _UNITS or not number.replace(".", "", 1).isdigit():
            raise ValueError(f"{text!r} is not a size (e.g. 2GB, 500MB, 4GiB, 1048576)")
        value = int(float(number) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return value


@dataclasses.dataclass
class _Entry:
    """One exported parameter: its binding, its meta parameter, its HF tensors' bytes and the
    ShardedTensors (with their views of the parameter) that hold it in the checkpoint."""

    weight: wm.BoundWeight
    param: torch.Tensor
    nbytes: int
    tensors: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)


def _entries(chunks: list[Any], where: str) -> list[_Entry]:
    from roll.models.megatron.stream_save import bind_sharded, sharded_state_dict

    model = hf_io.unwrap(chunks[0])
    info = model.roll_hf_info
    bound, params = hf_io._bind_chunk(model, info)
    entries = {}
    for weight in bound:
        if weight.export:
            meta = hf_io._hf_tensors(weight, params[weight.mcore], info, gather=False)
            entries[weight.mcore] = _Entry(weight, params[weight.mcore], sum(t.nbytes for t in meta))
    for sh, weight, _, view in bind_sharded(chunks, sharded_state_dict(chunks), where):
        if weight.mcore in entries:
            entries[weight.mcore].tensors.append((sh, view))
    empty = sorted(name for name, e in entries.items() if not e.tensors)
    if empty:
        raise RuntimeError(f"{where}: parameters without a ShardedTensor: {empty[:8]}")
    return list(entries.values())


def plan_parts(
    entries: list[_Entry], max_bytes: int, stacked: StackedNames | None = None
) -> list[list[_Entry]]:
    """Consecutive entries grouped into parts of at most ``max_bytes`` (one entry at least); the
    entries of one stacked expert tensor (``stacked``) stay in one part, which may exceed it."""
    parts: list[list[_Entry]] = []
    size = 0
    previous = None
    for entry in entries:
        stack = _stack_of(entry, stacked)
        if not parts or (size + entry.nbytes > max_bytes and (stack is None or stack != previous)):
            parts.append([])
            size = 0
        previous = stack
        parts[-1].append(entry)
        size += entry.nbytes
    return parts


def _stack_of(entry: _Entry, stacked: StackedNames | None) -> str | None:
    """The stacked tensor ``entry``'s HF tensors belong to (one stack: a fused gate/up parameter
    of one expert is two parts of the same stack), or None."""
    if stacked is None:
        return None
    slot = stacked.slot(entry.weight.hf[0])
    return None if slot is None else slot.stored


def part_file(index: int, count: int) -> str:
    return hf_io.SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _request(sh: Any, buffer: torch.Tensor, view: Any) -> Any:
    """``sh`` reading into its ``view`` of ``buffer``, its prepended axes (megatron's layer axis of
    dense models) folded into the data: megatron loads a regular-grid ShardedTensor with
    prepended axes only when the other ranks hold the rest of the grid."""
    data = buffer.as_strided(*view)
    local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    return dataclasses.replace(
        sh, data=data.view(local), local_shape=local, prepend_axis_num=0, axis_fragmentations=None
    )


def _load_part(part: list[_Entry], mcore_dir: Path) -> dict[str, torch.Tensor]:
    """The Megatron parameters of ``part`` (by name) read from the checkpoint (collective)."""
    from megatron.core import dist_checkpointing

    values, request = {}, {}
    for entry in part:
        buffer = values[entry.weight.mcore] = torch.empty(entry.param.shape, dtype=entry.param.dtype)
        for i, (sh, view) in enumerate(entry.tensors):
            request[f"{entry.weight.mcore}/{i}"] = _request(sh, buffer, view)
    dist_checkpointing.load(request, str(mcore_dir), validate_access_integrity=False)
    return values


def _write_part(part: list[_Entry], values: dict[str, torch.Tensor], info: Any, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for entry in part:
        hf = hf_io._hf_tensors(entry.weight, values.pop(entry.weight.mcore), info, gather=False)
        # A fused parameter's HF tensors are views of one buffer: safetensors wants them apart.
        tensors.update((n, t.clone() if len(hf) > 1 else t.contiguous()) for n, t in zip(entry.weight.hf, hf))
    if info.stacked is not None:
        stacker = Stacker(info.stacked)
        tensors = dict(stacker.add(tensors.items()))
        stacker.check_done()  # plan_parts keeps each stack in one part
    save_file(tensors, path, metadata={"format": "pt"})


def _check_complete(parts: list[list[_Entry]], info: wm.ConversionInfo) -> None:
    names = [name for part in parts for entry in part for name in entry.weight.hf]
    missing = sorted(wm.expected_hf_names(info) - set(names))
    if missing or len(names) != len(set(names)):
        raise RuntimeError(f"export is missing HF tensors {missing[:8]} or repeats some")


def _write_index(parts: list[list[_Entry]], out: Path, stacked: StackedNames | None = None) -> None:
    if len(parts) == 1:
        return
    stored = stacked.stored_name if stacked is not None else (lambda name: name)
    weight_map = {
        stored(name): part_file(i, len(parts))
        for i, part in enumerate(parts)
        for e in part
        for name in e.weight.hf
    }
    total = sum(e.nbytes for part in parts for e in part)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / hf_io.INDEX_FILE).write_text(json.dumps(index, indent=2))


def export_to_hf(
    chunks: list[Any], mcore_dir: str | Path, out_dir: str | Path, max_shard_bytes: int
) -> list[list[_Entry]]:
    """Write the HF safetensors (+ index) of the dist checkpoint ``mcore_dir`` into ``out_dir``.

    ``chunks``: the TP = PP = EP = 1 model on ``meta`` (one chunk). Collective over the default
    group; returns the parts (what each holds)."""
    info = hf_io.unwrap(chunks[0]).roll_hf_info
    parts = plan_parts(_entries(chunks, str(mcore_dir)), max_shard_bytes, info.stacked)
    _check_complete(parts, info)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for first in range(0, len(parts), world):
        index = first + rank
        part = parts[index] if index < len(parts) else []
        values = _load_part(part, Path(mcore_dir))
        if part:
            _write_part(part, values, info, out / part_file(index, len(parts)))
        del values
    if rank == 0:
        _write_index(parts, out, info.stacked)
    return parts
