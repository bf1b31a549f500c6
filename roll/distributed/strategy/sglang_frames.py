"""SGLang 0.5.16's Qwen2.5-VL vision tower, made to attend within each temporal patch of a video.

Qwen's reference, transformers, vLLM and roll's trainers run the tower's full-attention blocks over
one temporal patch at a time (``h * w`` patches, ``t`` times per video). SGLang 0.5.16 builds those
blocks' ``cu_seqlens`` from ``t * h * w`` per video (``Qwen2_5_VisionTransformer.forward`` in
``sglang/srt/models/qwen2_5_vl.py``), so a video's temporal patches attend to each other there and
its rollouts are sampled from other features than the trainers score. Giving the tower each video's
grid split into ``t`` rows of ``[1, h, w]`` makes SGLang's own rule produce the reference's
sequences; the rotary positions and the attention windows are per temporal patch already, so they
do not change. Images (``t == 1``) pass unchanged.

The tower runs in SGLang's scheduler processes, which the engine spawns; the engine class for a
Qwen2.5-VL model starts them through ``run_scheduler_within_frames``, which splits the grids there
before SGLang's scheduler loads the model::

    engine_class = sglang_engine_class(sglang, "qwen2_5_vl")   # sglang.Engine for any other model
    engine = engine_class(model_path=..., tp_size=...)
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

# config.json model types whose SGLang 0.5.16 tower attends across a video's temporal patches
# (SGLang's Qwen3-VL towers split per temporal patch, as the reference does).
TOWER_ACROSS_FRAMES = ("qwen2_5_vl",)
# Where SGLang's Engine class lives (``sglang.Engine`` is a lazy import of it).
ENGINE_MODULE = "sglang.srt.entrypoints.engine"


def per_frame_grid(grid_thw: torch.Tensor) -> torch.Tensor:
    """Each ``[t, h, w]`` row as ``t`` rows of ``[1, h, w]``, in order (the tensor as it is when
    every row is one temporal patch)."""
    grid = torch.as_tensor(grid_thw)
    if bool((grid[:, 0] == 1).all()):
        return grid_thw
    frames = grid[:, 1:].repeat_interleave(grid[:, 0], dim=0)
    return torch.cat([torch.ones_like(frames[:, :1]), frames], dim=1)


def attend_within_frames(tower: type) -> None:
    """Make ``tower.forward(x, grid_thw)`` see each video's grid split per temporal patch (a split
    grid splits no further, so patching twice changes nothing)."""
    own = tower.forward

    @functools.wraps(own)
    def forward(self: Any, x: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        return own(self, x, per_frame_grid(grid_thw), **kwargs)

    tower.forward = forward


def run_scheduler_within_frames(*args: Any, **kwargs: Any) -> Any:
    """SGLang's ``run_scheduler_process`` (the target of each scheduler process), with the
    Qwen2.5-VL tower splitting video grids per temporal patch in that process."""
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.models.qwen2_5_vl import Qwen2_5_VisionTransformer

    attend_within_frames(Qwen2_5_VisionTransformer)
    return run_scheduler_process(*args, **kwargs)


def sglang_engine_class(sglang: ModuleType, model_type: str | None) -> Callable[..., Any]:
    """``sglang.Engine`` as it is, or for a model whose tower attends across frames a subclass of
    SGLang's Engine class whose scheduler processes split video grids first
    (``Engine.run_scheduler_process_func``, SGLang's hook for its subprocess targets; a module-level
    function, as spawned processes need)."""
    engine = sglang.Engine
    if model_type not in TOWER_ACROSS_FRAMES:
        return engine
    if not isinstance(engine, type):  # sglang/__init__.py exports a lazy import, which cannot be a base
        engine = importlib.import_module(ENGINE_MODULE).Engine
    return type(
        "WithinFramesEngine",
        (engine,),
        {"run_scheduler_process_func": staticmethod(run_scheduler_within_frames)},
    )
