"""Load HF safetensors into megatron-core model chunks, and export them back as HF tensors.

Loading: every rank reads only the slices its chunks own (its pipeline layers, its experts, its
TP shard of each tensor, via safetensors ``get_slice``), fuses them (``weight_mapping.fuse``) and
copies them into the parameters in place. Every parameter is filled exactly once and every
checkpoint tensor is claimed by the model's table, else ``CheckpointError`` names the tensor/file.

A checkpoint storing each layer's experts stacked and transposed (Qwen3-VL-MoE,
``stacked_experts``) is read expert by expert from slices of the stacks; the export names each
expert (the model update's wire, which vLLM takes) and ``save_hf_checkpoint`` writes the stacks
over all experts (rank 0 holds a stack's pieces until every EP rank's part has arrived).

Export (``export_hf_weights``) is collective: every rank of the model's process groups must iterate
it (it gathers TP shards onto TP rank 0). Which ranks yield what, with ``gather=True``
(``export_roles()`` tells a rank its part):

- non-expert tensors of PP stage p: the one rank of stage p with TP rank 0 and data-parallel rank 0
  (context-parallel included), yielding full tensors gathered over its TP group;
- expert tensors: for each EP rank e of stage p, the one rank with expert-TP rank 0 and expert
  data-parallel rank 0, yielding full tensors of EP rank e's experts gathered over expert-TP.

So the senders are "one per PP stage and EP rank", and each HF tensor is yielded by exactly one rank
of the world. With ``gather=False`` there is no communication: every TP (expert-TP) rank of those
groups yields its own slice of each HF tensor (padding rows of the vocab dropped; for a Gated
DeltaNet conv weight, its blocks of the q, k and v sections, concatenated).

>>> load_hf_weights(chunks, "/models/Qwen2.5-7B")
>>> for name, tensor in export_hf_weights(chunks):      # on every rank; names as in the HF checkpoint
...     bucket.add(name, tensor)
>>> save_hf_checkpoint(chunks, hf_config, "/out/hf", tokenizer_dir="/models/Qwen2.5-7B")
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from roll.core.errors import CheckpointError
from roll.models.megatron import lora
from roll.models.megatron import weight_mapping as wm
from roll.models.megatron.stacked_experts import Stacker

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# safetensors' dtype names (``get_slice(name).get_dtype()``) -> torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
SINGLE_FILE = "model.safetensors"


# ------------------------------------------------------------------------------------ helpers
def unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers (they hold it as ``.module``)."""
    model = chunk
    while not hasattr(model, "roll_hf_info"):
        if not hasattr(model, "module"):
            raise TypeError(f"{type(chunk).__name__} was not built by model_builder.build_model_chunks")
        model = model.module
    return model


