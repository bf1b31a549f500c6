"""The device memory the plan is checked against, detected without opening a CUDA context."""

from __future__ import annotations

import os
import stat

from roll.planner.devices import first_visible_gpu


def fake_smi(tmp_path, monkeypatch, body: str) -> None:
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_first_visible_gpu_asks_nvidia_smi_for_the_first_visible_index(tmp_path, monkeypatch):
    # prints the -i it was given as part of the name, so the test sees which GPU was asked for
    fake_smi(tmp_path, monkeypatch, 'echo "NVIDIA H200 #$4, 143771"')
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert first_visible_gpu() == ("NVIDIA H200 #2", 143771 << 20)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert first_visible_gpu() == ("NVIDIA H200 #0", 143771 << 20)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert first_visible_gpu() is None


def test_no_gpu_tool_or_a_failing_one_is_unknown(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, "echo 'No devices were found'; exit 6")
    assert first_visible_gpu() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert first_visible_gpu() is None
