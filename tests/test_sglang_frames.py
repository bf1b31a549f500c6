"""``sglang_frames`` without SGLang: the per-temporal-patch grid, the tower patch (once however often
applied) and the engine class that starts SGLang's schedulers through it for Qwen2.5-VL only. That
the split grid gives the reference tower is checked on transformers' tower in
tests/test_sglang_vision_tower.py, and on SGLang in tests/test_sglang_vl_gpu.py."""

from __future__ import annotations

import pickle
import sys
from types import SimpleNamespace

import torch

from roll.distributed.strategy import sglang_frames
from roll.distributed.strategy.sglang_frames import (
    attend_within_frames,
    per_frame_grid,
    run_scheduler_within_frames,
    sglang_engine_class,
)


def test_per_frame_grid_splits_videos_and_keeps_images():
    grid = torch.tensor([[3, 4, 6], [1, 2, 2], [2, 8, 4]])
    want = [[1, 4, 6]] * 3 + [[1, 2, 2]] + [[1, 8, 4]] * 2
    assert per_frame_grid(grid).tolist() == want
    images = torch.tensor([[1, 4, 6], [1, 2, 2]])
    assert per_frame_grid(images) is images


class Tower:
    def forward(self, x, grid_thw, **kwargs):
        return grid_thw.tolist(), kwargs


def test_attend_within_frames_splits_the_grid_once_and_passes_the_rest_on():
    attend_within_frames(Tower)
    attend_within_frames(Tower)  # a second scheduler start in one process: still one split
    grids, kwargs = Tower().forward(torch.zeros(1), grid_thw=torch.tensor([[2, 4, 4]]), flag=1)
    assert grids == [[1, 4, 4], [1, 4, 4]] and kwargs == {"flag": 1}
    assert Tower.forward.__name__ == "forward"


class Engine:
    run_scheduler_process_func = staticmethod(print)


class LazyEngine:
    """As ``sglang/__init__.py`` exports Engine: a callable that is not the class."""

    def __call__(self, **kwargs):
        return Engine()


def test_only_qwen2_5_vl_engines_start_their_schedulers_through_the_split(monkeypatch):
    sglang = SimpleNamespace(Engine=Engine)
    for model_type in (None, "qwen3_vl", "qwen3_vl_moe"):
        assert sglang_engine_class(sglang, model_type) is Engine
    within = sglang_engine_class(sglang, "qwen2_5_vl")
    assert issubclass(within, Engine) and within.run_scheduler_process_func is run_scheduler_within_frames
    # SGLang spawns its schedulers: the target travels by name
    assert pickle.loads(pickle.dumps(within.run_scheduler_process_func)) is run_scheduler_within_frames


def test_a_lazy_engine_export_is_subclassed_through_its_module(monkeypatch):
    lazy = SimpleNamespace(Engine=LazyEngine())
    assert sglang_engine_class(lazy, None) is lazy.Engine  # a text model: sglang.Engine as it is
    monkeypatch.setattr(sglang_frames, "ENGINE_MODULE", "fake_sglang_engine")
    monkeypatch.setitem(sys.modules, "fake_sglang_engine", SimpleNamespace(Engine=Engine))
    assert issubclass(sglang_engine_class(lazy, "qwen2_5_vl"), Engine)
