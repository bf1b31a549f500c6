"""Offload and reload of a megatron training rank's GPU state (params, grads, optimizer state).

Colocated layouts run actor_train and actor_infer on the same GPUs: between training steps the
trainer moves its state to CPU so the inference engine gets the memory back.

>>> offloader = StateOffloader(ddp_chunks, optimizer)
>>> offloader.offload(params=True, grads=True, optimizer=True)   # CUDA memory freed
>>> offloader.reload()                                            # everything back, same tensors

Grads (and params under the distributed optimizer) live in megatron DDP's contiguous buffers; those
are freed by shrinking the buffer storage to 0 (megatron's own ``offload_to_cpu``), so every
``param.data`` / ``param.main_grad`` view stays valid. Other params and the optimizer's fp32 main
params and Adam moments are moved tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def _inner_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    if hasattr(optimizer, "chained_optimizers"):
        for inner in optimizer.chained_optimizers:
            yield from _inner_optimizers(inner)
    elif hasattr(optimizer, "optimizer"):
        yield optimizer.optimizer


class StateOffloader:
    """Moves a DDP-wrapped model's state and its megatron optimizer's state off the GPU and back."""

    def __init__(self, model: list[torch.nn.Module], optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self.offloaded: set[str] = set()
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        )

    def _buffers(self) -> list[Any]:
        return [b for m in self.model for b in list(m.buffers) + list(m.expert_parallel_buffers)]

    def _loose_params(self) -> list[torch.nn.Parameter]:
        """Params not held in a DDP param buffer (all of them without the distributed optimizer)."""
        in_buffers = any(b.param_data is not None for b in self._buffers())
        params = [p for m in self.model for p in m.parameters()]
        return [p for p in params if not (in_buffers and p.requires_grad)]

    def _move_params(self, device: torch.device | str, to_cpu: bool) -> None:
        for buffer in self._buffers():
            if buffer.param_data is not None:
                (buffer.offload_to_cpu if to_cpu else buffer.reload_from_cpu)(
                    move_params=True, move_grads=False
                )
        for param in self._loose_params():
            param.data = param.data.to(device, non_blocking=True)

    def _move_optimizer(self, device: torch.device | str) -> None:
        model_params = {id(p) for m in self.model for p in m.parameters()}
        for inner in _inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                for param in group["params"]:
                    if id(param) not in model_params:  # fp32 main params (model params move above)
                        param.data = param.data.to(device, non_blocking=True)
                    for key, value in inner.state.get(param, {}).items():
                        if torch.is_tensor(value) and value.dim() > 0:
                            inner.state[param][key] = value.to(device, non_blocking=True)

    def offload(self, params: bool, grads: bool, optimizer: bool) -> None:
        """Free the chosen state's CUDA memory (no-op without CUDA)."""
        if self._device is None:
            return
        torch.cuda.synchronize()
        if params and "params" not in self.offloaded:
            self._move_params("cpu", to_cpu=True)
            self.offloaded.add("params")
        if grads and "grads" not in self.offloaded:
            for buffer in self._buffers():
                buffer.offload_to_cpu(move_params=False, move_grads=True)
            self.offloaded.add("grads")
        if optimizer and "optimizer" not in self.offloaded:
            self._move_optimizer("cpu")
            self.offloaded.add("optimizer")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring back whatever ``offload`` moved (grads come back zeroed)."""
        if "params" in self.offloaded:
            self._move_params(self._device, to_cpu=False)
        if "grads" in self.offloaded:
            for buffer in self._buffers():
                buffer.reload_from_cpu(move_params=False, move_grads=True)
        if "optimizer" in self.offloaded:
            self._move_optimizer(self._device)
        if self.offloaded:
            torch.cuda.synchronize()
        self.offloaded.clear()

    def ensure_loaded(self) -> None:
        if self.offloaded:
            self.reload()
