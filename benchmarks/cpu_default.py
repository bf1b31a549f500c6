"""The default example on CPU: start-up, per-stage and per-step times, wall time; optionally beside
TRL's single-process GRPOTrainer on the same task.

    python examples/prepare_default_example.py              # once: data, tokenizer, SFT model
    python benchmarks/cpu_default.py --steps 20              # runs rlvr_config, prints the table
    python benchmarks/cpu_default.py --metrics output/rlvr-default/metrics.jsonl   # a finished run
    python benchmarks/cpu_default.py --steps 20 --trl [--trl_path DIR]   # + TRL, when importable

The roll run is ``examples/config/rlvr_config.yaml`` as shipped, with ``max_steps=--steps``,
validation and checkpoints off (``eval_steps=0 save_steps=0``, as TRL runs neither) and its own
``output_dir``. The headline, measured alike for both frameworks, is the **loop's wall time per
step**: from the start of the first step to the end of the last, over the number of steps (the first
step included, validation left out). For roll that is the last step's ``perf/wall_s`` less
``startup/to_first_step_s`` (both process ages) less every step's ``time/validation``; for TRL, the
first ``on_step_begin`` to the last ``on_step_end``. Beside it, each
framework's own per-step timer over steps 2.. (step 1 holds one-off warm-up): roll's stage sum
(``time/step`` less validation: it leaves out what runs between stages, such as logging and the
metrics of a step), TRL's step callback. Per stage: the mean over steps 2.., from ``time/<stage>``;
start-up is ``startup/to_first_step_s`` (process start to the first step) and its phases; "process
wall" is the process's whole life, shutdown included.

The TRL row (``--trl``; trl is not a roll dependency: install it, e.g. into ``--trl_path`` with
``pip install --target DIR trl``) trains the same SFT model on the same prompts with roll's
``math_rule`` reward: 16 prompts x 8 samples a step, 32-token responses, lr 1e-4 constant after 10
warm-up steps, beta (KL) 0.001, one optimizer step on all 128 samples, fp32, one process with
``torch.set_num_threads(2)``. Its step is the trainer's step (generation, reference, loss,
optimizer), timed by a callback; its loop wall time as above.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "output" / "default_example"
sys.path.insert(0, str(REPO))

STAGES = ("generate", "reward", "reference", "old_log_probs", "advantages", "train", "model_update")
PHASES = ("launch", "data", "ray", "workers", "initialize", "model_update_setup", "first_sync", "validation")


class CpuMeter:
    """CPU seconds (user + system) of a process and all its descendants (Ray's GCS, raylet and
    workers are the driver's), sampled every ``period`` s, with the sample times counted from the
    process's start: a measure of work that other load on the machine does not inflate much."""

    def __init__(self, proc: subprocess.Popen, period: float = 0.25, metrics: Path | None = None):
        import psutil

        self.root = psutil.Process(proc.pid)
        self.born = self.root.create_time()
        self.metrics = metrics
        self.samples: list[tuple[float, float]] = []  # (process age, CPU seconds so far)
        self.lines: list[tuple[float, int]] = []  # (process age, lines in metrics.jsonl)
        self.per_pid: dict[int, float] = {}
        self.period = period
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        import psutil

        while True:
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for proc in procs:
                try:
                    t = proc.cpu_times()
                except psutil.Error:
                    continue
                used = t.user + t.system + t.children_user + t.children_system
                self.per_pid[proc.pid] = max(self.per_pid.get(proc.pid, 0.0), used)
            age = time.time() - self.born
            self.samples.append((age, sum(self.per_pid.values())))
            if self.metrics is not None and self.metrics.exists():
                self.lines.append((age, self.metrics.read_text().count("\n")))
            time.sleep(self.period)

    def line_ages(self) -> list[float]:
        """When each line of metrics.jsonl appeared (process ages): step ends, for any roll version."""
        ages: list[float] = []
        for age, count in self.lines:
            while len(ages) < count:
                ages.append(age)
        return ages

    def between(self, start_age: float, end_age: float) -> float:
        """CPU seconds used between two process ages (the nearest samples)."""

        def at(age: float) -> float:
            return min(self.samples, key=lambda s: abs(s[0] - age))[1]

        return at(end_age) - at(start_age)


def run_roll(steps: int, out: Path, overrides: list[str], repo: Path = REPO) -> tuple[Path, float, CpuMeter]:
    """Run the default example of the checkout ``repo`` for ``steps`` steps; (its metrics.jsonl,
    wall seconds, CPU meter)."""
    cmd = [
        sys.executable,
        str(repo / "examples" / "start_rlvr_pipeline.py"),
        "--config_name",
        "rlvr_config",
        f"max_steps={steps}",
        "eval_steps=0",
        "save_steps=0",
        "track_with=none",
        f"output_dir={out}",
        "overwrite_output_dir=true",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(repo), "TOKENIZERS_PARALLELISM": "false"}
    out.parent.mkdir(parents=True, exist_ok=True)
    if (out / "metrics.jsonl").exists():
        (out / "metrics.jsonl").unlink()  # the meter counts this run's lines
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=env)
    meter = CpuMeter(proc, metrics=out / "metrics.jsonl")
    if proc.wait():
        raise SystemExit(f"the roll run failed (exit code {proc.returncode})")
    return out / "metrics.jsonl", time.perf_counter() - start, meter


