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


def test_optimizer_views_into_params_stay_with_the_params():
    """fp32 params + distributed optimizer: the optimizer's "main params" are views into the model's
    param storage. Offloading the optimizer alone must leave the parameters readable (it used to
    free their storage, and the weight export after the offload read freed memory)."""
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4, bias=False)
    shard = module.weight.detach().view(-1)[:16]  # what DistributedOptimizer keeps for fp32 params
    optimizer = torch.optim.AdamW([torch.nn.Parameter(shard)], lr=0.1)
    optimizer.param_groups[0]["params"][0].grad = torch.ones(16)
    optimizer.step()
    offloader = StateOffloader([FakeDDP(module)], SimpleNamespace(optimizer=optimizer))
    weight = module.weight.detach().clone()
    offloader.offload(params=False, grads=True, optimizer=True)
    assert module.weight.untyped_storage().nbytes() == weight.numel() * 4
    assert torch.equal(module.weight, weight)
    assert all(m.untyped_storage().nbytes() == 0 for m in moments(optimizer))  # Adam moments left
    offloader.ensure_params_loaded()
    assert offloader.offloaded == {"optimizer", "grads"}
    offloader.reload()
    assert offloader.offloaded == set() and torch.equal(module.weight, weight)


def test_ensure_params_loaded_brings_back_params_only():
    offloader, module, optimizer = stepped_offloader()
    params = [p.detach().clone() for p in module.parameters()]
    offloader.offload(params=True, grads=True, optimizer=True)
    offloader.ensure_params_loaded()
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), params))
    assert all(m.untyped_storage().nbytes() == 0 for m in moments(optimizer))
    assert offloader.offloaded == {"optimizer", "grads"}
