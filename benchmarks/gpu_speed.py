"""GPU speed guard: the shipped GPU examples that fit this machine, a few steps each, beside a baseline.

For every run below whose GPU count fits the visible GPUs it starts
``examples/start_rlvr_pipeline.py`` as shipped (only ``max_steps``, ``output_dir`` and the run's
listed overrides changed; validation and checkpoints off) and prints one table: the start-up phases
(``startup/*`` of the first metrics row), the seconds of each stage of the last step, the peak
device memory beside the memory planner's prediction (``--dry_run``'s "device peak"), each next to
the baseline of this GPU (``benchmarks/baselines/<gpu>.json``), their ratio and the stage's bound,
and the host's speed figures (``host_probe.py``: Python, torch dispatch, CUDA launches, matmul)
beside the baseline host's, so that a slower host shows as such.
It exits 1 when a stage, the step or the start-up is more than ``--tolerance`` (15%) slower than
its baseline (and more than ``--floor_s`` seconds: sub-second stages jitter by tens of ms), naming
the run, the stage and by how much.

    python benchmarks/gpu_speed.py                           # every run that fits, 3 steps each
    python benchmarks/gpu_speed.py --gpus 1                  # the 1-GPU mode (one H100 is enough)
    python benchmarks/gpu_speed.py --only qwen2.5-1.5B-rlvr_megatron_vllm_2gpus --save
    python benchmarks/gpu_speed.py --repo /path/to/other/checkout --label before   # same runs, other code
    python benchmarks/gpu_speed.py --from_runs output/gpu_speed --gpu_name "NVIDIA H200" --gpus 1  # tables again
    python benchmarks/gpu_speed.py --only qwen3-30B-A3B-rlvr_megatron_vllm_4gpus_disagg   # a pending_gpu draft, by name

Drafts in ``examples/config/pending_gpu`` (``pending=True`` below) run only when ``--only`` names
them: they are not shipped yet, and a guard run of them is how one qualifies.

``--save`` merges the measured runs into the baseline file (plain JSON, see ``save_baseline``).
``--parallel`` runs configs on disjoint GPUs at once (a 4-GPU host runs two 2-GPU configs
together; they share the host's CPUs, so compare such numbers only with numbers measured the same
way). Missing random checkpoints of the presets below are written first (``--device cuda``).

Bounds (seconds, from the model's parameter count N (active N for MoE), the step's real tokens and
the datasheet of the GPU: 989 TFLOP/s dense bf16 for H100/H200 SXM, HBM 3.35 / 4.8 TB/s):
train 6·N·tokens / (GPUs·peak); each log-prob pass 2·N·tokens / (GPUs·peak); generate the larger
of 2·N·tokens / (GPUs·peak) and response_length decode steps each reading the weights once
(2·N_total bytes / HBM bandwidth); model_update one read of the weights (2·N_total / HBM bandwidth).
They are floors no implementation reaches, there to show how far each stage is from one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from roll.configs.loader import apply_overrides  # noqa: E402
from roll.planner.model_shape import ModelShape, shape_from_config  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_probe import host_rows  # noqa: E402

BASELINES = REPO / "benchmarks" / "baselines"
# GPU name -> (dense bf16 FLOP/s, HBM bytes/s), from the vendors' datasheets (SXM parts).
DATASHEETS = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}


@dataclass(frozen=True)
class SpeedRun:
    """One config the guard runs: its GPU count, the random checkpoint it needs (preset, layer
    count), overrides beyond the step count, and whether it is a draft of examples/config/pending_gpu."""

    config: str
    gpus: int
    preset: str | None = None
    layers: int | None = None
    overrides: tuple[str, ...] = ()
    pending: bool = False

    @property
    def config_dir(self) -> str:
        return "examples/config/pending_gpu" if self.pending else "examples/config"

    def launcher(self, *args: str) -> list[str]:
        """The launcher's command line for this config (``args`` after its name)."""
        where = ["--config_path", self.config_dir] if self.pending else []
        return [
            sys.executable,
            "examples/start_rlvr_pipeline.py",
            *where,
            "--config_name",
            self.config,
            *args,
        ]


