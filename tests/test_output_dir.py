"""output_dir ownership: one run at a time (lock file, stale locks taken over) and no silent
overwrite of an earlier run unless resuming or ``overwrite_output_dir``."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from roll.configs.errors import ConfigError
from roll.configs.loader import load_config
from roll.core.errors import StorageError
from roll.pipeline.common.output_dir import LOCK_FILE, OutputDirLock, claim_output_dir

GOOD = Path(__file__).parent / "configs" / "good" / "minimal.yaml"


def config(out: Path, resume=False, overwrite=False) -> SimpleNamespace:
    return SimpleNamespace(
        output_dir=str(out),
        checkpoint_config=SimpleNamespace(output_dir=None),
        resume_from_checkpoint=resume,
        overwrite_output_dir=overwrite,
    )


def test_second_run_on_the_same_output_dir_is_refused(tmp_path):
    first = claim_output_dir(config(tmp_path))
    try:
        with pytest.raises(ConfigError, match=rf"^output_dir: {tmp_path} is in use by pid {os.getpid()} on "):
            claim_output_dir(config(tmp_path))
    finally:
        first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    claim_output_dir(config(tmp_path)).release()  # free again once the first run is done


def test_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(
        json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "x"})
    )
    caplog.set_level(logging.WARNING, logger="roll")
    lock = OutputDirLock(tmp_path)
    lock.acquire()
    assert f"stale lock of pid {dead.pid}" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_lock_of_a_live_process_is_respected_without_flock(tmp_path):
    # A filesystem where flock does not reach between processes: the pid in the file still counts.
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "started": "x"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    with pytest.raises(ConfigError, match=rf"in use by pid {os.getppid()}"):
        OutputDirLock(tmp_path).acquire()


@pytest.mark.parametrize("left", ["metrics.jsonl", "hf_model", "checkpoints/step_3"])
def test_fresh_run_over_an_existing_run_refuses(tmp_path, left):
    target = tmp_path / left
    target.parent.mkdir(parents=True, exist_ok=True)
    target.mkdir() if "." not in left else target.write_text("{}\n")
    with pytest.raises(ConfigError, match=rf"^output_dir: {tmp_path} already holds a run \({target}\)"):
        claim_output_dir(config(tmp_path))
    assert target.exists() and not (tmp_path / LOCK_FILE).exists()
    claim_output_dir(config(tmp_path, resume=True)).release()  # resuming it is fine
    claim_output_dir(config(tmp_path, overwrite=True)).release()  # told to: the old run goes
    assert not target.exists()


def test_overwrite_key_loads_from_the_command_line():
    assert load_config(GOOD).overwrite_output_dir is False
    assert load_config(GOOD, ["overwrite_output_dir=true"]).overwrite_output_dir is True


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("call", ["pwrite", "fsync", "open"])
def test_a_full_disk_while_locking_is_one_line_and_leaves_no_lock_file(tmp_path, monkeypatch, call):
    """Resuming with the disk still full: the lock's write fails. Before, a raw OSError traceback
    and an empty .roll.lock that named no owner."""
    from roll.pipeline.common import output_dir

    monkeypatch.setattr(output_dir.os, call, _disk_full)
    with pytest.raises(StorageError) as err:
        claim_output_dir(config(tmp_path, resume=True))
    lock = tmp_path / LOCK_FILE
    assert str(err.value) == f"{lock}: No space left on device ({lock})"
    assert not lock.exists()
    monkeypatch.undo()
    claim_output_dir(config(tmp_path, resume=True)).release()  # the disk has room again


def test_a_full_disk_under_tensorboard_is_one_line_naming_its_directory(tmp_path, monkeypatch):
    import torch.utils.tensorboard

    from roll.utils.tracking import Tracker

    cfg = load_config(GOOD, [f"output_dir={tmp_path}", "track_with=tensorboard"])
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", _disk_full)
    with pytest.raises(StorageError) as err:
        Tracker(cfg, tmp_path)
    tb = tmp_path / "tensorboard"
    assert str(err.value) == f"{tb}: No space left on device ({tb})"

    class FullWriter:  # the event file filled up after it was opened: its thread raises on flush
        add_scalar = staticmethod(lambda *args: None)
        flush = close = staticmethod(_disk_full)

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", lambda log_dir: FullWriter())
    tracker = Tracker(cfg, tmp_path)
    with pytest.raises(StorageError, match=rf"^{tb}: No space left on device"):
        tracker.log({"a": 1.0}, step=1)
    with pytest.raises(StorageError, match=rf"^{tb}: No space left on device"):
        tracker.finish()


def test_run_log_that_cannot_be_written_is_one_line_not_a_traceback_per_record(tmp_path, capsys):
    import logging as std_logging

    from roll.pipeline.common.run_log import RunLogHandler

    handler = RunLogHandler(tmp_path / "run.log")
    handler.stream.write = _disk_full
    log = std_logging.getLogger("roll.test_run_log")
    log.addHandler(handler)
    try:
        log.warning("one")
        log.warning("two")
    finally:
        log.removeHandler(handler)
    assert capsys.readouterr().err.splitlines() == [
        f"roll: cannot write {tmp_path / 'run.log'}: [Errno 28] No space left on device"
    ]
