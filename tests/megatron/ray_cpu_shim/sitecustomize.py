"""TEST-ONLY: run the Megatron strategies inside Ray workers on CPU (gloo) through the shims.

Put this directory on ``PYTHONPATH`` and set ``ROLL_TEST_MEGATRON_CPU=1``; every Python process
started with that environment inherits the file, but only Ray's worker processes (the actors a
local Ray starts; ``default_worker.py``) apply ``compat.apply()`` and enter ``cuda_on_cpu()`` for
their whole life: Ray's own helper processes (agents, monitors) must start fast, and the driver runs
no Megatron code. Without the variable, or where CUDA exists, it does nothing. Never used by
``roll/``.

``cuda_on_cpu()`` pushes a ``TorchFunctionMode``, which torch keeps per thread; Ray runs a
synchronous actor's methods on the process's main thread (the thread importing this file), so one
entry here covers them. Threads the worker starts itself (the model-update receiver's per-link
threads) do not inherit the mode: they only move and copy tensors, which needs no shim.
"""

from __future__ import annotations

import os
import sys


def _install() -> None:
    if os.environ.get("ROLL_TEST_MEGATRON_CPU") != "1":
        return
    if not sys.argv or not sys.argv[0].endswith("default_worker.py"):
        return
    import torch

    if torch.cuda.is_available():
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import compat
    from cuda_on_cpu import cuda_on_cpu

    compat.apply()
    _seed_after_parallel_init(compat)
    context = cuda_on_cpu()
    context.__enter__()
    sys.modules[__name__]._ROLL_CPU_CONTEXT = context  # kept open for the process's life


def _seed_after_parallel_init(compat) -> None:
    """Install the CPU RNG tracker whenever megatron's parallel state is (re)built: roll's
    ``init_parallel`` seeds megatron's CUDA tracker only on CUDA, and forks of an unseeded tracker
    fail (``cuda rng state model-parallel-rng is not added``). ``init_parallel`` reseeds torch's
    generator right after, so the seed given here does not matter."""
    from megatron.core import parallel_state

    original = parallel_state.initialize_model_parallel

    def initialize_model_parallel(*args, **kwargs):
        out = original(*args, **kwargs)
        compat.seed(0)
        return out

    parallel_state.initialize_model_parallel = initialize_model_parallel


_install()
