"""The launcher runs the driver on one torch intra-op thread (``rlvr.DRIVER_TORCH_THREADS``)."""

from __future__ import annotations

from types import SimpleNamespace

from roll.launch import rlvr


def test_the_driver_runs_on_one_torch_thread(monkeypatch):
    """The driver's stages work on a step's rollouts; a host-wide intra-op pool only adds wake-ups."""
    import torch

    from roll.pipeline.rlvr import pipeline

    seen = []
    monkeypatch.setattr(pipeline, "run_pipeline", lambda config: seen.append(torch.get_num_threads()))
    monkeypatch.setattr(rlvr, "shutdown_ray", lambda grace_s: True)
    before = torch.get_num_threads()
    try:
        assert rlvr.run(SimpleNamespace()) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [rlvr.DRIVER_TORCH_THREADS] == [1]
