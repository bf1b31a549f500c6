"""Step checkpoints under faults: manifest verification (flipped bytes, truncation, garbage JSON,
missing files, pickled code), atomic replace, a full disk, and which checkpoint a resume picks."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from roll.configs.errors import ConfigError
from roll.core.errors import CheckpointError
from roll.pipeline.common import checkpoint
from roll.pipeline.common.checkpoint import latest_checkpoint, resolve_resume, save_checkpoint
from roll.pipeline.common.checkpoint_manifest import MANIFEST, verify_checkpoint, write_manifest
from roll.utils import atomic_io
from roll.utils.safe_unpickle import check_dcp_dir

STATE = {"step": 2, "sampler": {"position": 7}, "rng": {"python": 1}}


def write_role(tmp: Path, payload: bytes = b"weights" * 100) -> None:
    role = tmp / "actor_train"
    role.mkdir()
    (role / "__0_0.distcp").write_bytes(payload)
    (role / "rng_rank0.json").write_text(json.dumps({"seed": 1}))


def save(root: Path, step: int, payload: bytes = b"weights" * 100) -> Path:
    return save_checkpoint(root, step, {**STATE, "step": step}, lambda tmp: write_role(tmp, payload))


def config(root: Path, resume) -> SimpleNamespace:
    return SimpleNamespace(
        resume_from_checkpoint=resume,
        checkpoint_config=SimpleNamespace(output_dir=str(root)),
        output_dir=str(root.parent),
        critic=None,
    )


def test_save_writes_a_manifest_that_verifies(tmp_path):
    path = save(tmp_path, 2)
    manifest = json.loads((path / MANIFEST).read_text())
    assert set(manifest["files"]) == {
        "pipeline_state.json",
        "actor_train/__0_0.distcp",
        "actor_train/rng_rank0.json",
    }
    verify_checkpoint(path, ["actor_train"])
    assert latest_checkpoint(tmp_path) == path
    assert not list(tmp_path.glob(".tmp-*"))


def test_flipped_bytes_are_caught_and_named(tmp_path):
    path = save(tmp_path, 2)
    weights = path / "actor_train" / "__0_0.distcp"
    data = bytearray(weights.read_bytes())
    for i in (3, 50, 100, 200):
        data[i] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"^{weights}: sha256 differs"):
        verify_checkpoint(path, ["actor_train"])


def test_truncated_file_is_caught_by_size(tmp_path):
    path = save(tmp_path, 2)
    weights = path / "actor_train" / "__0_0.distcp"
    weights.write_bytes(weights.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=rf"^{weights}: 10 bytes, manifest.json says 700"):
        verify_checkpoint(path, ["actor_train"])


def test_garbage_json_in_manifest_or_state(tmp_path):
    path = save(tmp_path, 2)
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"^{path / MANIFEST}: not valid JSON"):
        verify_checkpoint(path)
    (path / "pipeline_state.json").write_text("[1, 2")
    write_manifest(path)  # a writer that wrote garbage and hashed it: still caught, and named
    with pytest.raises(CheckpointError, match=rf"^{path / 'pipeline_state.json'}: not valid JSON"):
        verify_checkpoint(path)


def test_missing_state_file_or_role_or_manifest(tmp_path):
    path = save(tmp_path, 2)
    (path / "pipeline_state.json").unlink()
    with pytest.raises(CheckpointError, match=rf"^{path / 'pipeline_state.json'}: missing"):
        verify_checkpoint(path)
    write_manifest(path)
    with pytest.raises(
        CheckpointError, match=rf"^{path / 'pipeline_state.json'}: missing from the checkpoint"
    ):
        verify_checkpoint(path)
    path = save(tmp_path, 3)
    with pytest.raises(CheckpointError, match=rf"^{path / 'critic'}: missing from the checkpoint"):
        verify_checkpoint(path, ["actor_train", "critic"])
    (path / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=rf"^{path / MANIFEST}: missing"):
        verify_checkpoint(path)


def test_resume_latest_skips_invalid_newer_ones_loudly(tmp_path, caplog):
    good = save(tmp_path, 2)
    bad = save(tmp_path, 4)
    (bad / MANIFEST).unlink()
    caplog.set_level(logging.WARNING, logger="roll")
    assert resolve_resume(config(tmp_path, True)) == good
    assert f"skipping invalid checkpoint {bad}" in caplog.text
    with pytest.raises(CheckpointError, match=rf"^{bad / MANIFEST}: missing"):
        resolve_resume(config(tmp_path, str(bad)))  # named by the user: an error, not a skip
    (good / "pipeline_state.json").write_text("x")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        resolve_resume(config(tmp_path, True))


def test_resume_without_any_checkpoint_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint found"):
        resolve_resume(config(tmp_path, True))


def test_failed_save_keeps_the_existing_step_and_removes_tmp(tmp_path):
    first = save(tmp_path, 2, payload=b"first")

    def broken(tmp: Path) -> None:
        write_role(tmp, b"second")
        raise RuntimeError("worker died")

    with pytest.raises(RuntimeError, match="worker died"):
        save_checkpoint(tmp_path, 2, STATE, broken)
    assert (first / "actor_train" / "__0_0.distcp").read_bytes() == b"first"
    assert not list(tmp_path.glob(".tmp-*"))
    verify_checkpoint(first)


def test_replace_renames_the_old_step_aside_until_the_new_one_is_in(tmp_path, monkeypatch):
    save(tmp_path, 2, payload=b"first")
    real_replace = os.replace
    calls = []

    def replace_then_crash(src, dst):
        if not Path(src).is_dir():
            return real_replace(src, dst)
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:  # the old step is aside, the new one not yet in: the driver dies
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(atomic_io.os, "replace", replace_then_crash)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 2, payload=b"second")
    monkeypatch.setattr(atomic_io.os, "replace", real_replace)
    assert calls[0] == ("step_2", ".old-step_2")
    found = latest_checkpoint(tmp_path)  # restores the renamed-aside copy
    assert found == tmp_path / "step_2"
    assert (found / "actor_train" / "__0_0.distcp").read_bytes() == b"first"


def test_disk_full_is_one_line_and_leaves_no_tmp(tmp_path):
    def full(tmp: Path) -> None:
        target = tmp / "actor_train" / "__0_0.distcp"
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, 3, STATE, full)
    assert str(err.value) == (
        f"{tmp_path / '.tmp-step_3'}: No space left on device ({tmp_path / '.tmp-step_3/actor_train/__0_0.distcp'})"
    )
    assert not list(tmp_path.glob(".tmp-*"))


def test_disk_full_in_a_worker_names_its_file(tmp_path):
    from roll.distributed.scheduler.errors import WorkerError

    def full(tmp: Path) -> None:
        msg = f"[Errno 28] No space left on device: '{tmp}/actor_train/x.distcp'"
        raise WorkerError("actor_train", 1, "OSError", msg)

    with pytest.raises(CheckpointError, match=r"No space left on device \(.*/actor_train/x.distcp\)$"):
        save_checkpoint(tmp_path, 3, STATE, full)


def test_disk_full_under_torch_dcp_in_a_worker_names_the_os_error_and_its_file(tmp_path, monkeypatch):
    """torch.distributed.checkpoint gathers the ranks' errors into a CheckpointException whose
    first line is ``CheckpointException ranks:dict_keys([0, 1])``; the report must carry the
    OSError under it (as a save in a Ray worker gives it to the driver)."""
    import contextlib

    import torch.distributed.checkpoint as dcp
    from ray.exceptions import RayTaskError
    from torch.distributed.checkpoint import filesystem

    from roll.distributed.scheduler.errors import WorkerError

    @contextlib.contextmanager
    def full(self, path, mode):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        yield

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", full)

    def save_roles(tmp: Path) -> None:
        try:
            dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp / "actor_train"), no_dist=True)
        except BaseException as exc:  # what the worker raised, as Ray hands it to the driver
            error = RayTaskError("save_checkpoint", "Traceback (most recent call last): ...", exc)
            raise WorkerError.from_ray("actor_train", 1, error) from None

    with pytest.raises(CheckpointError) as err:
        save_checkpoint(tmp_path, 3, STATE, save_roles)
    tmp = tmp_path / ".tmp-step_3"
    assert str(err.value) == f"{tmp}: No space left on device ({tmp}/actor_train/__0_0.distcp)"
    worker_error = err.value.__cause__
    assert str(worker_error).startswith(
        f"actor_train rank 1: OSError: [Errno 28] No space left on device: '{tmp}/actor_train/__0_0.distcp'"
    )
    assert not tmp.exists()


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_pickled_metadata_that_runs_code_is_refused_before_loading(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = save(tmp_path, 2)
    (path / "actor_train" / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    write_manifest(path)
    with pytest.raises(CheckpointError, match=r"actor_train/\.metadata: refers to posix\.system"):
        verify_checkpoint(path)
    assert not (tmp_path / "pwned").exists()


def test_real_dcp_checkpoint_passes_the_pickle_check(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.ones(3), "n": 4, "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "name": None}]}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    check_dcp_dir(tmp_path)
    assert set(checkpoint.__all__) >= {"read_state", "resolve_resume"}


def test_a_non_tensor_entry_that_runs_code_is_refused_before_loading(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    monkeypatch.chdir(tmp_path)
    path = save_checkpoint(
        tmp_path,
        2,
        STATE,
        lambda tmp: dcp.save(
            {"w": torch.ones(2), "evil": _RunsCode()}, checkpoint_id=str(tmp / "actor_train"), no_dist=True
        ),
    )
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(path, ["actor_train"])
    assert str(err.value).startswith(f"{path / 'actor_train'}/__0_0.distcp: entry 'evil' is not plain data (")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("error, code", [(CheckpointError, 3), ("reward", 4)])
def test_launcher_prints_one_line_with_its_exit_code(monkeypatch, capsys, tmp_path, error, code):
    from launch_files import launch_overrides, make_launch_files

    from roll.core.errors import RewardError
    from roll.launch.rlvr import main
    from roll.pipeline.rlvr import pipeline

    exc = (
        CheckpointError("ckpt/step_2/manifest.json: missing")
        if error is CheckpointError
        else RewardError("x")
    )

    def fail(config):
        raise exc

    monkeypatch.setattr(pipeline, "run_pipeline", fail)
    good = Path(__file__).parent / "configs" / "good"
    files = launch_overrides(make_launch_files(tmp_path))
    args = ["--config_name", "minimal", "--config_path", str(good), f"output_dir={tmp_path / 'out'}"]
    assert main(args + files) == code
    assert capsys.readouterr().err.strip().splitlines() == [f"{type(exc).__name__}: {exc}"]


@pytest.mark.parametrize("resume", ["path", "true"])
def test_resuming_from_a_corrupted_checkpoint_at_launch_is_one_line_exit_3(
    monkeypatch, capsys, tmp_path, resume
):
    """check_before_launch verifies the checkpoint (roll.launch.files): a CheckpointError there,
    for a path named by the user or when no valid one remains under the checkpoint dir, is one
    line and exit 3, before any worker starts."""
    from launch_files import launch_overrides, make_launch_files

    from roll.launch.rlvr import main
    from roll.pipeline.rlvr import prestart

    monkeypatch.setattr(prestart, "prestart", lambda config: None)  # no Ray: nothing may start
    out = tmp_path / "out"
    path = save(out / "checkpoints", 2)
    weights = path / "actor_train" / "__0_0.distcp"
    weights.write_bytes(b"x" + weights.read_bytes()[1:])
    good = Path(__file__).parent / "configs" / "good"
    files = launch_overrides(make_launch_files(tmp_path))
    value = str(path) if resume == "path" else "true"
    args = ["--config_name", "minimal", "--config_path", str(good), f"output_dir={out}"]
    assert main([*args, *files, f"resume_from_checkpoint={value}"]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    corrupted = f"{weights}: sha256 differs from manifest.json (the file is corrupted)"
    if resume == "path":
        assert lines == [f"CheckpointError: {corrupted}"]
    else:  # the warning naming the skipped one may come first
        assert lines[-1] == (
            f"CheckpointError: {out / 'checkpoints'}: no valid checkpoint (1 invalid; newest: {corrupted})"
        )
        assert not any("Traceback" in line for line in lines)