def _group_rank_size(expert: bool) -> tuple[Any, int, int]:
    """(group, rank, size) of the TP group, or the expert-TP group for expert weights."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    if group is None or not dist.is_initialized():
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)


class _Checkpoint:
    """Names -> files of an HF safetensors checkpoint, and a slice reader over lazily opened files."""

    def __init__(self, hf_dir: str | Path, stack: ExitStack, info: wm.ConversionInfo | None = None):
        self.dir = Path(hf_dir)
        self.files_open = ExitStack()
        stack.callback(self.close_files)
        self.handles: dict[str, Any] = {}
        index = self.dir / INDEX_FILE
        if index.exists():
            self.files = dict(json.loads(index.read_text())["weight_map"])
        elif (self.dir / SINGLE_FILE).exists():
            self.files = dict.fromkeys(self._open(SINGLE_FILE).keys(), SINGLE_FILE)
        else:
            raise CheckpointError(
                f"{self.dir}: no {INDEX_FILE} or {SINGLE_FILE} (only safetensors checkpoints are supported)"
            )
        # The tables' names -> the names stored (a vision-language checkpoint stores the language
        # model under "model." and the tower under "visual.", transformers 5's modules elsewhere).
        stored = {wm.module_name(info, name): name for name in self.files} if info is not None else {}
        self.stored = {k: v for k, v in stored.items() if k != v}
        self.files = (
            {wm.module_name(info, n): f for n, f in self.files.items()} if info is not None else self.files
        )
        # Experts stored stacked (``stacked_experts``): each expert's part is a slice of its stack.
        self.slots: dict[str, Any] = {}
        self.stack_files: dict[str, str] = {}
        if info is not None and info.stacked is not None:
            self.files = self._expand_stacks(info.stacked)

    def _expand_stacks(self, stacked: Any) -> dict[str, str]:
        files = {}
        for name, file in self.files.items():
            for expanded in stacked.expand(name):
                files[expanded] = file
                if expanded != name:
                    self.slots[expanded] = stacked.slot(expanded)
                    self.stack_files[name] = file
        return files

    def _open(self, file: str) -> Any:
        if file not in self.handles:
            self.handles[file] = self.files_open.enter_context(
                safe_open(self.dir / file, framework="pt", device="cpu")
            )
        return self.handles[file]

    def close_files(self) -> None:
        """Close the open files (they reopen on the next read): their memory-mapped pages leave
        the process, so streaming readers do not accumulate the files in their resident set."""
        self.files_open.close()
        self.handles = {}

    def where(self, name: str) -> str:
        return f"tensor {name!r} in {self.dir / self.files[name]}"

    def shape(self, name: str) -> list[int]:
        if name not in self.files:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        shape = list(self._slice(name).get_shape())
        if name not in self.slots:
            return shape
        try:
            self.slots[name].transposed(shape)
        except ValueError as err:
            raise CheckpointError(f"{self.where(name)}: stacked {self.slots[name].stored} {err}") from err
        return self.slots[name].shape()

    def _slice(self, name: str) -> Any:
        name = self.slots[name].stored if name in self.slots else name
        file = self.stack_files[name] if name in self.stack_files else self.files[name]
        return self._open(file).get_slice(self.stored.get(name, name))

    def meta(self, name: str, shape: list[int]) -> torch.Tensor:
        """An empty ``meta`` tensor of ``shape`` and of the dtype ``name`` has in the file."""
        dtype = self._slice(name).get_dtype()
        if dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.where(name)} has dtype {dtype}, which roll does not convert")
        return torch.empty(shape, dtype=_SAFETENSORS_DTYPES[dtype], device="meta")

    def read(self, name: str, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        """The whole tensor (``dim`` None) or rows/columns [start, stop) of dim 0/1."""
        sliced = self._slice(name)
        if name in self.slots:
            return self.slots[name].read(sliced, list(sliced.get_shape()), dim, start, stop)
        if dim is None:
            return sliced[:]
        return sliced[start:stop] if dim == 0 else sliced[:, start:stop]


# --------------------------------------------------------------------------------------- load
def _read_pieces(
    ckpt: _Checkpoint, weight: wm.BoundWeight, info: wm.ConversionInfo, read: bool = True
) -> list[torch.Tensor]:
    """This rank's piece of each HF tensor of ``weight`` (vocab pieces zero-padded to full length;
    several pieces of one tensor where its layout has sections, ``wm.read_ranges``); with
    ``read=False`` empty ``meta`` tensors of the pieces' shapes (nothing is read)."""
    _, rank, size = _group_rank_size(weight.expert)
    dim = wm.TP_DIM[weight.layout]
    pieces = []
    for name in weight.hf:
        shape = ckpt.shape(name)
        if dim is None:
            pieces.append(ckpt.read(name, None) if read else ckpt.meta(name, shape))
            continue
        if dim >= len(shape):
            raise CheckpointError(f"{ckpt.where(name)} has shape {shape}; expected at least {dim + 1} dims")
        try:
            ranges = wm.read_ranges(weight.layout, shape[dim], size, rank, info.padded_vocab_size, info.heads)
        except ValueError as err:
            raise CheckpointError(f"{ckpt.where(name)} (shape {shape}): {err}") from err
        padded_rows = info.padded_vocab_size // size
        pieces += [_read_piece(ckpt, name, weight.layout, shape, rows, padded_rows, read) for rows in ranges]
    return pieces


