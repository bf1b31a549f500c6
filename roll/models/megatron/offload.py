"""Offload and reload of a megatron training rank's device state (params, grads, optimizer state).

Colocated layouts run actor_train and actor_infer on the same GPUs: between training steps the
trainer moves its state to CPU so the inference engine gets the memory back.

>>> offloader = StateOffloader(ddp_chunks, optimizer)
>>> offloader.offload(params=True, grads=True, optimizer=True)   # device memory freed
>>> offloader.reload()                                            # everything back, same tensors

Every tensor keeps its identity and device: its *storage* is copied to (pinned) host memory and
shrunk to 0 bytes, and on reload grown back and refilled. Nothing is re-pointed with
``param.data = ...`` -- moving a parameter's data to another device makes autograd drop its
gradient accumulator, which silently disconnects megatron DDP's gradient hooks (the next step
then has all-zero gradients). Views (``param.main_grad`` into DDP's grad buffer, params into the
distributed optimizer's param buffer) stay valid because the storage object itself survives.
Gradients are not copied: they come back as zeros (the next step starts from zero anyway).
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


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's whole storage as a flat uint8 tensor (shared storages are handled once)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


class StateOffloader:
    """Frees and restores a DDP-wrapped model's and its megatron optimizer's device memory."""

    def __init__(self, model: list[torch.nn.Module], optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        # what -> {storage data_ptr: (storage, host copy or None, nbytes)}
        self._saved: dict[str, dict[int, tuple[Any, torch.Tensor | None, int]]] = {}

    @property
    def offloaded(self) -> set[str]:
        return set(self._saved)

    # ------------------------------------------------------------------------- what is where
    def _ddp_buffers(self) -> list[Any]:
        return [b for m in self.model for b in list(m.buffers) + list(m.expert_parallel_buffers)]

    def _param_tensors(self) -> list[torch.Tensor]:
        buffered = [b.param_data for b in self._ddp_buffers() if b.param_data is not None]
        if buffered:  # distributed optimizer: params are views into these buffers
            return buffered + [p for m in self.model for p in m.parameters() if not p.requires_grad]
        return [p for m in self.model for p in m.parameters()]

    def _grad_tensors(self) -> list[torch.Tensor]:
        return [b.grad_data for b in self._ddp_buffers() if b.grad_data is not None]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """Main params and optimizer state that own their memory. With fp32 model params the
        distributed optimizer's "main params" are views into the model's param buffer: those move
        with the parameters, never as optimizer state."""
        model_params = {id(p) for m in self.model for p in m.parameters()}
        param_storages = {t.untyped_storage().data_ptr() for t in self._param_tensors()}
        tensors = []
        for inner in _inner_optimizers(self.optimizer):
            for group in inner.param_groups:
                for param in group["params"]:
                    if id(param) not in model_params:  # fp32 main params
                        tensors.append(param)
                    state = inner.state.get(param, {})
                    tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        return [t for t in tensors if t.untyped_storage().data_ptr() not in param_storages]

    # ------------------------------------------------------------------------------ moving
    def _free(self, what: str, tensors: list[torch.Tensor], keep: bool) -> None:
        saved = self._saved.setdefault(what, {})
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in saved or storage.nbytes() == 0:
                continue
            host = None
            if keep:
                pin = tensor.device.type == "cuda"
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_storage_bytes(tensor), non_blocking=pin)
            saved[storage.data_ptr()] = (storage, host, storage.nbytes())
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # host copies done before the storage goes
        for storage, _, _ in saved.values():
            storage.resize_(0)

    def _restore(self, what: str) -> None:
        for storage, host, nbytes in self._saved.pop(what, {}).values():
            storage.resize_(nbytes)
            flat = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            if host is None:
                flat.zero_()
            else:
                flat.copy_(host, non_blocking=True)

    def offload(self, params: bool, grads: bool, optimizer: bool) -> None:
        """Free the chosen state's device memory (a copy of params / optimizer state goes to host)."""
        if optimizer and "optimizer" not in self._saved:
            self._free("optimizer", self._optimizer_tensors(), keep=True)
        if grads and "grads" not in self._saved:
            self._free("grads", self._grad_tensors(), keep=False)
        if params and "params" not in self._saved:
            self._free("params", self._param_tensors(), keep=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring back whatever ``offload`` freed (grads come back zeroed)."""
        for what in ("params", "grads", "optimizer"):
            self._restore(what)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def ensure_loaded(self) -> None:
        if self._saved:
            self.reload()

    def ensure_params_loaded(self) -> None:
        """Bring back the parameters only (forward passes and weight export need nothing else);
        offloaded gradients and optimizer state stay on the host until ``reload``."""
        if "params" in self._saved:
            self._restore("params")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