RUNS = (
    SpeedRun("rlvr_vllm_1gpu", 1),
    SpeedRun("qwen2.5-1.5B-rlvr_megatron_vllm_1gpu", 1, preset="qwen2.5-1.5b"),
    SpeedRun("rlvr_megatron_2gpus", 2),
    SpeedRun("rlvr_megatron_vllm_2gpus", 2),
    SpeedRun("qwen2.5-1.5B-rlvr_megatron_vllm_2gpus", 2, preset="qwen2.5-1.5b"),
    SpeedRun("qwen2.5-1.5B-rlvr_megatron_vllm_2gpus_async", 2, preset="qwen2.5-1.5b"),
    SpeedRun("qwen2.5-1.5B-rlvr_megatron_sglang_2gpus", 2, preset="qwen2.5-1.5b"),
    SpeedRun("qwen3-30B-A3B-rlvr_megatron_4gpus", 4, preset="qwen3-30b-a3b", layers=4),
    SpeedRun("qwen2.5-7B-rlvr_megatron_vllm_4gpus", 4, preset="qwen2.5-7b"),
    SpeedRun("qwen3-30B-A3B-rlvr_megatron_vllm_4gpus", 4, preset="qwen3-30b-a3b", layers=4),
    SpeedRun(
        "qwen3-30B-A3B-rlvr_megatron_vllm_4gpus_disagg", 4, preset="qwen3-30b-a3b", layers=4, pending=True
    ),
)


@dataclass
class Measured:
    """What one run gave: start-up phases, the last step's stages, peaks, and how it ended."""

    config: str
    gpus: int
    exit_code: int
    wall_s: float
    startup: dict[str, float] = field(default_factory=dict)
    stages: dict[str, float] = field(default_factory=dict)
    # Seconds colocated roles spent reloading / offloading in that step (inside the stages above).
    swaps: dict[str, float] = field(default_factory=dict)
    step_s: float | None = None
    startup_s: float | None = None
    peak_gib: float | None = None
    predicted_peak_gib: float | None = None
    tokens: float = 0.0
    response_tokens: float = 0.0
    error: str = ""
    # This host's speed figures (host_probe.py), measured before the runs started.
    host: dict[str, float] = field(default_factory=dict)

    def as_baseline(self) -> dict:
        return {
            "host": self.host,
            "gpus": self.gpus,
            "startup_s": self.startup_s,
            "startup": self.startup,
            "step_s": self.step_s,
            "stages": self.stages,
            "peak_gib": self.peak_gib,
            "predicted_peak_gib": self.predicted_peak_gib,
        }


# ----------------------------------------------------------------------------- reading a run
def measured_from_rows(run: SpeedRun, rows: list[dict], exit_code: int, wall_s: float) -> Measured:
    """The start-up phases of the first row that has them and the stages of the last step."""
    out = Measured(run.config, run.gpus, exit_code, wall_s)
    first = next((r for r in rows if "startup/to_first_step_s" in r), {})
    out.startup = {
        k.removeprefix("startup/").removesuffix("_s"): v
        for k, v in first.items()
        if k.startswith("startup/") and k != "startup/to_first_step_s"
    }
    out.startup_s = first.get("startup/to_first_step_s")
    steps = [r for r in rows if "time/step" in r]
    if steps:
        last = steps[-1]
        out.step_s = last["time/step"]
        out.stages = {
            k.removeprefix("time/"): v
            for k, v in last.items()
            if k.startswith("time/") and k not in ("time/step", "time/validation")
        }
        out.swaps = {
            k.removeprefix("swap/").removesuffix("_s"): v for k, v in last.items() if k.startswith("swap/")
        }
        out.tokens = last.get("perf/tokens", 0.0)
        out.response_tokens = last.get("perf/response_tokens", 0.0)
    peaks = [r["memory/peak_used_gib_max"] for r in rows if "memory/peak_used_gib_max" in r]
    out.peak_gib = max(peaks) if peaks else None
    return out


