"""Durable writes: whole-or-nothing file replacement, one-line appends, directory fsync leniency."""

from __future__ import annotations

import errno
import os

import pytest

from roll.utils import atomic_io
from roll.utils.atomic_io import append_line_durably, fsync_path, write_file_durably


def test_write_file_durably_keeps_the_old_content_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    write_file_durably(path, "old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic_io.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_file_durably(path, "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["state.json"]


def test_append_takes_exactly_one_line(tmp_path):
    with pytest.raises(ValueError, match="exactly one line"):
        append_line_durably(tmp_path / "m.jsonl", "a\nb\n")
    with pytest.raises(ValueError, match="exactly one line"):
        append_line_durably(tmp_path / "m.jsonl", "no newline")


def test_directory_fsync_is_let_off_where_the_filesystem_cannot(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")

    def einval(fd):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(atomic_io.os, "fsync", einval)
    fsync_path(tmp_path)  # a directory: let off
    with pytest.raises(OSError):
        fsync_path(tmp_path / "f")  # a file's data must reach the disk
