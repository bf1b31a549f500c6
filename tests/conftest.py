"""Fixtures shared by the end-to-end Megatron pipeline tests on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "output" / "default_example"
SHIM = REPO / "tests" / "megatron" / "ray_cpu_shim"


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    """The default example's model and data: the prepared one, or a quick one made here."""
    if (EXAMPLE / "sft_model").is_dir():
        return EXAMPLE
    out = tmp_path_factory.mktemp("example")
    subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "prepare_default_example.py"),
            "--out",
            str(out),
            "--sft_steps",
            "5",
        ],
        check=True,
        cwd=REPO,
        timeout=600,
    )
    return out


@pytest.fixture
def shimmed_ray(monkeypatch):
    """A fresh local Ray whose workers load the Megatron CPU shims."""
    ray.shutdown()
    monkeypatch.setenv("ROLL_TEST_MEGATRON_CPU", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = os.pathsep.join(p for p in (str(SHIM), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    yield
    ray.shutdown()
