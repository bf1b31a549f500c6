"""A run across two Ray nodes, simulated on one machine with ``ray.cluster_utils.Cluster``: each
node declares 2 CPU device slots (``num_gpus=2``, as ``ray start --num-gpus=2`` would), the driver
joins through ``RAY_ADDRESS``, and the tiny disaggregated config puts actor_train on node 0
(devices 0-1) and actor_infer on node 1 (devices 2-3). Checked: every worker runs on the node the
plan says, the gloo model update across the nodes leaves the engine with the trainer's weights,
a checkpoint saved across nodes resumes to the same step, and the death of a node ends the run in
one line naming the role, rank and node."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline_e2e import comparable, config_dict, load, write_data  # noqa: E402
from tiny_models import build_tiny_model_dir  # noqa: E402

from roll.distributed.scheduler.errors import WorkerError  # noqa: E402
from roll.pipeline.rlvr.pipeline import run_pipeline  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PLACEMENT = re.compile(r"placement: node (\d): (\S+) \(Ray node (\w+)\) cpu ids [\d,]+: (.*)$")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(tmp dir with the tiny model and prompts, the Ray cluster, its worker node); the driver
    joins the cluster through RAY_ADDRESS as a user's would after ``ray start`` on each node."""
    tmp = tmp_path_factory.mktemp("multinode")
    model = build_tiny_model_dir(tmp / "model", seed=0)
    write_data(tmp / "train.jsonl", 8)
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2})
    worker_node = cluster.add_node(num_cpus=1, num_gpus=2)
    cluster.wait_for_nodes()
    env = pytest.MonkeyPatch()
    env.setenv("RAY_ADDRESS", cluster.address)
    try:
        yield tmp, model, cluster, worker_node
    finally:
        ray.shutdown()
        cluster.shutdown()
        env.undo()


def disaggregated(tmp: Path, model: Path, name: str, **overrides) -> dict:
    """actor_train on devices 0-1 (node 0), actor_infer on 2-3 (node 1), a rule reward."""
    cfg = config_dict(tmp, model, tmp / name, validation=None, eval_steps=0, use_kl_loss=False, **overrides)
    del cfg["reference"]
    cfg["actor_infer"]["device_mapping"] = "2-3"
    return cfg


def placement(caplog: pytest.LogCaptureFixture) -> dict[int, tuple[str, str, str]]:
    """``{plan node: (IP, Ray node id, its ranks)}`` from the run's ``placement:`` log lines."""
    found = [PLACEMENT.search(record.getMessage()) for record in list(caplog.records)]
    return {int(m[1]): (m[2], m[3], m[4]) for m in found if m}


def ran_a_step(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and bool(read_metrics(metrics))


def test_roles_on_two_nodes_sync_weights_checkpoint_and_resume(two_nodes, caplog):
    tmp, model, cluster, worker_node = two_nodes
    full = run_pipeline(load(tmp, "full", disaggregated(tmp, model, "full", max_steps=2, save_steps=1)))

    where = placement(caplog)
    ray_nodes = {cluster.head_node.node_id, worker_node.node_id}
    assert where[0][2] == "actor_train ranks 0-1" and where[1][2] == "actor_infer ranks 0-1", where
    assert {where[0][1], where[1][1]} == ray_nodes  # one plan node on each Ray node
    rows = read_metrics(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # the engine on node 1 scores the probe exactly as the trainer on node 0
        assert row["model_update/probe_logprob_diff"] == 0.0
        assert row["actor/grad_norm"] > 0  # so the synced weights changed every step
    assert (full / "checkpoints" / "step_1" / "actor_train").is_dir()

    resumed_cfg = disaggregated(
        tmp,
        model,
        "resumed",
        max_steps=2,
        save_steps=1,
        resume_from_checkpoint=str(full / "checkpoints/step_1"),
    )
    resumed = run_pipeline(load(tmp, "resumed", resumed_cfg))
    again = read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in again] == [2]
    assert comparable(again[0]) == comparable(rows[1])


def test_a_dead_node_ends_the_run_in_one_line(two_nodes, caplog):
    tmp, model, cluster, worker_node = two_nodes
    out = tmp / "dies"
    killed: dict[str, str] = {}

    def kill_when_running() -> None:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not ran_a_step(out):
            time.sleep(0.1)
        where = placement(caplog)
        node = next(n for n, (_, ray_id, _) in where.items() if ray_id == worker_node.node_id)
        killed["node"], killed["roles"] = str(node), where[node][2]
        cluster.remove_node(worker_node)

    killer = threading.Thread(target=kill_when_running, daemon=True)
    killer.start()
    with pytest.raises(WorkerError) as caught:
        run_pipeline(load(tmp, "dies", disaggregated(tmp, model, "dies", max_steps=200, save_steps=0)))
    killer.join(timeout=60)
    role = killed["roles"].split(" ranks ")[0]
    line = str(caught.value)
    assert "\n" not in line
    # The call that meets the death first names it: a rank of the role placed on the killed node, or
    # of the rule reward when Ray put it there too (a CPU role: the node is named as the one that
    # went down); either way the line names the killed node.
    node = killed["node"]
    assert re.match(
        rf"(({role}|rewards\.fmt) rank [01] on node {node} \([\d.]+\)|rewards\.fmt rank [01], after node "
        rf"{node} \([\d.]+\) went down): ActorDiedError: the worker process died",
        line,
    ), line
    rows = read_metrics(out / "metrics.jsonl")
    assert 1 <= len(rows) < 200