def predicted_peak(dry_run_output: str) -> float | None:
    """The largest "device peak X" of a ``--dry_run`` memory plan (GiB), None without a plan."""
    peaks = [float(m) for m in re.findall(r"device peak ([0-9.]+)", dry_run_output)]
    return max(peaks) if peaks else None


# ----------------------------------------------------------------------------- bounds
def active_params(shape: ModelShape) -> int:
    """Parameters one token runs through: every dense one, ``top_k`` of the experts."""
    if not shape.experts:
        return shape.total_params()
    unused = shape.expert_params() * (shape.experts - shape.top_k) // shape.experts
    return shape.total_params() - unused


def stage_bounds(
    shape: ModelShape, tokens: float, gpus: int, response_length: int, flops: float, hbm: float
) -> dict[str, float]:
    """Seconds no implementation can beat for each stage (see the module docstring)."""
    n, total = active_params(shape), shape.total_params()
    forward = 2 * n * tokens / (gpus * flops)
    return {
        "train": 3 * forward,
        "old_log_probs": forward,
        "reference": forward,
        "values": forward,
        "generate": max(forward, response_length * 2 * total / hbm),
        "model_update": 2 * total / hbm,
    }


def datasheet(gpu_name: str) -> tuple[float, float, str]:
    for key, (flops, hbm) in DATASHEETS.items():
        if key in gpu_name:
            return flops, hbm, key
    flops, hbm = DATASHEETS["H100"]
    return flops, hbm, "H100 figures (unknown GPU)"


# ----------------------------------------------------------------------------- comparing
def regressions(now: Measured, base: dict | None, tolerance: float, floor_s: float) -> list[str]:
    """One line per stage (and the step and start-up) slower than ``base`` by more than
    ``tolerance`` and ``floor_s`` seconds."""
    if not base:
        return []
    pairs = [("startup", now.startup_s, base.get("startup_s")), ("step", now.step_s, base.get("step_s"))]
    pairs += [(k, v, base.get("stages", {}).get(k)) for k, v in now.stages.items()]
    lines = []
    for name, value, ref in pairs:
        if value is None or ref is None or ref <= 0:
            continue
        if value > ref * (1 + tolerance) and value - ref > floor_s:
            lines.append(
                f"{now.config}: {name} {value:.2f} s vs baseline {ref:.2f} s (+{(value / ref - 1) * 100:.0f}%)"
            )
    return lines


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None, ref: float | None) -> str:
    return "-" if value is None or not ref else f"{value / ref:.2f}x"


def run_table(now: Measured, base: dict | None, bounds: dict[str, float]) -> list[str]:
    """Markdown table of one run: rows of start-up phases, stages, step, memory."""
    base = base or {}
    lines = [
        f"### {now.config} ({now.gpus} GPU{'s' if now.gpus > 1 else ''}, exit {now.exit_code}, wall {now.wall_s:.0f} s)",
        "",
        "| | now | baseline | ratio | bound |",
        "|---|---:|---:|---:|---:|",
    ]
    for phase, value in now.startup.items():
        ref = base.get("startup", {}).get(phase)
        lines.append(f"| start-up: {phase} | {_cell(value)} | {_cell(ref)} | {_ratio(value, ref)} | |")
    ref = base.get("startup_s")
    lines.append(
        f"| **start-up to first step** | {_cell(now.startup_s)} | {_cell(ref)} | {_ratio(now.startup_s, ref)} | |"
    )
    for stage, value in now.stages.items():
        ref = base.get("stages", {}).get(stage)
        bound = bounds.get(stage)
        lines.append(
            f"| {stage} | {_cell(value)} | {_cell(ref)} | {_ratio(value, ref)} | {_cell(bound, 3)} |"
        )
    for swap, value in now.swaps.items():
        lines.append(f"| (within the stages) {swap} | {_cell(value)} | | | |")
    ref = base.get("step_s")
    step_bound = sum(bounds.get(s, 0.0) for s in now.stages) or None
    lines.append(
        f"| **step** | {_cell(now.step_s)} | {_cell(ref)} | {_ratio(now.step_s, ref)} | {_cell(step_bound, 3)} |"
    )
    ref = base.get("peak_gib")
    lines.append(
        f"| peak GiB (device) | {_cell(now.peak_gib, 1)} | {_cell(ref, 1)} | {_ratio(now.peak_gib, ref)} | |"
    )
    lines.append(
        f"| planner's predicted peak GiB | {_cell(now.predicted_peak_gib, 1)} | | "
        f"{_ratio(now.peak_gib, now.predicted_peak_gib)} measured/predicted | |"
    )
    lines += host_rows(now.host, base.get("host"))  # a slower host slows every stage alike
    if now.error:
        lines.append(f"\nfailed: {now.error}")
    return lines


