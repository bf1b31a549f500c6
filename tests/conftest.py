"""Fixtures shared by the tests: the end-to-end Megatron pipeline tests on CPU, and the rendezvous
variables every test gets back as it found them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from roll.models.qwen_rope_rule import use_qwen_rope_rule

# Qwen2.5-VL's rope positions by Qwen's rule, as every roll path computes them: the tests' own
# transformers references (in this process) must lay them the same way.
use_qwen_rope_rule()

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "output" / "default_example"
SHIM = REPO / "tests" / "megatron" / "ray_cpu_shim"

RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True, scope="module")
def _restore_rendezvous_env():
    """A test that joins a process group in the pytest process sets MASTER_PORT there; a later
    single-rank group would reuse that port, by then possibly another process's (EADDRINUSE)."""
    saved = {name: os.environ.get(name) for name in RENDEZVOUS_VARS}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def example(tmp_path_factory) -> Path:
    """The default example's model and data: the prepared one, or a quick one made here, once per
    test session (the tests only read it; a fresh checkout, as on CI, has no prepared one)."""
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


def shrunk_example(
    name: str, tmp: Path, example: Path, pretrain: Path, micro_batch: int, accumulation: int, **top: object
) -> dict:
    """``examples/config/<name>.yaml`` shrunk for a CPU run of 2 steps: fp32 Megatron roles,
    4 prompts x 4 samples, 1 MB model-update buckets, a tight probe tolerance, the default example's
    training data; ``top`` overrides top-level keys. Returns the raw dict (write it with
    ``write_config``) so a test can change more."""
    raw = yaml.safe_load((REPO / "examples" / "config" / f"{name}.yaml").read_text())
    raw.update(
        device="cpu",
        output_dir=str(tmp / "run"),
        pretrain=str(pretrain),
        max_steps=2,
        rollout_batch_size=4,
        num_return_sequences_in_group=4,
        track_with="none",
        model_update_buffer_size_mb=1,
        model_update_probe_tolerance=1.0e-4,
        **top,
    )
    raw["actor_train"]["data_args"]["file_name"] = [str(example / "data" / "train.jsonl")]
    raw["actor_train"]["training_args"].update(
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation
    )
    for role in ("actor_train", "actor_infer", "reference"):
        raw[role]["model_args"]["dtype"] = "fp32"
    return raw


def write_config(raw: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def check_two_steps(run_dir: Path) -> list[dict]:
    """A shrunk example's 2 logged steps: finite actor metrics (policy, grad norm, KL), engines that
    score like the trainer after each model update (fp32: far below 1e-4) and hold its version."""
    import math

    from roll.utils.tracking import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        actor = {k: v for k, v in row.items() if k.startswith("actor/")}
        assert {"actor/pg_loss", "actor/grad_norm", "actor/kl_loss"} <= actor.keys()
        assert all(math.isfinite(v) for v in actor.values()), actor
        assert row["model_update/probe_logprob_diff"] < 1e-4, row
        assert row["model_update/version_infer"] == row["step"], row
    return rows
