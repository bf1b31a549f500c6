"""TEST-ONLY: let megatron-core's optimizer, DDP, schedules and dist-checkpointing run on CPU.

They create helper tensors with ``device="cuda"``, call ``.cuda()`` / ``torch.cuda.synchronize()``
and check ``param.type() == "torch.cuda.FloatTensor"``. Inside ``cuda_on_cpu()`` a
``TorchFunctionMode`` sends those tensors to the CPU and reports CPU tensor types under their CUDA
names; ``torch.cuda.synchronize``/``empty_cache`` do nothing, and CUDA streams/events (the MoE all-to-all
dispatcher's device-to-host side stream) are stand-ins that order nothing (CPU work is in order). Together with ``compat.apply()``
(forward-pass patches) the megatron strategies then run unchanged on gloo. Never used on CUDA
machines (``cuda_on_cpu`` is a no-op there) and never imported by ``roll/``.

>>> with cuda_on_cpu():
...     strategy.initialize(); strategy.train_step(micro_batches, loss_fn)

The CPU variants of the multi-rank tests also run on CUDA machines: ``cuda_hidden()`` around the
spawn starts the ranks with ``CUDA_VISIBLE_DEVICES=""``, so they see no GPU and take these shims.

>>> with cuda_hidden():
...     mp.spawn(worker, nprocs=2)
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _cpu(value):
    if isinstance(value, str) and value.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name in ("cuda", "pin_memory"):
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:
            out = func(*args)
            return _CUDA_TYPE_NAMES.get(out, out)
        if name == "to":
            args = tuple(_cpu(a) for a in args)
        return func(*args, **kwargs)


class _CpuEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _CpuStream:
    """``torch.cuda.Stream`` on CPU: every operation is already ordered, so waits do nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _CpuEvent()

    def synchronize(self) -> None:
        pass


_DEFAULT_STREAM = _CpuStream()


@contextlib.contextmanager
def _cpu_stream_context(stream=None):
    yield


@contextlib.contextmanager
def cuda_on_cpu():
    """Run the block with CUDA-only helper tensors on CPU (does nothing where CUDA exists)."""
    if torch.cuda.is_available():
        yield
        return
    names = ("synchronize", "empty_cache", "Stream", "Event", "stream", "current_stream")
    saved = {name: getattr(torch.cuda, name) for name in names}
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = lambda *args, **kwargs: _CpuEvent()
    torch.cuda.stream = _cpu_stream_context
    torch.cuda.current_stream = lambda *args, **kwargs: _DEFAULT_STREAM
    try:
        with _CudaOnCpu():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


@contextlib.contextmanager
def cuda_hidden():
    """Processes started inside the block (``mp.spawn``'s ranks, subprocesses) see no CUDA device:
    ``CUDA_VISIBLE_DEVICES`` is empty in the environment they inherit, before their torch initialises
    CUDA. This process is unaffected (its CUDA, if any, is already initialised)."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