def gpu_slug(name: str) -> str:
    """``NVIDIA H200`` -> ``nvidia-h200``; ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100``."""
    words = name.lower().split()
    return "-".join(words[:2]) if len(words) > 1 else (words[0] if words else "unknown")


def load_baseline(path: Path) -> dict:
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def save_baseline(path: Path, gpu_name: str, commit: str, measured: list[Measured]) -> dict:
    """Merge ``measured`` (runs that finished) into the baseline file:
    ``{"gpu", "date", "commit", "runs": {config: {gpus, startup_s, startup, step_s, stages, peak_gib,
    predicted_peak_gib}}}``."""
    data = load_baseline(path) or {"runs": {}}
    data.update(gpu=gpu_name, date=datetime.date.today().isoformat(), commit=commit)
    for m in measured:
        if m.exit_code == 0 and m.step_s is not None:
            data["runs"][m.config] = m.as_baseline() | {"commit": commit}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


# ----------------------------------------------------------------------------- running
def probe_host_apart(timeout_s: float = 120.0) -> dict[str, float]:
    """``host_probe.py``'s figures, from a process of its own: its CUDA context must not stay on a
    GPU the runs measure. Empty when the probe fails."""
    probe = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parent / "host_probe.py")],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    try:
        return json.loads(probe.stdout) if probe.returncode == 0 else {}
    except json.JSONDecodeError:
        return {}


def config_values(repo: Path, run: SpeedRun) -> dict:
    return yaml.safe_load((repo / run.config_dir / f"{run.config}.yaml").read_text())


def ensure_checkpoint(repo: Path, run: SpeedRun, log) -> None:
    """Write the random checkpoint a preset run needs when it is not there yet."""
    if run.preset is None:
        return
    target = (repo / config_values(repo, run)["pretrain"]).resolve()
    if (target / "config.json").exists():
        return
    cmd = [sys.executable, "examples/make_random_checkpoint.py", "--preset", run.preset, "--out", str(target)]
    cmd += ["--device", "cuda"] + (["--num_hidden_layers", str(run.layers)] if run.layers else [])
    log(f"writing {target} ({run.preset})")
    subprocess.run(cmd, cwd=repo, check=True, env=_env(repo, "0"))