def _read_piece(
    ckpt: _Checkpoint,
    name: str,
    layout: str,
    shape: list[int],
    rows: tuple[int, int],
    padded_rows: int,
    read: bool,
) -> torch.Tensor:
    """Rows (or columns) [start, stop) of HF tensor ``name`` along the layout's TP dim (vocab rows
    zero-padded to the rank's ``padded_rows``); a ``meta`` tensor of that shape when not ``read``."""
    dim, (start, stop) = wm.TP_DIM[layout], rows
    if not read:
        shape = [*shape[:dim], stop - start, *shape[dim + 1 :]]
        if layout == wm.VOCAB:
            shape[0] = padded_rows
        return ckpt.meta(name, shape)
    piece = ckpt.read(name, dim, start, stop)
    if layout == wm.VOCAB and stop - start < padded_rows:
        padded = torch.zeros(padded_rows, *shape[1:], dtype=piece.dtype)
        padded[: stop - start] = piece
        piece = padded
    return piece


def weight_value(
    ckpt: _Checkpoint,
    weight: wm.BoundWeight,
    info: wm.ConversionInfo,
    shape: torch.Size | tuple[int, ...],
    read: bool = True,
) -> torch.Tensor:
    """This rank's value of the Megatron parameter ``weight`` (of ``shape``) from the HF tensors;
    with ``read=False`` a ``meta`` tensor (shapes checked, nothing read). CheckpointError naming the
    tensor and file when the HF tensors do not make a parameter of ``shape``."""
    pieces = _read_pieces(ckpt, weight, info, read)
    try:
        value = wm.fuse(weight.layout, pieces, info.heads)
    except RuntimeError as err:
        raise CheckpointError(f"{ckpt.where(weight.hf[0])}: cannot build {weight.mcore}: {err}") from err
    if tuple(value.shape) != tuple(shape):
        shapes = {name: ckpt.shape(name) for name in weight.hf}
        _, rank, size = _group_rank_size(weight.expert)
        raise CheckpointError(
            f"{ckpt.where(weight.hf[0])}: HF tensors {shapes} give {list(value.shape)} for Megatron parameter "
            f"{weight.mcore} of TP rank {rank}/{size}, which has shape {list(shape)}"
        )
    return value


def _load_weight(
    ckpt: _Checkpoint, weight: wm.BoundWeight, param: torch.Tensor, info: wm.ConversionInfo
) -> None:
    value = weight_value(ckpt, weight, info, param.shape)
    with torch.no_grad():
        param.copy_(value)


def model_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The chunk's parameters plus the buffers that are HF weights too (the MoE router's
    ``expert_bias``, DeepSeek-V3's ``e_score_correction_bias``); LoRA adapters are no HF weights
    (an adapted layer's weight is exported merged, ``lora.adapted_weights``)."""
    tensors = {n: p for n, p in model.named_parameters() if not lora.is_adapter(n)}
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith(wm.HF_BUFFER_SUFFIXES))
    return tensors


def _bind_chunk(model: Any, info: wm.ConversionInfo) -> tuple[list[wm.BoundWeight], dict[str, torch.Tensor]]:
    """The chunk's bound weights and parameters, checked to cover each other exactly."""
    params = model_tensors(model)
    bound = wm.chunk_weights(model, info, wm.MegatronNaming.detect(params))
    names = [w.mcore for w in bound]
    unmapped = sorted(set(params) - set(names))
    missing = sorted(set(names) - set(params))
    if unmapped or missing or len(names) != len(set(names)):
        raise CheckpointError(
            f"model_type {info.model_type!r}: Megatron parameters without an HF mapping: {unmapped}; "
            f"mapped names the model lacks: {missing}"
        )
    return bound, params


def _check_checkpoint_names(ckpt: _Checkpoint, info: wm.ConversionInfo) -> None:
    expected = wm.expected_hf_names(info)
    ignorable = set(wm.OUTPUT.hf) if info.tie_word_embeddings else set()
    skipped = {name for name in ckpt.files if info.skipped(name)}
    if skipped:
        if info.extra_layers:
            what = f"of the {info.extra_layers} multi-token-prediction layer(s) after layer {info.num_layers - 1}"
        else:
            what = f"of modules roll does not build ({', '.join(p + '*' for p in info.skipped_prefixes)})"
        logger.info(
            "%s: skipping %d tensors %s (not built by roll's %s)",
            ckpt.dir,
            len(skipped),
            what,
            info.model_type,
        )
        ignorable |= skipped
    unused = sorted(set(ckpt.files) - expected - ignorable)
    missing = sorted(expected - set(ckpt.files))
    if unused:
        raise CheckpointError(
            f"{ckpt.where(unused[0])} is not used by the {info.model_type} conversion "
            f"({len(unused)} unused tensors: {unused[:8]})"
        )
    if missing:
        raise CheckpointError(
            f"{ckpt.dir}: {len(missing)} tensors missing from the checkpoint: {missing[:8]}"
        )


