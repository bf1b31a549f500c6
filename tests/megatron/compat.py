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

Without TransformerEngine (CPU or GPU):
4. ``moe_utils.te_general_gemm = None``: 0.16.1's router references the name without defining
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

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    fused_softmax.get_default_causal_mask = _cpu_causal_mask


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
