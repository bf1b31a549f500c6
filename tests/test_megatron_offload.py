"""StateOffloader (roll/models/megatron/offload.py): what leaves the device comes back unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from roll.models.megatron.offload import StateOffloader


class FakeDDP:
    """What the offloader reads from a megatron DDP chunk: parameters and (here no) grad buffers."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.buffers: list = []
        self.expert_parallel_buffers: list = []

    def parameters(self):
        return self.module.parameters()


def stepped_offloader() -> tuple[StateOffloader, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(3, 8)).sum().backward()
    optimizer.step()  # Adam state now exists
    return StateOffloader([FakeDDP(module)], SimpleNamespace(optimizer=optimizer)), module, optimizer


def moments(optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]


def test_offload_frees_and_reload_restores_exactly():
    offloader, module, optimizer = stepped_offloader()
    params = [p.detach().clone() for p in module.parameters()]
    states = [m.clone() for m in moments(optimizer)]
    offloader.offload(params=True, grads=True, optimizer=True)
    assert all(p.untyped_storage().nbytes() == 0 for p in module.parameters())
    assert all(m.untyped_storage().nbytes() == 0 for m in moments(optimizer))
    offloader.reload()
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), params))
    assert all(torch.equal(a, b) for a, b in zip(moments(optimizer), states))
    assert offloader.offloaded == set()
