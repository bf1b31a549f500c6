"""Tracker: metrics.jsonl always, TensorBoard events, W&B through its public calls, curves.png,
and truncation on resume."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import yaml

from roll.configs.loader import load_config
from roll.utils.tracking import Tracker, read_metrics

GOOD = Path(__file__).parent / "configs" / "good" / "minimal.yaml"


def config(tmp_path: Path, **overrides):
    data = yaml.safe_load(GOOD.read_text()) | overrides
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def test_jsonl_tensorboard_and_png(tmp_path):
    tracker = Tracker(config(tmp_path, track_with="tensorboard"), tmp_path / "run")
    tracker.log({"critic/score/mean": 0.25, "val/score/mean": 0.5, "note": "skipped"}, step=0)
    tracker.log({"critic/score/mean": 0.75}, step=1)
    png = tracker.finish()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows == [
        {"step": 0, "critic/score/mean": 0.25, "val/score/mean": 0.5},
        {"step": 1, "critic/score/mean": 0.75},
    ]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert png is not None and png.stat().st_size > 0


def test_wandb_gets_init_log_finish(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, metrics, step):
            calls.append(("log", metrics, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = config(
        tmp_path, track_with="wandb", tracker_kwargs={"project": "p", "mode": "offline"}, exp_name="e"
    )
    tracker = Tracker(cfg, tmp_path / "run")
    tracker.log({"actor/pg_loss": 1.5}, step=3)
    tracker.finish()
    assert calls[0] == ("init", {"config": {"exp_name": "e"}, "project": "p", "name": "e", "mode": "offline"})
    assert calls[1] == ("log", {"actor/pg_loss": 1.5}, 3)
    assert calls[-1] == ("finish",)


def test_resume_truncates_later_steps(tmp_path):
    cfg = config(tmp_path, track_with="none")
    tracker = Tracker(cfg, tmp_path / "run")
    for step in range(4):
        tracker.log({"x": step}, step=step)
    Tracker(cfg, tmp_path / "run", resume_step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]
