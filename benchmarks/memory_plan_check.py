"""Predicted (roll/planner) against measured peak memory, the measured side read from what the runs
wrote (no numbers copied from docs):

    python benchmarks/memory_plan_check.py --baseline benchmarks/baselines/h100.json
    python benchmarks/memory_plan_check.py --train_step one.json two.json
    python benchmarks/memory_plan_check.py --run output/x/metrics.jsonl \\
        --config_name qwen2.5-1.5B-rlvr_megatron_vllm_2gpus --preset qwen2.5-1.5b gpu=H200

Sources, each with what its peak is compared with:

- ``--baseline``: a ``benchmarks/baselines/<gpu>.json`` that benchmarks/gpu_speed.py writes,
  ``{"gpu": ..., "runs": {"<config_name>": {"peak_gib": ..., "predicted_peak_gib": ..., ...}}}``:
  the run's largest device-wide used memory against the planner's device peak recorded by that run.
- ``--train_step``: the ``--out`` JSON of benchmarks/megatron_train_step.py or memory_train_cases.py:
  one rank's allocator peak (``peak_gib``) against megatron_train's predicted tensors for the case.
- ``--run`` with ``--config_name`` (and overrides): a pipeline run's metrics.jsonl, its largest
  ``memory/<role>/peak_allocated_gib`` (alloc: the role's predicted tensors, without the process
  overhead) and ``memory/device<d>/peak_used_gib`` (device: the device group's predicted peak) over
  the steps, the config planned as ``--dry_run`` plans it (``--preset``: with a config.json of that
  preset instead of the config's model).

Left out, since they cannot disagree: a vLLM / SGLang role sized by a fraction (its memory is the
configured ``gpu_memory_utilization`` / ``mem_fraction_static`` of the device; a vLLM engine given
``kv_cache_memory_gb`` is compared like any role), a device whose predicted peak is
such an engine's stage, and a baseline config whose every GPU role is such an engine. Each is named
on a ``left out:`` line, as is a measurement with no prediction.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from roll.planner import memory as mem  # noqa: E402

GIB = mem.GIB
CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "config"
ENGINES = ("vllm", "sglang")
FRACTION_KNOBS = ("gpu_memory_utilization", "mem_fraction_static")
TOLERANCE = 0.15


@dataclass(frozen=True)
class Row:
    run: str
    measured_as: str  # "<role> (alloc)" or "device <ids> (device)"
    predicted_gib: float
    measured_gib: float

    @property
    def error(self) -> float:
        return (self.predicted_gib - self.measured_gib) / self.measured_gib


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: cannot read it as JSON ({exc})") from None


# ------------------------------------------------------------------------------ baseline files
def baseline_rows(path: Path, left_out: list[str]) -> list[Row]:
    data = read_json(path)
    runs = data.get("runs")
    if not isinstance(runs, dict):
        raise SystemExit(f"{path}: no 'runs' mapping of config name -> results")
    rows = []
    for name, run in runs.items():
        missing = [k for k in ("peak_gib", "predicted_peak_gib") if run.get(k) is None]
        if missing:
            left_out.append(f"{path}: runs.{name}: no {' or '.join(missing)}")
        elif engines_only(name):
            left_out.append(f"{path}: runs.{name}: every GPU role is a vLLM/SGLang engine (a set fraction)")
        else:
            where = f"{data.get('gpu', '?')} x {run.get('gpus', '?')}"
            rows.append(
                Row(f"{name} ({where})", "device peak (device)", run["predicted_peak_gib"], run["peak_gib"])
            )
    return rows


def engines_only(config_name: str) -> bool:
    """Whether every device-holding role of a shipped config is a vLLM/SGLang engine (False when the
    config is not a shipped one or does not load without its model)."""
    from roll.configs.loader import load_config

    path = CONFIGS / f"{config_name}.yaml"
    if not path.exists():
        return False
    try:
        config = load_config(path)
    except Exception:  # noqa: BLE001  (a config that needs overrides is simply compared)
        return False
    roles = [r for r in config.roles().values() if r.model_args.model_name_or_path]
    return bool(roles) and all(r.strategy_args.strategy_name in ENGINES for r in roles)


# ------------------------------------------------------------------------- train-step results
def train_cases() -> dict[str, object]:
    """The train-step benchmark's cases by name (memory_train_cases.py's included)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import megatron_train_step as bench
    import memory_train_cases

    return {case.name: case for case in [*bench.CASES, *memory_train_cases.CASES]}


