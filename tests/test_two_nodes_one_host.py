"""``benchmarks/two_nodes_one_host.py`` on CPU: two ``ray start`` nodes on loopback, the default
config's roles split across them (actor_train + reference on device 0, actor_infer on device 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "actor_train.device_mapping=0",
    "actor_infer.device_mapping=1",
    "reference.device_mapping=0",
    "max_steps=2",
    "save_steps=1",
    "eval_steps=0",
    "validation=null",
    "rollout_batch_size=4",
    "num_return_sequences_in_group=4",
    "actor_train.training_args.per_device_train_batch_size=16",
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_roles_land_on_both_nodes_and_nothing_survives(tmp_path, example):
    data = [f"pretrain={example}/sft_model", f"actor_train.data_args.file_name=[{example}/data/train.jsonl]"]
    cmd = [sys.executable, str(REPO / "benchmarks/two_nodes_one_host.py"), "--gpus_per_node", "1"]
    cmd += ["--cpus_per_node", "1", "--timeout", "200", "--out", str(tmp_path), *OVERRIDES, *data]
    # as on the GPU machines (a wheelhouse installed with pip --target): no ``ray`` script on PATH
    bare_path = os.pathsep.join(
        d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "ray").exists()
    )
    run = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=230, env=os.environ | {"PATH": bare_path}
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith(("actor_", "reference"))]
    nodes = {row[0]: row[1] for row in rows}
    assert nodes["actor_train"] == "0" and nodes["actor_infer"] == "1", run.stdout
    assert "checkpoints: step_1, step_2" in run.stdout
    address = next(line.split()[5] for line in run.stdout.splitlines() if line.startswith("two Ray nodes"))
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any("roll2n_" in part or address in part for part in p.info["cmdline"] or [])
    ]
    assert not left, left


def test_the_launcher_keeps_the_pythonpath_it_was_given(monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import two_nodes_one_host
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    env = two_nodes_one_host.launcher_env("127.0.0.1:6390")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/tmp/site"]
    assert env["RAY_ADDRESS"] == "127.0.0.1:6390"
    monkeypatch.delenv("PYTHONPATH")
    assert two_nodes_one_host.launcher_env("127.0.0.1:6390")["PYTHONPATH"] == str(REPO)


def test_a_driver_joins_the_two_nodes_in_process(tmp_path, monkeypatch):
    """The driver imported Ray before its environment named the cluster (address, token
    authentication), as the two-node GPU test's does: ``init_ray`` still joins, and sees both nodes."""
    import ray

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from two_nodes_one_host import LOCAL_ONLY, TOKEN_AUTH, TwoNodes
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from ray._raylet import AuthenticationTokenLoader, Config

    from roll.distributed.scheduler.placement import PlacementPlan
    from roll.distributed.scheduler.ray_start import init_ray

    assert not ray.is_initialized()
    nodes = TwoNodes(gpus_per_node=1, cpus_per_node=1, out=tmp_path)
    nodes.start()
    try:
        for key, value in {**LOCAL_ONLY, **TOKEN_AUTH, "RAY_ADDRESS": nodes.address}.items():
            monkeypatch.setenv(key, value)
        init_ray(PlacementPlan(2, 1, {}, ()), "cpu")
        assert sum(1 for n in ray.nodes() if n["Alive"]) == 2
    finally:
        ray.shutdown()
        nodes.stop()
        monkeypatch.undo()
        Config.initialize("")  # Ray's auth mode and token as the restored environment says: a later
        AuthenticationTokenLoader.instance().reset_cache()  # local Ray would start with this token
