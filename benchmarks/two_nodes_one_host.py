"""A two-node Ray cluster simulated on one machine, and an RLVR run across it: multi-node placement,
the model update across nodes, checkpoints and (``--kill_worker_node_after_steps``) a node's death.

Both nodes are ``ray start --block`` processes this script owns, bound to 127.0.0.1: on the GPU
hosts a node bound to the machine's external IP left the driver unable to reach the GCS. On GPUs
node 0 sees the first ``--gpus_per_node`` visible GPUs and node 1 the next; on CPU (``device: cpu``)
each node declares ``--gpus_per_node`` fake GPUs, one per CPU device slot.

    python benchmarks/two_nodes_one_host.py --config rlvr_config --gpus_per_node 1 --out /tmp/two \\
        actor_train.device_mapping=0 actor_infer.device_mapping=1 reference.device_mapping=0 max_steps=2

``ray start --node-ip-address=127.0.0.1`` alone does not keep a node on loopback: Ray turns a
loopback address into the machine's IP unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which a
worker node refuses. So the nodes start through ``ray``'s CLI with that resolution turned off, and
the driver runs with the variable off (it starts no node, so the refusal does not apply to it).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from roll.utils.ports import free_port  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

LOOPBACK = "127.0.0.1"
PLACEMENT = re.compile(r"placement: node (\d+): (\S+) \(Ray node (\w+)\) \w+ ids [\w,]+: (.*)$")
# Ray's CLI (``ray start``, ``ray status``) through this interpreter, so no ``ray`` script needs to be
# on PATH (a wheel installed with ``pip --target`` has none), with loopback kept as the node's IP
# (see the module docstring).
RAY_CLI = (
    "import sys, ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())"
)
LOCAL_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# The two nodes run with token authentication (``ray start`` in Ray 2.60 turns it on where a token
# exists, and refuses to start in token mode without one), under a token of their own: a fresh
# machine has no ~/.ray/auth_token. Every client of the cluster (``ray status``, the driver) carries
# the same two variables.
TOKEN_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def node_env(node: int, gpus_per_node: int) -> dict[str, str]:
    """The environment of node ``node``'s ``ray start``: its half of the visible GPUs, if any."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    visible = gpu_ids()
    if visible:
        mine = visible[node * gpus_per_node : (node + 1) * gpus_per_node]
        if len(mine) < gpus_per_node:
            raise SystemExit(f"node {node} needs {gpus_per_node} GPUs; visible: {','.join(visible)}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    return env


def gpu_ids() -> list[str]:
    """The GPUs this process may use ([] on a CPU-only machine)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


class TwoNodes:
    """Two ``ray start --block`` processes (head and worker) in their own process groups; ``stop``
    ends them and any Ray process left that names this cluster's temp dir or GCS port."""

    def __init__(self, gpus_per_node: int, cpus_per_node: int, out: Path) -> None:
        self.port = free_port(LOOPBACK)
        self.address = f"{LOOPBACK}:{self.port}"
        # Short: Ray's socket paths under it must stay below the 107-byte limit of a Unix socket.
        self.temp_dir = tempfile.mkdtemp(prefix="roll2n_")
        self.out = out
        self.procs: list[subprocess.Popen] = []
        common = ["--block", f"--node-ip-address={LOOPBACK}", f"--num-gpus={gpus_per_node}"]
        common.append(f"--num-cpus={cpus_per_node}")
        head = ["--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}"]
        head += ["--disable-usage-stats", "--include-dashboard=false"]
        self.commands = [head + common, [f"--address={self.address}"] + common]
        self.gpus_per_node = gpus_per_node

    def start(self, timeout_s: float = 120.0) -> None:
        for node, args in enumerate(self.commands):
            log = open(self.out / f"ray_node{node}.log", "w")  # noqa: SIM115 (the child keeps it)
            cmd = [sys.executable, "-c", RAY_CLI, "start", *args]
            env = node_env(node, self.gpus_per_node) | TOKEN_AUTH | (LOCAL_ONLY if node == 0 else {})
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
            log.close()
            if node == 0:
                self.wait_for_nodes(1, timeout_s)
        self.wait_for_nodes(2, timeout_s)

    def alive_nodes(self) -> int:
        """Alive nodes by ``ray status`` (-1 when the GCS does not answer yet)."""
        run = subprocess.run(
            [sys.executable, "-c", RAY_CLI, "status", f"--address={self.address}"],
            capture_output=True,
            text=True,
            env=os.environ | LOCAL_ONLY | TOKEN_AUTH,
            timeout=60,
        )
        if run.returncode != 0:
            return -1
        active = run.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        return sum(1 for line in active.splitlines() if line.strip().startswith("1 node_"))

    def wait_for_nodes(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise SystemExit(
                        f"ray node {node} exited ({proc.returncode}): see {self.out}/ray_node{node}.log"
                    )
            if self.alive_nodes() >= count:
                return
            time.sleep(1.0)
        raise SystemExit(
            f"{count} Ray node(s) not alive at {self.address} after {timeout_s:.0f} s: see {self.out}"
        )

    def kill_worker_node(self) -> None:
        """The worker node dies: SIGKILL to its ``ray start --block``, raylet and workers. (A SIGTERM
        makes Ray 2.60 drain the node for up to 30 s; on CPU the run finished meanwhile, exit 0.)"""
        node = psutil.Process(self.procs[1].pid)
        doomed = [node, *node.children(recursive=True)]
        with_group(node.pid, signal.SIGKILL)
        for proc in doomed:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self, grace_s: float = 20.0) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs:
            with_group(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for proc in self.leftovers():
            proc.kill()
        psutil.wait_procs(self.leftovers(), timeout=10)

    def leftovers(self) -> list[psutil.Process]:
        """Processes still alive that belong to this cluster: their command line names its temp dir
        or its GCS address."""
        marks = (self.temp_dir, self.address)
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if proc.pid != os.getpid() and any(mark in cmdline for mark in marks):
                found.append(proc)
        return found


def with_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads (what the node started stays in it)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launcher_env(address: str) -> dict[str, str]:
    """The launcher's environment: this one, joined to the cluster at ``address``, with the repository
    ahead of whatever PYTHONPATH already holds (where the GPU machines keep their packages)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return os.environ | LOCAL_ONLY | TOKEN_AUTH | {"RAY_ADDRESS": address, "PYTHONPATH": path}


def run_rlvr(args: argparse.Namespace, nodes: TwoNodes, run_dir: Path) -> tuple[int, Path, Path]:
    """Run the RLVR launcher against the cluster; returns (exit code, stdout log, stderr log)."""
    cmd = [sys.executable, str(REPO / "examples/start_rlvr_pipeline.py"), "--config_name", args.config]
    if args.config_path:
        cmd += ["--config_path", args.config_path]
    cmd += [f"num_gpus_per_node={args.gpus_per_node}", f"output_dir={run_dir}", *args.overrides]
    env = launcher_env(nodes.address)
    stdout, stderr = args.out / "run_stdout.log", args.out / "run_stderr.log"
    print("run:", " ".join(cmd), flush=True)
    with open(stdout, "w") as out, open(stderr, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            killed = watch(proc, args, nodes, run_dir / "metrics.jsonl")
        except BaseException:
            with_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with_group(proc.pid, signal.SIGKILL)
            raise
    if killed:
        print(f"killed the worker node after {killed} logged step(s)")
    return proc.returncode, stdout, stderr


def watch(proc: subprocess.Popen, args: argparse.Namespace, nodes: TwoNodes, metrics: Path) -> int:
    """Wait for the run (``--timeout``); kill the worker node once ``--kill_worker_node_after_steps``
    steps are logged. Returns the steps logged when the node was killed (0: not killed)."""
    deadline = time.monotonic() + args.timeout
    killed = 0
    while proc.poll() is None:
        if time.monotonic() > deadline:
            with_group(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            raise SystemExit(f"the run did not end within --timeout {args.timeout:.0f} s (stopped)")
        if args.kill_worker_node_after_steps and not killed:
            steps = len(read_metrics(metrics)) if metrics.exists() else 0
            if steps >= args.kill_worker_node_after_steps:
                nodes.kill_worker_node()
                killed = steps
        time.sleep(0.5)
    return killed


def placement(*logs: Path) -> dict[int, tuple[str, str]]:
    """``{plan node: (Ray node id, the ranks there)}`` from the run's ``placement:`` lines."""
    found = {}
    for log in logs:
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                if m := PLACEMENT.search(line):
                    found[int(m[1])] = (m[3], m[4])
    return found


def report(run_dir: Path, where: dict[int, tuple[str, str]]) -> None:
    print(f"{'role':<14} {'plan node':>9}  Ray node  ranks")
    for node, (ray_id, held) in sorted(where.items()):
        for roles in held.split("; "):
            role, _, ranks = roles.partition(" ranks ")
            print(f"{role:<14} {node:>9}  {ray_id[:8]}  {ranks}")
    metrics = run_dir / "metrics.jsonl"
    for row in read_metrics(metrics) if metrics.exists() else []:
        update = {
            k: round(v, 3) for k, v in row.items() if "model_update" in k and isinstance(v, (int, float))
        }
        print(f"step {row['step']}: time/step {row.get('time/step', float('nan')):.2f} s  {update}")
    checkpoints = run_dir / "checkpoints"
    saved = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []
    print(f"checkpoints: {', '.join(saved) or 'none'} ({checkpoints})")


def check(args: argparse.Namespace, code: int, stderr: Path, where: dict[int, tuple[str, str]]) -> int:
    """0 when the run did what was asked, else 1 (with the reason printed)."""
    used = {ray_id for ray_id, held in where.values() if held != "no workers"}
    lines = [line for line in stderr.read_text(errors="replace").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    problems = []
    if len(used) < 2:
        problems.append(f"the roles ran on {len(used)} Ray node(s), not 2")
    if args.kill_worker_node_after_steps:
        print(f"exit code {code}; last stderr line: {last}")
        if code == 0:
            problems.append("the run exited 0 after its worker node died")
    elif code != 0:
        problems.append(f"the run failed (exit {code}): {last}")
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="rlvr_config", help="config name, as --config_name")
    parser.add_argument("--config_path", default=None, help="directory of the config (roll's default)")
    parser.add_argument("--gpus_per_node", type=int, default=2, help="GPUs (CPU: device slots) per node")
    parser.add_argument("--cpus_per_node", type=int, default=None, help="Ray CPUs per node (default: half)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the run may take")
    parser.add_argument("--out", type=Path, default=Path("output/two_nodes_one_host"), help="logs and run")
    parser.add_argument("--kill_worker_node_after_steps", type=int, default=0, help="kill node 1 then")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides for the run")
    args = parser.parse_args(argv)
    if args.cpus_per_node is None:
        args.cpus_per_node = max(1, (os.cpu_count() or 2) // 2)
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.out / "run"
    nodes = TwoNodes(args.gpus_per_node, args.cpus_per_node, args.out)
    start = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally block tears down
    try:
        nodes.start()
        print(f"two Ray nodes alive at {nodes.address} ({time.monotonic() - start:.1f} s)", flush=True)
        code, stdout, stderr = run_rlvr(args, nodes, run_dir)
        print(f"run ended: exit {code} after {time.monotonic() - start:.1f} s (logs: {args.out})")
        where = placement(stdout, stderr, run_dir / "run.log")
        report(run_dir, where)
        return check(args, code, stderr, where)
    finally:
        nodes.stop()


if __name__ == "__main__":
    sys.exit(main())
