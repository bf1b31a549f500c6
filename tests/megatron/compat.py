"""TEST-ONLY: let megatron-core 0.16.1's local (no TransformerEngine) path run a forward on CPU + gloo.

Never imported by ``roll/``. Each patch is applied only where it is needed, so the same tests run
unchanged on a GPU machine (where ``apply()`` changes nothing CUDA-related):

Without CUDA:
1. ``torch.cuda.current_device()`` returns the CPU device and ``Tensor.cuda()`` returns the tensor
   itself: megatron-core allocates forward buffers (rotary frequencies, TP gather outputs, router
   buffers) on ``torch.cuda.current_device()`` and moves the tied output weight of the last
   pipeline stage with ``.cuda()`` before its initial all-reduce.
2. ``get_default_causal_mask`` (used by the unfused softmax when no mask is given) builds its mask
   on CPU instead of ``device="cuda"``.
3. The model-parallel RNG tracker is a CPU stand-in whose ``fork()`` keeps torch's CPU generator:
   megatron's tracker saves/restores CUDA RNG states. Forks still happen (attention dropout,
   expert init), so dropout must be 0 where results are compared (our tiny models use 0).
4. The MoE all-to-all dispatcher's ``maybe_move_tensor_to_cpu`` only converts CUDA tensors (to
   numpy split sizes for ``all_to_all_single``); on CPU the splits stayed tensors, which
   ``all_to_all_single`` rejects. The stand-in converts CPU tensors the same way.
5. Gathers and reduce-scatters with uneven splits (the all-to-all dispatcher under expert-TP > 1)
   call ``all_gather``/``reduce_scatter`` on lists of differently sized tensors, which gloo
   rejects; the stand-ins pad to the largest split (gather) or all-reduce and slice (scatter).
6. Full recompute (``tensor_parallel.checkpoint``) saves and restores the CUDA RNG state around
   each recomputed chunk; on CPU the stand-ins save/restore nothing (the CPU generator is
   saved by megatron itself).

Without TransformerEngine (CPU or GPU):
7. ``moe_utils.te_general_gemm = None``: 0.16.1's router references the name without defining
   it when TE is missing (fixed upstream later), so any MoE forward on the local spec fails.

>>> compat.apply(); compat.seed(1234)      # after parallel_state.initialize_model_parallel
"""

from __future__ import annotations

import contextlib

import torch

_APPLIED = False


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply() -> None:
    """Install the patches this machine needs (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE:
        moe_utils.te_general_gemm = None
    if torch.cuda.is_available():
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.moe import token_dispatcher

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    token_dispatcher.maybe_move_tensor_to_cpu = _splits_on_cpu
    _patch_uneven_collectives()
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *args, **kwargs: None


def _patch_uneven_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    even_gather, even_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return even_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((group.size() * max(sizes), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded.contiguous(), group=group)
        parts = out.split(max(sizes))
        return torch.cat([part[:n] for part, n in zip(parts, sizes)])

    def scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return even_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone()
        torch.distributed.all_reduce(total, group=group)
        return total.split([int(n) for n in input_split_sizes])[group.rank()].contiguous()

    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = scatter


def _splits_on_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def seed(value: int) -> None:
    """megatron's model-parallel seeding: the real one on CUDA, the CPU stand-in tracker otherwise."""
    from megatron.core.tensor_parallel import random as mp_random

    if torch.cuda.is_available():
        mp_random.model_parallel_cuda_manual_seed(value)
        return
    torch.manual_seed(value)
    tracker = _CpuRNGTracker()
    for name in (
        mp_random.get_data_parallel_rng_tracker_name(),
        mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME,
        mp_random.get_expert_parallel_rng_tracker_name(),
    ):
        tracker.add(name, value)
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _tracker_base() -> type:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


class _CpuRNGTracker(_tracker_base()):
    """megatron's RNG tracker interface without CUDA generators (forks use the CPU generator)."""

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        self.states_[name] = seed

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        yield