def _env(repo: Path, devices: str) -> dict[str, str]:
    """The run's environment on ``devices`` (indices among the GPUs this process sees: under
    ``CUDA_VISIBLE_DEVICES=1`` index 0 is physical GPU 1, so two guards can share a host)."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if visible and devices:
        devices = ",".join(visible[int(i)] for i in devices.split(","))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), env.get("PYTHONPATH", "")) if p)
    return env


def launch(
    repo: Path, run: SpeedRun, steps: int, out: Path, devices: str, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, list[str]]:
    overrides = [
        f"max_steps={steps}",
        f"output_dir={out / run.config}",
        "save_steps=0",
        "eval_steps=0",
        "track_with=none",
        *run.overrides,
        *extra,
    ]
    cmd = run.launcher(*overrides)
    # A fresh run each time (older checkouts have no overwrite_output_dir).
    shutil.rmtree(out / run.config, ignore_errors=True)
    log = open(out / f"{run.config}.log", "w")  # noqa: SIM115 - closed when the process is reaped
    proc = subprocess.Popen(cmd, cwd=repo, env=_env(repo, devices), stdout=log, stderr=subprocess.STDOUT)
    return proc, overrides


def start_dry_run(repo: Path, run: SpeedRun, overrides: list[str], gpu: str) -> subprocess.Popen:
    """The launcher's ``--dry_run`` (its memory plan) for ``gpu`` (H100, H200), started beside the
    run with CUDA hidden (a CUDA context of its own would take memory while the run's engine sizes
    its KV cache)."""
    overrides = [*overrides, f"gpu={gpu}"] if gpu in DATASHEETS else overrides
    return subprocess.Popen(
        run.launcher("--dry_run", *overrides),
        cwd=repo,
        env=_env(repo, ""),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def dry_run_peak(dry_run: subprocess.Popen, timeout_s: float = 300) -> tuple[float | None, bool]:
    """(the planner's peak from a started ``--dry_run``, whether it finished within ``timeout_s``;
    it is killed otherwise)."""
    try:
        return predicted_peak(dry_run.communicate(timeout=timeout_s)[0]), True
    except subprocess.TimeoutExpired:
        dry_run.kill()
        dry_run.wait()
        return None, False


def collect(repo: Path, run: SpeedRun, out: Path, code: int, wall: float, dry_run: subprocess.Popen):
    rows = (
        read_metrics(out / run.config / "metrics.jsonl")
        if (out / run.config / "metrics.jsonl").exists()
        else []
    )
    measured = measured_from_rows(run, rows, code, wall)
    if code != 0:
        tail = (out / f"{run.config}.log").read_text(errors="replace").strip().splitlines()[-1:]
        measured.error = tail[0] if tail else f"exit {code}"
    measured.predicted_peak_gib, finished = dry_run_peak(dry_run)
    if not finished:
        measured.error = measured.error or "--dry_run did not finish in 300 s"
    return measured


def run_all(
    repo: Path,
    runs: list[SpeedRun],
    steps: int,
    out: Path,
    gpus: int,
    parallel: bool,
    timeout: int,
    log,
    gpu: str = "",
    extra: tuple[str, ...] = (),
):
    """Run ``runs``, each on the first free GPUs (all in turn unless ``parallel``)."""
    free = list(range(gpus))
    queue, active, results = list(runs), [], []
    while queue or active:
        while queue and (parallel or not active) and queue[0].gpus <= len(free):
            run = queue.pop(0)
            ensure_checkpoint(repo, run, log)
            mine, free = free[: run.gpus], free[run.gpus :]
            devices = ",".join(map(str, mine))
            proc, overrides = launch(repo, run, steps, out, devices, extra)
            dry_run = start_dry_run(repo, run, overrides, gpu)
            log(f"started {run.config} on GPUs {devices}")
            active.append((run, proc, time.time(), mine, dry_run))
        time.sleep(2)
        for item in list(active):
            run, proc, start, mine, dry_run = item
            code = proc.poll()
            if code is None and steps_logged(out / run.config / "metrics.jsonl") >= steps:
                # Everything the table needs is in; the end-of-run export (tens of seconds at the
                # MoE and 7B shapes) and the teardown would only spend device time.
                stop(proc)
                code = 0
                log(f"{run.config}: step {steps} logged; stopped before its end-of-run export")
            if code is None and time.time() - start > timeout:
                code = stop(proc)
                log(f"{run.config}: stopped after --timeout {timeout} s")
            if code is None:
                continue
            active.remove(item)
            free = sorted(free + mine)
            wall = time.time() - start
            log(f"{run.config}: exit {code} after {wall:.0f} s")
            results.append(collect(repo, run, out, code, wall, dry_run))
    return results


def steps_logged(metrics: Path) -> int:
    """The last step a run's metrics.jsonl has a row for (0 before the first)."""
    try:
        steps = [row.get("step") or 0 for row in read_metrics(metrics)] if metrics.exists() else []
    except Exception:  # noqa: BLE001 - a file being written: ask again at the next poll
        return 0
    return max(steps, default=0)