def load_hf_weights(model_chunks: list[Any], hf_dir: str | Path) -> None:
    """Fill every parameter of this rank's chunks from the HF checkpoint in ``hf_dir``, in place."""
    models = [unwrap(chunk) for chunk in model_chunks]
    info = models[0].roll_hf_info
    with ExitStack() as stack:
        ckpt = _Checkpoint(hf_dir, stack, info)
        _check_checkpoint_names(ckpt, info)
        for model in models:
            bound, params = _bind_chunk(model, info)
            for weight in bound:
                _load_weight(ckpt, weight, params[weight.mcore], info)


# ------------------------------------------------------------------------------------- export
def _exporting_groups() -> tuple[bool, bool]:
    """Whether this rank's TP group exports non-expert tensors, and its expert-TP group experts.

    Every member of a TP group shares its data-parallel rank, and every member of an expert-TP
    group its expert data-parallel rank, so whole groups take part in the gathers or skip them.
    """
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        return True, True
    dense = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    return dense, ps.get_expert_data_parallel_rank() == 0


def export_roles() -> tuple[bool, bool]:
    """(yields non-expert tensors, yields expert tensors) for this rank under
    ``export_hf_weights(gather=True)``: the model-update senders are the ranks with either true."""
    from megatron.core import parallel_state as ps

    dense, experts = _exporting_groups()
    if not dist.is_initialized():
        return dense, experts
    return (
        dense and ps.get_tensor_model_parallel_rank() == 0,
        experts and ps.get_expert_tensor_parallel_rank() == 0,
    )


def _shards(shard: torch.Tensor, group: Any, rank: int, size: int, gather: bool) -> list[torch.Tensor] | None:
    """All TP shards of a parameter on the group's rank 0 (None elsewhere), or just this one."""
    if not gather or size == 1:
        return [shard]
    shard = shard.contiguous()
    shards = [torch.empty_like(shard) for _ in range(size)] if rank == 0 else None
    dist.gather(shard, shards, dst=dist.get_global_rank(group, 0), group=group)
    return shards


