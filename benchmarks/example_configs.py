"""Run every shipped example config that fits this machine's GPUs for a few steps, as shipped.

Each config in ``examples/config/`` with ``device: cuda`` and ``num_nodes * num_gpus_per_node``
at most the visible GPUs runs through ``examples/start_rlvr_pipeline.py`` with only
``max_steps`` changed (and ``overwrite_output_dir=true`` so a re-run starts fresh). Validation
runs at the last step as the pipeline always does. Prints one row per config: exit code, wall
time, median step time, the validation score, the model-update probe, and the last error line of
a failed run.

    python examples/prepare_default_example.py                       # the small configs' model and data
    python examples/make_random_checkpoint.py --preset qwen2.5-1.5b --out output/qwen2.5-1.5b-random
    python benchmarks/example_configs.py --steps 3
    python benchmarks/example_configs.py --steps 3 --only rlvr_megatron_2gpus,rlvr_vllm_1gpu
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "examples" / "config"
sys.path.insert(0, str(REPO))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to fit in (default: all visible)")
    parser.add_argument(
        "--only", default="", help="comma-separated config names (default: every one that fits)"
    )
    parser.add_argument("--timeout", type=int, default=900, help="seconds per config")
    return parser.parse_args(argv)


def gpus_needed(config: dict) -> int | None:
    """GPUs a config asks for, or None for a CPU config."""
    if config.get("device", "cuda") != "cuda":
        return None
    return int(config.get("num_nodes", 1)) * int(config.get("num_gpus_per_node", 8))


def fitting_configs(gpus: int, only: list[str]) -> list[tuple[str, int]]:
    chosen = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        need = gpus_needed(yaml.safe_load(path.read_text()))
        if only and path.stem not in only:
            continue
        if need is not None and need <= gpus:
            chosen.append((path.stem, need))
    missing = set(only) - {name for name, _ in chosen}
    if missing:
        raise SystemExit(f"--only: {sorted(missing)} are not GPU configs that fit {gpus} GPU(s)")
    return chosen


def run_one(name: str, steps: int, timeout: int, log_dir: Path) -> dict:
    cmd = [sys.executable, "examples/start_rlvr_pipeline.py", "--config_name", name]
    cmd += [f"max_steps={steps}", "overwrite_output_dir=true"]
    log = log_dir / f"{name}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        try:
            code = subprocess.run(
                cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    row = {"config": name, "exit": code, "wall_s": time.perf_counter() - start, "log": str(log)}
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    if code != 0 and lines:
        row["error"] = lines[-1][:160]
    row |= metrics_summary(name)
    return row


def metrics_summary(name: str) -> dict:
    from roll.configs.loader import load_config
    from roll.utils.tracking import read_metrics

    path = REPO / load_config(CONFIGS / f"{name}.yaml").output_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = read_metrics(path)
    steps = [r["time/step"] for r in rows if "time/step" in r]
    vals = [r["val/score/mean"] for r in rows if "val/score/mean" in r]
    probes = [r[k] for r in rows for k in r if k.startswith("model_update/probe") and "diff" in k]
    return {
        "step_s": statistics.median(steps) if steps else None,
        "val": vals[-1] if vals else None,
        "probe": probes[-1] if probes else None,
    }


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    log_dir = REPO / "output" / "example_configs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name, need in fitting_configs(args.gpus, only):
        print(f"running {name} ({need} GPU) for {args.steps} steps ...", flush=True)
        results.append(run_one(name, args.steps, args.timeout, log_dir) | {"gpus": need})
        r = results[-1]
        print(f"  exit {r['exit']} in {r['wall_s']:.0f} s {r.get('error', '')}", flush=True)
    print(f"\n{'config':<44}{'GPUs':>5}{'exit':>8}{'wall s':>8}{'step s':>8}{'val':>7}{'probe':>9}")
    for r in results:
        print(
            f"{r['config']:<44}{r['gpus']:>5}{str(r['exit']):>8}{r['wall_s']:>8.0f}{fmt(r.get('step_s'), '.2f'):>8}"
            f"{fmt(r.get('val'), '.3f'):>7}{fmt(r.get('probe'), '.4f'):>9}"
        )
        if r.get("error"):
            print(f"    {r['error']}")
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
