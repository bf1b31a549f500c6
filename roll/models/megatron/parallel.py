"""megatron-core parallel state for one role: set up from a WorkerContext + MegatronConfig, torn down.

The worker has already started torch.distributed for the role (world size = the role's devices).
``init_parallel`` splits those ranks into megatron's TP / CP / EP / DP / PP groups (order
"tp-cp-ep-dp-pp": TP ranks are adjacent, PP stages are farthest apart) and seeds the model-parallel
RNGs. Data flows per data-parallel group: every rank of a DP group (its TP, CP and PP peers) gets
the same micro-batches from the cluster, and ONE rank per DP group returns results:

    dp_rank, dp_size, is_output_rank = dp_layout()

``is_output_rank`` is true on TP rank 0, CP rank 0 of the LAST pipeline stage (where the logits
live). Strategies still return the same outputs on every rank (``broadcast_from_last_stage``
copies them from the last stage), so callers may read any rank; the cluster reads the output rank.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from roll.configs.strategy_configs import MegatronConfig
from roll.core.worker_context import WorkerContext
from roll.utils.ports import free_port


def _ensure_process_group(ctx: WorkerContext) -> None:
    """Start a one-process group when run outside a worker (world size 1); else check the worker's."""
    if dist.is_initialized():
        if dist.get_world_size() != ctx.world_size:
            raise RuntimeError(
                f"torch.distributed has {dist.get_world_size()} ranks but the role has {ctx.world_size}"
            )
        return
    if ctx.world_size != 1:
        raise RuntimeError(f"torch.distributed is not initialised for a role of {ctx.world_size} ranks")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    backend = "nccl" if ctx.is_cuda else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, device_id=ctx.device if ctx.is_cuda else None)


def init_parallel(ctx: WorkerContext, cfg: MegatronConfig) -> None:
    """Create megatron's parallel groups for this role and seed the RNGs (idempotent per layout)."""
    from megatron.core import parallel_state as ps

    cfg.validate(ctx.world_size, "strategy_args.strategy_config")
    if ctx.is_cuda:
        torch.cuda.set_device(ctx.device)
    _ensure_process_group(ctx)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    vpp = cfg.virtual_pipeline_model_parallel_size
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
    )
    seed_model_parallel(ctx.seed, ctx.is_cuda)


def seed_model_parallel(seed: int, cuda: bool) -> None:
    """Same seed across a DP group's data path; megatron's TP/EP RNG trackers on CUDA."""
    torch.manual_seed(seed)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Drop megatron's groups (the worker's default process group stays)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def dp_layout() -> tuple[int, int, bool]:
    """(dp_rank, dp_size, is_output_rank) of this rank; see the module docstring."""
    from megatron.core import parallel_state as ps

    is_output = (
        ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
        and ps.is_pipeline_last_stage(ignore_virtual=True)
    )
    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), is_output


def broadcast_from_last_stage(tensors: dict[str, torch.Tensor] | None, like: dict[str, tuple]) -> dict:
    """Copy ``tensors`` (present on the last pipeline stage) to every stage of this PP group.

    ``like`` maps each name to (shape, dtype), known on every rank, so the others can allocate.
    """
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return tensors
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    src = ps.get_pipeline_model_parallel_last_rank()
    group = ps.get_pipeline_model_parallel_group()
    out = {}
    for name, (shape, dtype) in like.items():
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            buf = tensors[name].to(device=device, dtype=dtype).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        out[name] = buf
    return out