def _hf_tensors(
    weight: wm.BoundWeight, param: torch.Tensor, info: wm.ConversionInfo, gather: bool
) -> list[torch.Tensor] | None:
    """Full HF tensors of ``weight`` on the TP group's rank 0 (``gather``), or this rank's slices of
    them; None on the ranks that yield nothing."""
    group, rank, size = _group_rank_size(weight.expert)
    dim = wm.TP_DIM[weight.layout]
    if dim is None:  # replicated: every TP rank holds the whole tensor
        return [param.detach()] if rank == 0 or not gather else None
    shards = _shards(param.detach(), group, rank, size, gather)
    if shards is None:
        return None
    per_shard = [wm.unfuse(weight.layout, s, info.heads) for s in shards]
    pieces = [
        torch.cat([parts[i] for parts in per_shard], dim) if len(per_shard) > 1 else per_shard[0][i]
        for i in range(len(per_shard[0]))
    ]
    tensors = wm.join(weight.layout, pieces)
    if weight.layout == wm.VOCAB:
        first_row = 0 if len(shards) == size else rank * (info.padded_vocab_size // size)
        tensors = [t[: max(0, info.vocab_size - first_row)] for t in tensors]
    return tensors


def export_hf_weights(
    model_chunks: list[Any], gather: bool = True, every_replica: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors of this rank's share of the model; collective, see the module docstring.

    ``every_replica``: every data-parallel replica exports its own copy (each gathers within its
    own TP groups), for comparing what each replica holds; by default only replica 0 does.
    Tensors keep the parameters' dtype and device and may share their storage: copy what you keep.
    """
    models = [unwrap(chunk) for chunk in model_chunks]
    info = models[0].roll_hf_info
    dense_group, expert_group = (True, True) if every_replica else _exporting_groups()
    for model in models:
        bound, params = _bind_chunk(model, info)
        adapted = lora.adapted_weights(model)
        for weight in bound:
            if not weight.export or not (expert_group if weight.expert else dense_group):
                continue
            module = adapted.get(weight.mcore)
            param = lora.merged_weight(module) if module is not None else params[weight.mcore]
            tensors = _hf_tensors(weight, param, info, gather)
            if tensors is not None:
                yield from zip(weight.hf, tensors)


# ---------------------------------------------------------------------------------------- save
def _collect_parts(model_chunks: list[Any]) -> Iterator[dict[str, torch.Tensor]]:
    """On rank 0: each exporting rank's tensors (on CPU) in rank order; elsewhere: nothing.

    Each sender's part travels to rank 0 point-to-point (names, shapes and dtypes as an object,
    then the tensors), so rank 0 holds one part at a time.
    """
    local = {name: t.detach().to("cpu", copy=True) for name, t in export_hf_weights(model_chunks)}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield local
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    flags: list[Any] = [None] * world
    dist.all_gather_object(flags, bool(local))
    device = next(unwrap(model_chunks[0]).parameters()).device
    for sender in (r for r in range(world) if flags[r]):
        if sender == 0:
            if rank == 0:
                yield local
        elif rank == sender:
            dist.send_object_list([[(name, tuple(t.shape), t.dtype) for name, t in local.items()]], dst=0)
            for tensor in local.values():
                dist.send(tensor.to(device).contiguous(), dst=0)
        elif rank == 0:
            meta: list[Any] = [None]
            dist.recv_object_list(meta, src=sender)
            part = {}
            for name, shape, dtype in meta[0]:
                buf = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buf, src=sender)
                part[name] = buf.cpu()
            yield part


def _write_parts(parts: Iterator[dict[str, torch.Tensor]], out: Path, info: wm.ConversionInfo) -> None:
    """Each part into its own safetensors file, then the index (when there are several files)."""
    from safetensors.torch import save_file

    files: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    total = 0
    # Experts stored stacked: a stack is written with the part that completes it (its experts come
    # from every EP rank's part, so rank 0 holds a stack's pieces until the last one arrives).
    stacker = Stacker(info.stacked) if info.stacked is not None else None
    for i, part in enumerate(parts):
        clash = sorted(seen & set(part))
        if clash:
            raise RuntimeError(f"HF tensors exported by two ranks: {clash[:8]}")
        seen.update(part)
        if stacker is not None:
            part = dict(stacker.add(part.items()))
            if not part:
                continue
        file = f"part-{i:05d}.safetensors"
        save_file({n: t.contiguous() for n, t in part.items()}, out / file, metadata={"format": "pt"})
        files.append((file, list(part)))
        total += sum(t.numel() * t.element_size() for t in part.values())
    missing = sorted(wm.expected_hf_names(info) - seen)
    if missing:
        raise RuntimeError(f"export is missing HF tensors: {missing[:8]}")
    if stacker is not None:
        stacker.check_done()
    weight_map = {}
    for i, (file, names) in enumerate(files):
        final = SINGLE_FILE if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (out / file).rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def save_hf_checkpoint(
    model_chunks: list[Any], hf_config: Any, out_dir: str | Path, tokenizer_dir: str | None = None
) -> None:
    """Write the whole model as an HF checkpoint (safetensors + config.json) from rank 0.

    Collective over the world: every rank calls it. Rank 0 writes one safetensors file per exporting
    rank as it arrives (plus the index when there are several), ``config.json`` from ``hf_config``
    and, with ``tokenizer_dir``, the tokenizer and generation config found there.
    """
    info = unwrap(model_chunks[0]).roll_hf_info
    out = Path(out_dir)
    parts = _collect_parts(model_chunks)
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        _write_parts(parts, out, info)
        hf_config.save_pretrained(out)
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, out)
    else:
        for _ in parts:
            pass
    if dist.is_initialized():
        dist.barrier()


def _copy_tokenizer(tokenizer_dir: str, out: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    if (Path(tokenizer_dir) / "generation_config.json").exists():
        GenerationConfig.from_pretrained(tokenizer_dir).save_pretrained(out)
