"""metrics.jsonl under faults: strict JSON for non-finite values, a torn last line on resume,
a full disk (no partial line, one StorageError line)."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
import yaml

from roll.configs.loader import load_config
from roll.core.errors import StorageError
from roll.utils import atomic_io
from roll.utils.tracking import Tracker, read_metrics

GOOD = Path(__file__).parent / "configs" / "good" / "minimal.yaml"


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(yaml.safe_load(GOOD.read_text()) | {"track_with": "none"}))
    return load_config(path)


def test_non_finite_values_are_written_as_null(tmp_path, cfg):
    tracker = Tracker(cfg, tmp_path)
    tracker.log({"a": float("inf"), "b": float("nan"), "c": -float("inf"), "d": 1.5}, step=1)
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "Infinity" not in text and "NaN" not in text
    json.loads(text, parse_constant=lambda token: pytest.fail(f"non-strict JSON token {token}"))
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "a": None, "b": None, "c": None, "d": 1.5}
    ]
    tracker.finish()  # the curves skip nulls


def test_torn_last_line_is_dropped_on_resume(tmp_path, cfg, caplog):
    tracker = Tracker(cfg, tmp_path)
    for step in (1, 2):
        tracker.log({"x": float(step)}, step=step)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "x": 0.12')  # the driver died in the middle of a write
    caplog.set_level(logging.WARNING, logger="roll")
    Tracker(cfg, tmp_path, resume_step=2)
    assert "metrics.jsonl:3: dropping a cut-off last line" in caplog.text
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}]


def test_a_bad_line_in_the_middle_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, garbage\n{"step": 3}\n')
    with pytest.raises(StorageError, match=rf"^{path}:2: "):
        read_metrics(path)


def test_disk_full_while_logging_is_one_line_and_leaves_no_partial_line(tmp_path, cfg, monkeypatch):
    tracker = Tracker(cfg, tmp_path)
    tracker.log({"x": 1.0}, step=1)
    real_fsync = os.fsync

    def full(fd):  # the write went to the page cache; the flush to disk fails
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic_io.os, "fsync", full)
    with pytest.raises(StorageError) as err:
        tracker.log({"x": 2.0}, step=2)
    monkeypatch.setattr(atomic_io.os, "fsync", real_fsync)
    path = tmp_path / "metrics.jsonl"
    assert str(err.value) == f"{path}: No space left on device ({path})"
    assert path.read_text() == '{"step": 1, "x": 1.0}\n'