def stop(proc: subprocess.Popen, grace_s: float = 20.0) -> int:
    """SIGTERM (the launcher stops its workers and Ray, docs/runtime_faults.md), then SIGKILL."""
    proc.terminate()
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    parser.add_argument("--only", default="", help="comma-separated config names")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose code runs")
    parser.add_argument("--label", default="", help="a name for this set of runs in the output")
    parser.add_argument("--out", type=Path, default=REPO / "output" / "gpu_speed")
    parser.add_argument("--baseline", type=Path, default=None, help="default: baselines/<gpu>.json")
    parser.add_argument("--save", action="store_true", help="merge the finished runs into the baseline")
    parser.add_argument("--parallel", action="store_true", help="configs on disjoint GPUs at once")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="KEY=VALUE added to every run's overrides (repeatable); such runs are not the shipped configs",
    )
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--floor_s", type=float, default=0.1)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument(
        "--from_runs",
        type=Path,
        default=None,
        help="print (and --save) runs made earlier: DIR/<config>/metrics.jsonl",
    )
    parser.add_argument(
        "--gpu_name", default="", help="with --from_runs: the GPU they ran on, e.g. 'NVIDIA H200'"
    )
    parser.add_argument(
        "--commit", default="", help="with --save: the commit the runs measured (default: HEAD)"
    )
    return parser.parse_args(argv)


def engines_not_installed(values: dict) -> list[str]:
    """The packages (the strategy table's ``requires``: vllm, sglang, megatron.core) that a config's
    roles need and this Python cannot import."""
    from roll.configs.strategies import get_strategy_spec
    from roll.utils.preload import is_installed

    roles = [values.get(k) for k in ("actor_train", "actor_infer", "reference", "critic")]
    roles += list((values.get("rewards") or {}).values())
    names = {((r or {}).get("strategy_args") or {}).get("strategy_name") for r in roles} - {None}
    needed = {module for name in names for module in get_strategy_spec(name).requires}
    return sorted(module for module in needed if not is_installed(module))