def summarize_roll(metrics: Path, wall: float | None, meter: CpuMeter | None = None) -> dict[str, float]:
    """Start-up phases, per-stage means over steps 2.. (all steps when there is only one), per
    step mean and wall time from a run's metrics.jsonl; CPU seconds per step with ``meter``."""
    from roll.utils.tracking import read_metrics

    rows = read_metrics(metrics)
    steps = [r for r in rows if "time/step" in r]
    if not steps:
        raise SystemExit(f"{metrics}: no training steps")
    timed = steps[1:] or steps
    out = {f"startup/{p}": v for r in rows for p in PHASES if (v := r.get(f"startup/{p}_s")) is not None}
    first = next((r["startup/to_first_step_s"] for r in rows if "startup/to_first_step_s" in r), None)
    if first is not None:
        out["startup"] = first
    for stage in STAGES:
        out[stage] = statistics.mean(r.get(f"time/{stage}", 0.0) for r in timed)
    # time/step sums every stage of the step, validation included; the table leaves it out.
    out["stage_sum"] = statistics.mean(r["time/step"] - r.get("time/validation", 0.0) for r in timed)
    loop = loop_wall_per_step(rows)
    if loop is not None:
        out["loop_wall_per_step"] = loop
    out["steps"] = float(len(steps))
    ends = meter.line_ages() if meter is not None else []
    if len(ends) == len(rows) and len(steps) > 1:  # one line per step (validation off)
        out["cpu_per_step"] = meter.between(ends[-len(steps)], ends[-1]) / (len(steps) - 1)
        out["startup"] = out.get("startup", ends[-len(steps)] - steps[0]["time/step"])
    if meter is not None and "startup" in out:  # the whole process tree up to the first step
        out["startup_cpu"] = meter.between(0.0, out["startup"])
    out["wall"] = wall if wall is not None else steps[-1].get("perf/wall_s", float("nan"))
    scores = [r["critic/score/mean"] for r in steps if "critic/score/mean" in r]
    if scores:
        out["reward_first"], out["reward_last"] = scores[0], statistics.mean(scores[-3:])
    return out


def loop_wall_per_step(rows: list[dict]) -> float | None:
    """The training loop's wall seconds per step from a run's metrics rows: the last step's
    ``perf/wall_s`` less ``startup/to_first_step_s`` (process ages at the loop's end and start), less
    the validation inside the loop, over the steps; None for a run that did not record both ages."""
    steps = [r for r in rows if "time/step" in r]
    start = next((r["startup/to_first_step_s"] for r in rows if "startup/to_first_step_s" in r), None)
    if not steps or start is None or "perf/wall_s" not in steps[-1]:
        return None
    validation = sum(r.get("time/validation", 0.0) for r in steps)
    return (steps[-1]["perf/wall_s"] - start - validation) / len(steps)


