"""Durable writes: whole-or-nothing file replacement, one-line appends, directory fsync leniency."""

from __future__ import annotations

import errno
import os

import pytest

from roll.utils import atomic_io
from roll.utils.atomic_io import append_line_durably, fsync_path, write_dir_durably, write_file_durably


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


def test_a_directory_written_durably_replaces_the_old_one_only_when_complete(tmp_path):
    final = tmp_path / "hf_model"
    with write_dir_durably(final) as tmp:
        (tmp / "model.safetensors").write_text("old")
    assert [p.name for p in tmp_path.iterdir()] == ["hf_model"]

    with pytest.raises(KeyboardInterrupt):  # a signal in the middle of an export
        with write_dir_durably(final) as tmp:
            assert tmp.name == ".tmp-hf_model" and tmp.parent == tmp_path
            (tmp / "model.safetensors").write_text("half")
            raise KeyboardInterrupt
    assert (final / "model.safetensors").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["hf_model"]

    (tmp_path / ".tmp-hf_model").mkdir()  # left by a process killed mid-export
    (tmp_path / ".tmp-hf_model" / "junk").write_text("x")
    with write_dir_durably(final) as tmp:
        assert list(tmp.iterdir()) == []
        (tmp / "model.safetensors").write_text("new")
    assert os.listdir(final) == ["model.safetensors"] and (final / "model.safetensors").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["hf_model"]


def test_a_directory_is_fsynced_before_it_takes_the_final_name(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(atomic_io, "fsync_tree", lambda root: synced.append(sorted(os.listdir(root))))
    with write_dir_durably(tmp_path / "out") as tmp:
        (tmp / "a").write_text("x")
    assert synced == [["a"]] and (tmp_path / "out" / "a").exists()
