"""fsdp2_train's expert-parallel layout (``ep_size`` N > 1): the meshes, the FSDP2 sharding of the
expert slices, gradient clipping over both meshes, the weight export's gather and the checkpoint view.

Layout over W ranks: a (efsdp = W / N, ep = N) mesh, so ranks ``e * N .. e * N + N - 1`` form EP
group ``e`` (they split the experts; tokens go around the group by all-to-all) and ranks
``p, p + N, ...`` hold the same expert slice, FSDP-sharded among them. The dense parameters keep the
1-D mesh of all W ranks (the strategy's ``_build_mesh``).

>>> layout = ExpertLayout(model, config.ep_size, world, device_type, role)   # checks, slices the experts
>>> layout.shard(fully_shard_kwargs)                 # each experts module over its efsdp ranks
>>> norm = layout.scale_and_clip(params, max_norm)     # the unsplit step's gradients; each element counted once
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from roll.configs.errors import ConfigError
from roll.models.expert_parallel import check_experts, gather_experts, moe_experts, shard_experts


class ExpertLayout:
    """The expert slices of one rank and the groups they live on (see the module docstring)."""

    def __init__(self, model: nn.Module, ep_size: int, world_size: int, device_type: str, role: str) -> None:
        path = f"{role}.strategy_args.strategy_config.ep_size"
        self.experts = moe_experts(model)
        counts = {module.num_experts for module in self.experts}
        for count in sorted(counts) or [None]:  # None: no experts modules, a dense model
            check_experts(count, ep_size, path)
        if len(counts) > 1:
            raise ConfigError(
                path, f"{ep_size} needs one number of experts per MoE layer, not {sorted(counts)}"
            )
        if world_size % ep_size:
            raise ConfigError(path, f"{ep_size} does not divide the role's {world_size} ranks")
        self.ep_size, self.num_experts = ep_size, counts.pop()
        self.mesh = init_device_mesh(
            device_type, (world_size // ep_size, ep_size), mesh_dim_names=("efsdp", "ep")
        )
        self.ep_group = self.mesh.get_group("ep")
        self.ep_rank = self.mesh.get_local_rank("ep")
        # The same ranks with the EP axis first: the expert tensors as DCP sees them, [E, ...] split
        # over EP ranks and then over efsdp ranks (no process groups of its own: metadata only).
        self.checkpoint_mesh = DeviceMesh(
            device_type, self.mesh.mesh.t().contiguous(), mesh_dim_names=("ep", "efsdp"), _init_backend=False
        )
        shard_experts(self.experts, self.ep_rank, ep_size, self.ep_group)
        # id of a checkpoint view -> the expert DTensor it shows (checkpoint_view to from_checkpoint_view).
        self._viewed: dict[int, DTensor] = {}

    def shard(self, kwargs: dict) -> None:
        """Each experts module FSDP-sharded over its efsdp ranks before the decoder layers (which
        then leave its weights alone)."""
        for module in self.experts:
            fully_shard(module, **(kwargs | {"mesh": self.mesh["efsdp"]}))

    def is_expert(self, tensor: torch.Tensor) -> bool:
        return isinstance(tensor, DTensor) and tensor.device_mesh == self.mesh["efsdp"]

    def full_tensor(self, tensor: DTensor) -> torch.Tensor:
        """The [E, ...] tensor of an expert weight: its slice gathered over efsdp, then over EP."""
        return gather_experts(tensor.full_tensor().detach(), self.ep_group)

    def local_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This EP rank's slice of a full [E, ...] expert tensor."""
        local = self.num_experts // self.ep_size
        return full[self.ep_rank * local : (self.ep_rank + 1) * local]

    def scale_and_clip(self, params: list[nn.Parameter], max_norm: float) -> float:
        """The expert gradients made the unsplit model's, then clip_grad_norm_ over dense and expert
        gradients: every element of either lives on exactly one rank (full sharding), so the global
        norm is the sum of the local squares over all ranks.

        A slice's gradient on its rank is the sum over its EP group's tokens, and FSDP2 averages it
        over the W / N efsdp ranks: (N / W) x the sum over all ranks, N times the dense parameters'
        mean over W ranks, hence the division by N here (FSDP2's set_gradient_divide_factor would
        do it in the reduce-scatter, but its PREMUL_SUM does not exist in gloo)."""
        for module in self.experts:
            for weight in module.parameters():
                if weight.grad is not None:
                    weight.grad.to_local().div_(self.ep_size)
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        dist.all_reduce(squares)
        norm = float(squares.sqrt())
        coef = min(max_norm / (norm + 1e-6), 1.0)
        if coef < 1.0 or not math.isfinite(norm):
            for grad in grads:
                grad.mul_(coef)
        return norm

    def checkpoint_views(self, model_sd: dict, optim_sd: dict) -> dict:
        """``{"model", "optim"}`` for DCP: ``checkpoint_view`` of both state dicts."""
        self._viewed.clear()
        return {"model": self.checkpoint_view(model_sd), "optim": self.checkpoint_view(optim_sd)}

    def checkpoint_view(self, state: dict) -> dict:
        """A copy of ``state`` (model and optimizer state dicts from ``get_state_dict``, nested)
        with each expert DTensor shown as the [E, ...] tensor it is a piece of. The views share
        storage, so DCP saves each expert once under its name and loads into them in place;
        ``from_checkpoint_view`` turns the loaded copy back into what ``set_state_dict`` takes."""
        out = {}
        for name, value in state.items():
            if isinstance(value, dict):
                out[name] = self.checkpoint_view(value)
            elif self.is_expert(value):
                out[name] = self._global_view(value)
                self._viewed[id(out[name])] = value
            else:
                out[name] = value
        return out

    def from_checkpoint_view(self, state: dict) -> dict:
        """``state`` (a loaded ``checkpoint_view``) with the views replaced by the expert DTensors."""
        out = {}
        for name, value in state.items():
            if isinstance(value, dict):
                out[name] = self.from_checkpoint_view(value)
            else:
                out[name] = self._viewed.get(id(value), value)
        return out

    def _global_view(self, tensor: DTensor) -> DTensor:
        shape = (self.num_experts, *tensor.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            tensor.to_local(),
            self.checkpoint_mesh,
            (Shard(0), Shard(0)),
            run_check=False,
            shape=shape,
            stride=stride,
        )