def run_trl(steps: int, trl_path: str | None, model: Path) -> dict[str, float]:
    """TRL's GRPOTrainer on the same task in its own process (see the module docstring)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (trl_path, str(REPO)) if p)
    env.pop("OMP_NUM_THREADS", None)
    start = time.perf_counter()
    cmd = [sys.executable, __file__, "--_trl_child", str(steps), str(model)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    meter = CpuMeter(proc)
    stdout, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"the TRL run failed (exit code {proc.returncode})")
    wall = time.perf_counter() - start
    result = json.loads(stdout.strip().splitlines()[-1])
    ages = result.pop("step_end_ages")
    if len(ages) > 1:
        result["cpu_per_step"] = meter.between(ages[0], ages[-1]) / (len(ages) - 1)
    return result | {"wall": wall}


def _dataset(rows: list[dict]):
    """A ``datasets.Dataset`` of ``rows`` with a random fingerprint: hashing the table failed to
    pickle a pyarrow type with datasets 5.2 + pyarrow 26 here."""
    import datasets.arrow_dataset as arrow_dataset
    import datasets.fingerprint as fingerprint

    arrow_dataset.generate_fingerprint = lambda dataset: fingerprint.generate_random_fingerprint()
    return arrow_dataset.Dataset.from_list(rows)


def _trl_child(steps: int, model_dir: str) -> None:
    """Inside the TRL process: train, print one JSON line of timings."""
    import psutil
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from roll.pipeline.rewards.math_rule import math_rule_reward

    born = psutil.Process().create_time()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    rows = [json.loads(line) for line in (EXAMPLE / "data" / "train.jsonl").read_text().splitlines()]
    dataset = _dataset([{"prompt": r["messages"], "ground_truth": r["ground_truth"]} for r in rows])

    def reward(completions, ground_truth, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [math_rule_reward(t, g) for t, g in zip(texts, ground_truth)]

    class Timer(TrainerCallback):
        def __init__(self):
            self.begin: list[float] = []
            self.ends: list[float] = []
            self.times: list[float] = []
            self.rewards: list[float] = []
            self.end_ages: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())
            self.times.append(self.ends[-1] - self.begin[-1])
            self.end_ages.append(time.time() - born)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(logs["reward"])

    config = GRPOConfig(
        output_dir=str(REPO / "output" / "trl-default"),
        per_device_train_batch_size=128,
        gradient_accumulation_steps=1,
        num_generations=8,
        max_completion_length=32,
        learning_rate=1e-4,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.001,
        temperature=1.0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    timer = Timer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    import trl

    timed = timer.times[1:] or timer.times
    print(
        json.dumps(
            {
                "startup": timer.begin[0] - time.perf_counter() + (time.time() - born),
                "step_timer": statistics.mean(timed),
                "loop_wall_per_step": (timer.ends[-1] - timer.begin[0]) / len(timer.ends),
                "steps": float(len(timer.times)),
                "reward_first": timer.rewards[0] if timer.rewards else float("nan"),
                "reward_last": statistics.mean(timer.rewards[-3:]) if timer.rewards else float("nan"),
                "version": trl.__version__,
                "step_end_ages": timer.end_ages,
            }
        )
    )


def table(roll: dict[str, float], trl: dict[str, float] | None) -> str:
    head = ["", "roll rlvr_config"] + (["TRL GRPOTrainer"] if trl else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(name: str, key: str, fmt: str = "{:.2f}") -> None:
        if key not in roll and not (trl and key in trl):
            return
        cells = [fmt.format(roll[key]) if key in roll else "-"]
        if trl:
            cells.append(fmt.format(trl[key]) if key in trl else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    row("start-up to the first step, s", "startup")
    for phase in PHASES:
        row(f"  {phase}, s", f"startup/{phase}")
    row("CPU seconds to the first step (all processes)", "startup_cpu", "{:.1f}")
    for stage in STAGES:
        row(f"{stage}, s/step", stage, "{:.3f}")
    row("**loop wall per step (all steps, validation out), s**", "loop_wall_per_step", "{:.3f}")
    row("stage sum per step (roll, steps 2..), s", "stage_sum", "{:.3f}")
    row("step callback (TRL, steps 2..), s", "step_timer", "{:.3f}")
    row("CPU seconds per step (all processes)", "cpu_per_step", "{:.2f}")
    row("steps", "steps", "{:.0f}")
    row("process wall, s", "wall", "{:.1f}")
    row("reward, first step", "reward_first", "{:.3f}")
    row("reward, mean of last 3", "reward_last", "{:.3f}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--_trl_child":
        _trl_child(int(sys.argv[2]), sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--metrics", type=Path, help="summarize this metrics.jsonl instead of running")
    parser.add_argument("--out", type=Path, default=REPO / "output" / "bench-cpu-default")
    parser.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (needs trl)")
    parser.add_argument("--trl_path", help="a directory holding trl and its dependencies (pip --target)")
    parser.add_argument("--repo", type=Path, default=REPO, help="the roll checkout to run (A/B runs)")
    parser.add_argument("--model", type=Path, default=EXAMPLE / "sft_model", help="both runs' model")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for the roll run")
    args = parser.parse_args()
    if args.metrics:
        roll = summarize_roll(args.metrics, None)
    else:
        overrides = [f"pretrain={args.model.resolve()}", *args.overrides]
        metrics, wall, meter = run_roll(args.steps, args.out.resolve(), overrides, args.repo.resolve())
        roll = summarize_roll(metrics, wall, meter)
    trl = run_trl(args.steps, args.trl_path, args.model) if args.trl else None
    if trl:
        print(f"TRL {trl.pop('version')}")
    print(table(roll, trl))


if __name__ == "__main__":
    main()
