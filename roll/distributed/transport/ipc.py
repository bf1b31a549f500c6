"""Colocated transport: the receiver maps the sender's bucket buffer instead of copying it.

On GPU the sender allocates its bucket buffers normally and exports a CUDA IPC handle
(``torch.multiprocessing.reductions.reduce_tensor``); the receiver, a different process on the same
device, rebuilds a tensor over the same memory. On CPU the buffers are files in ``/dev/shm`` mapped
by both processes (``torch.from_file(shared=True)``). Either way a bucket crosses processes without
a copy; the handle is a few hundred bytes and travels on the control channel.

A handle names one buffer for as long as it lives; the receiver opens it once and keeps the
mapping (``IpcCache``), so steady-state updates open nothing.

    flat, handle = allocate_shared(512 << 20, device, key=("link0", 0, 0))   # sender
    view = IpcCache().open(handle, receiver_device)                           # receiver
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

# Position of the device index in rebuild_cuda_tensor's arguments.
_CUDA_DEVICE_ARG = 6


@dataclass(frozen=True)
class IpcHandle:
    """How a receiver maps a sender's buffer. ``key`` changes whenever the buffer is replaced."""

    kind: str  # "cuda" or "shm"
    key: tuple
    nbytes: int
    payload: tuple[Any, ...]


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def allocate_shared(nbytes: int, device: torch.device, key: tuple) -> tuple[torch.Tensor, IpcHandle]:
    """A flat uint8 buffer that colocated receivers can map, and its handle."""
    if device.type == "cuda":
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _, args = reduce_tensor(flat)
        return flat, IpcHandle("cuda", key, nbytes, tuple(args))
    path = os.path.join(shm_dir(), f"roll-model-update-{os.getpid()}-{uuid.uuid4().hex}")
    flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return flat, IpcHandle("shm", key, nbytes, (path,))


def release_shared(handle: IpcHandle) -> None:
    """Sender: drop the name of a shared-memory buffer once every receiver has mapped it (the
    mappings stay valid; the memory goes when the last one is gone)."""
    if handle.kind == "shm":
        try:
            os.unlink(handle.payload[0])
        except FileNotFoundError:
            pass


def open_shared(handle: IpcHandle, device: torch.device) -> torch.Tensor:
    """Receiver: the sender's buffer as a flat uint8 tensor on ``device`` (the same physical device)."""
    if handle.kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"a CUDA IPC handle can only be opened on a CUDA device, not {device}")
        args = list(handle.payload)
        # The sender's index counts its own visible devices; map onto the receiver's view of the same GPU.
        args[_CUDA_DEVICE_ARG] = device.index if device.index is not None else torch.cuda.current_device()
        return rebuild_cuda_tensor(*args)
    if handle.kind == "shm":
        path = handle.payload[0]
        if not os.path.exists(path):  # from_file would silently create a new, empty file
            raise FileNotFoundError(
                f"shared bucket buffer {path} is gone: a receiver must map it (IpcCache) before its "
                "first ack, after which the sender removes the name"
            )
        return torch.from_file(path, shared=True, size=handle.nbytes, dtype=torch.uint8)
    raise ValueError(f"unknown IPC handle kind {handle.kind!r}")


class IpcCache:
    """Receiver side: the mapped buffers by handle key, one per sender slot."""

    def __init__(self) -> None:
        self._by_slot: dict[tuple, tuple[tuple, torch.Tensor]] = {}

    def open(self, handle: IpcHandle, device: torch.device) -> torch.Tensor:
        slot = handle.key[:-1]
        cached = self._by_slot.get(slot)
        if cached is not None and cached[0] == handle.key:
            return cached[1]
        flat = open_shared(handle, device)
        self._by_slot[slot] = (handle.key, flat)
        return flat

    def clear(self) -> None:
        self._by_slot.clear()