def select_runs(gpus: int, only: set[str]) -> list[SpeedRun]:
    """The runs that fit ``gpus``: those named in ``only``, else every shipped one (no draft)."""
    return [r for r in RUNS if r.gpus <= gpus and (r.config in only if only else not r.pending)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_runs is None:
        import torch

        if not torch.cuda.is_available():
            print("gpu_speed: no CUDA GPU visible; this benchmark runs the GPU examples", file=sys.stderr)
            return 2
        gpus, gpu_name = args.gpus or torch.cuda.device_count(), torch.cuda.get_device_name(0)
    else:
        if not args.gpu_name:
            print("gpu_speed: --from_runs needs --gpu_name (the GPU the runs ran on)", file=sys.stderr)
            return 2
        gpus, gpu_name = args.gpus or 8, args.gpu_name
    only = {c for c in args.only.split(",") if c}
    unknown = only - {r.config for r in RUNS}
    if unknown:
        print(
            f"gpu_speed: --only: unknown runs {sorted(unknown)}; known: {[r.config for r in RUNS]}",
            file=sys.stderr,
        )
        return 2
    runs = select_runs(gpus, only)
    missing = [r.config for r in runs if not (args.repo / r.config_dir / f"{r.config}.yaml").exists()]
    if missing:
        print(f"gpu_speed: {args.repo} has no config {missing}; skipped", file=sys.stderr)
        runs = [r for r in runs if r.config not in missing]
    if not only and args.from_runs is None:  # a run named with --only runs (and fails) regardless
        for run in list(runs):
            absent = engines_not_installed(config_values(args.repo, run))
            if absent:
                print(
                    f"gpu_speed: {run.config}: skipped, {' and '.join(absent)} not installed here",
                    file=sys.stderr,
                )
                runs.remove(run)
    baseline_path = args.baseline or BASELINES / f"{gpu_slug(gpu_name)}.json"
    baseline = load_baseline(baseline_path).get("runs", {})
    _, _, sheet = datasheet(gpu_name)

    def log(msg: str) -> None:
        print(f"[gpu_speed {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    log(f"{gpus} x {gpu_name} ({sheet}); runs: {[r.config for r in runs]}; baseline {baseline_path}")
    if args.from_runs is not None:
        out = args.from_runs
        results = read_runs(args.repo.resolve(), runs, out.resolve(), sheet)
    else:
        out = (args.out / args.label) if args.label else args.out
        out.mkdir(parents=True, exist_ok=True)
        host = probe_host_apart()
        log(f"host: {json.dumps({k: round(v, 3) for k, v in host.items()})}")
        results = run_all(
            args.repo.resolve(),
            runs,
            args.steps,
            out.resolve(),
            gpus,
            args.parallel,
            args.timeout,
            log,
            sheet,
            tuple(args.override),
        )
        for measured in results:
            measured.host = host
    failures, slower = report(args, runs, results, baseline, gpu_name)
    if args.from_runs is None:
        (out / "results.json").write_text(json.dumps([m.__dict__ for m in results], indent=1) + "\n")
    if args.save:
        commit = (
            args.commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=args.repo, capture_output=True, text=True
            ).stdout.strip()
        )
        save_baseline(baseline_path, gpu_name, commit or "unknown", results)
        log(f"baseline saved: {baseline_path}")
    for line in failures + slower:
        print(line)
    return 1 if failures or slower else 0


def read_runs(repo: Path, runs: list[SpeedRun], out: Path, gpu: str) -> list[Measured]:
    """``Measured`` of runs made earlier (``--from_runs``): ``out/<config>/metrics.jsonl``; the
    wall time is the driver's age at its last step (``perf/wall_s``)."""
    results = []
    for run in runs:
        path = out / run.config / "metrics.jsonl"
        if not path.exists():
            continue
        rows = read_metrics(path)
        wall = max((r.get("perf/wall_s", 0.0) for r in rows), default=0.0)
        measured = measured_from_rows(run, rows, 0, wall)
        overrides = [f"output_dir={out / run.config}", *run.overrides]
        measured.predicted_peak_gib, _ = dry_run_peak(start_dry_run(repo, run, overrides, gpu))
        results.append(measured)
    return results


def report(args, runs: list[SpeedRun], results: list[Measured], baseline: dict, gpu_name: str):
    """Print one table per run; the failed runs and the regressions, one line each."""
    flops, hbm, _ = datasheet(gpu_name)
    failures, slower = [], []
    for m in sorted(results, key=lambda m: [r.config for r in runs].index(m.config)):
        run = next(r for r in runs if r.config == m.config)
        cfg = apply_overrides(config_values(args.repo, run), list(run.overrides))
        bounds = {}
        model_dir = (args.repo / cfg["pretrain"]).resolve()
        if m.tokens and (model_dir / "config.json").exists():
            shape = shape_from_config(json.loads((model_dir / "config.json").read_text()))
            bounds = stage_bounds(shape, m.tokens, m.gpus, int(cfg.get("response_length", 0)), flops, hbm)
        print("\n".join(["", *run_table(m, baseline.get(m.config), bounds)]))
        if m.exit_code != 0:
            failures.append(f"FAILED {m.config}: exit {m.exit_code}: {m.error}")
        slower += [
            f"REGRESSION {line}"
            for line in regressions(m, baseline.get(m.config), args.tolerance, args.floor_s)
        ]
    return failures, slower


if __name__ == "__main__":
    sys.exit(main())
