"""megatron-core parallel state for one role, set up from a WorkerContext + MegatronConfig.

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

import torch
import torch.distributed as dist

from roll.configs.strategy_configs import MegatronConfig
from roll.core.worker_context import WorkerContext
from roll.utils.process_group import init_default_group


def init_parallel(ctx: WorkerContext, cfg: MegatronConfig) -> None:
    """Create megatron's parallel groups for this role and seed the RNGs (idempotent per layout)."""
    from megatron.core import parallel_state as ps

    cfg.validate(ctx.world_size, "strategy_args.strategy_config")
    if ctx.is_cuda:
        torch.cuda.set_device(ctx.device)
    # Outside a worker (tests, scripts) a single rank makes its own group; a worker's is checked.
    init_default_group(ctx.rank, ctx.world_size, ctx.device, who=ctx.role)
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