def predicted_train_gib(case, gpus: int) -> float:
    """megatron_train's predicted tensors for one rank of ``case`` on ``gpus`` devices."""
    import megatron_train_step as bench

    from roll.planner.model_shape import shape_from_config

    layout = case.layout
    tp, ep = layout.get("tensor_model_parallel_size", 1), layout.get("expert_model_parallel_size", 1)
    split = mem.Split(
        tp, ep=ep, etp=tp, sequence_parallel=bool(layout.get("sequence_parallel")), vocab_multiple=128
    )
    shape = shape_from_config(case.make_config().to_dict())
    recompute = layout.get("recompute_granularity") == "full"
    dist_opt = bool(layout.get("use_distributed_optimizer"))
    parts = mem.megatron_train(shape, split, gpus // tp, 2, bench.SEQ, recompute, dist_opt)
    return sum(parts.values()) / GIB


def train_step_rows(path: Path, left_out: list[str]) -> list[Row]:
    data = read_json(path)
    if not isinstance(data.get("rows"), list):
        raise SystemExit(f"{path}: no 'rows' list (is it a megatron_train_step.py --out file?)")
    cases = train_cases()
    rows = []
    for i, result in enumerate(data["rows"]):
        name, gpus = result.get("config"), result.get("gpus")
        case = cases.get(name)
        if case is None or result.get("peak_gib") is None or gpus is None:
            left_out.append(f"{path}: rows[{i}] ({name}): no case of that name, or no peak_gib / gpus")
            continue
        label = f"train step: {name}, {result.get('layout', '')} on {gpus} GPU"
        rows.append(Row(label, "actor_train (alloc)", predicted_train_gib(case, gpus), result["peak_gib"]))
    return rows


# ------------------------------------------------------------------------------ pipeline runs
def measured_peaks(metrics: Path) -> dict[str, float]:
    """The largest of every ``memory/<role>/peak_allocated_gib`` and ``memory/device<d>/peak_used_gib``
    over a run's metrics rows."""
    from roll.utils.tracking import read_metrics

    peaks: dict[str, float] = {}
    for row in read_metrics(metrics):
        for key, value in row.items():
            if re.fullmatch(r"memory/(device\d+/peak_used_gib|[^/]+/peak_allocated_gib)", key):
                peaks[key] = max(peaks.get(key, 0.0), float(value))
    if not peaks:
        raise SystemExit(f"{metrics}: no memory/<role>/peak_allocated_gib or memory/device<d>/peak_used_gib")
    return peaks


def planned(config_name: str, preset: str | None, layers: int | None, overrides: list[str]):
    """The ``--dry_run`` memory plan of ``examples/config/<config_name>.yaml`` (with ``preset``'s
    config.json as its model)."""
    from roll.configs.loader import load_config
    from roll.distributed.scheduler.placement import plan_placement
    from roll.planner.devices import device_capacity
    from roll.planner.report import plan_memory

    if preset:
        from roll.models.random_checkpoint import preset_config

        tmp = Path(tempfile.mkdtemp())
        (tmp / "config.json").write_text(preset_config(preset, layers).to_json_string())
        overrides = [f"pretrain={tmp}", *overrides]
    config = load_config(CONFIGS / f"{config_name}.yaml", overrides)
    capacity, source = device_capacity(config, probe=False)
    return plan_memory(config, plan_placement(config), capacity, source)


def set_fraction(role) -> bool:
    """Whether the planner's figure for this role is the configured fraction of the device (an
    engine sized by ``gpu_memory_utilization`` / ``mem_fraction_static``), which agrees by
    construction; a vLLM engine given ``kv_cache_memory_gb`` is predicted from its parts instead."""
    return role.strategy in ENGINES and role.knob_for("engine").endswith(FRACTION_KNOBS)


def run_rows(metrics: Path, report, label: str, left_out: list[str]) -> list[Row]:
    """Rows of one run: its roles' allocator peaks and its device groups' used memory."""
    peaks = measured_peaks(metrics)
    rows = []
    for group in report.groups:
        ids = f"{group.devices[0]}-{group.devices[-1]}" if len(group.devices) > 1 else f"{group.devices[0]}"
        for role in group.roles:
            measured = peaks.pop(f"memory/{role.role}/peak_allocated_gib", None)
            if set_fraction(role):
                left_out.append(f"{label}: {role.role} ({role.strategy}: a set fraction of the device)")
            elif measured is not None:
                rows.append(Row(label, f"{role.role} (alloc)", sum(role.parts.values()) / GIB, measured))
        device_peaks = [peaks.pop(f"memory/device{d}/peak_used_gib", None) for d in group.devices]
        measured = max((p for p in device_peaks if p is not None), default=None)
        running, predicted = group.peak()
        if set_fraction(next(r for r in group.roles if r.role == running)):
            left_out.append(f"{label}: device {ids} (its predicted peak is {running}'s engine fraction)")
        elif measured is not None:
            rows.append(Row(label, f"device {ids} (device)", predicted / GIB, measured))
    left_out += [f"{label}: {key} (not predicted)" for key in sorted(peaks)]
    return rows


# ------------------------------------------------------------------------------------- output
def table(rows: list[Row], left_out: list[str]) -> str:
    lines = [
        "| run | role / device (measured as) | predicted GiB | measured GiB | error |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        flag = "" if abs(r.error) <= TOLERANCE else " **"
        lines.append(
            f"| {r.run} | {r.measured_as} | {r.predicted_gib:.1f} | {r.measured_gib:.1f} | {r.error:+.0%}{flag} |"
        )
    within = sum(abs(r.error) <= TOLERANCE for r in rows)
    lines.append(f"\n{within} of {len(rows)} within {TOLERANCE:.0%} (`**`: outside).")
    lines += [f"left out: {line}" for line in left_out]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--baseline", nargs="*", type=Path, default=[], help="benchmarks/baselines/<gpu>.json"
    )
    parser.add_argument("--train_step", nargs="*", type=Path, default=[], help="megatron_train_step --out")
    parser.add_argument("--run", type=Path, help="a pipeline run's metrics.jsonl")
    parser.add_argument("--config_name", help="the run's config in examples/config (with --run)")
    parser.add_argument("--preset", help="plan with this preset's config.json as the model (with --run)")
    parser.add_argument("--layers", type=int, help="the preset's layer count, if the run changed it")
    parser.add_argument("overrides", nargs="*", help="key=value overrides the run was started with")
    args = parser.parse_args(argv)
    if not (args.baseline or args.train_step or args.run):
        parser.error("give --baseline, --train_step or --run (nothing to compare)")
    if args.run and not args.config_name:
        parser.error("--run needs --config_name: the config the run was started with")
    left_out: list[str] = []
    rows = [r for path in args.baseline for r in baseline_rows(path, left_out)]
    rows += [r for path in args.train_step for r in train_step_rows(path, left_out)]
    if args.run:
        report = planned(args.config_name, args.preset, args.layers, args.overrides)
        rows += run_rows(args.run, report, args.config_name, left_out)
    print(table(rows, left_out))


if __name__ == "__main__":
    main()
