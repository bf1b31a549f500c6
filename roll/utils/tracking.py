"""Metrics out of a run: console lines, metrics.jsonl (always), TensorBoard, W&B, and a PNG at the end.

>>> tracker = Tracker(config, run_dir)
>>> tracker.log({"critic/score/mean": 0.4}, step=1)
>>> tracker.finish()   # writes curves.png next to metrics.jsonl

metrics.jsonl is strict JSON, one whole line per step, flushed and fsync'd: a non-finite value
(NaN, inf) is written as ``null``; a full disk is one ``StorageError`` line and leaves no partial
line; a cut-off last line left by a crash is dropped with a warning when the run resumes.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from roll.configs.pipeline_config import RLVRConfig
from roll.core.errors import StorageError
from roll.utils.atomic_io import append_line_durably, disk_full_as, write_file_durably

logger = logging.getLogger("roll")

# ``track_with`` -> the package it needs (None: metrics.jsonl only, which is always written).
TRACKERS: dict[str, str | None] = {"tensorboard": "tensorboard", "wandb": "wandb", "none": None}

CONSOLE_KEYS = (
    "critic/score/mean",
    "val/score/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "response_length/mean",
    "rollout/logprob_mismatch",
    "time/step",
)


class Tracker:
    def __init__(self, config: RLVRConfig, run_dir: Path, resume_step: int = 0):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.run_dir / "metrics.jsonl"
        self.logging_steps = max(config.logging_steps, 1)
        self._truncate_after(resume_step)
        self.tb = self._tensorboard(config) if config.track_with == "tensorboard" else None
        self.wandb = self._wandb(config) if config.track_with == "wandb" else None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        strict = {k: v if math.isfinite(v) else None for k, v in clean.items()}
        line = json.dumps({"step": step, **strict}, sort_keys=True, allow_nan=False) + "\n"
        with disk_full_as(StorageError, self.jsonl):
            append_line_durably(self.jsonl, line)
        if self.tb is not None:
            with disk_full_as(StorageError, self.tb_dir):  # the writer's thread raises it here
                for key, value in clean.items():
                    self.tb.add_scalar(key, value, step)
                self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if step % self.logging_steps == 0 or any(k.startswith("val/") for k in clean):
            shown = " ".join(f"{k}={clean[k]:.4g}" for k in CONSOLE_KEYS if k in clean)
            logger.info("step %d | %s", step, shown)

    def finish(self) -> Path | None:
        if self.tb is not None:
            with disk_full_as(StorageError, self.tb_dir):
                self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        return plot_curves(self.jsonl, self.run_dir / "curves.png")

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint so the file reads as one run."""
        if not self.jsonl.exists():
            return
        rows = read_metrics(self.jsonl)
        kept = [r for r in rows if r["step"] <= step] if step else []
        with disk_full_as(StorageError, self.jsonl):
            write_file_durably(self.jsonl, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def _tensorboard(self, config: RLVRConfig):
        from torch.utils.tensorboard import SummaryWriter

        self.tb_dir = Path(config.tracker_kwargs.get("log_dir", self.run_dir / "tensorboard"))
        with disk_full_as(StorageError, self.tb_dir):  # a full disk: one line naming the directory
            return SummaryWriter(log_dir=str(self.tb_dir))

    def _wandb(self, config: RLVRConfig):
        import wandb

        kwargs = {"project": "roll", "name": config.exp_name, **config.tracker_kwargs}
        run = wandb.init(config={"exp_name": config.exp_name}, **kwargs)
        return run


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl. A last line that does not parse (a write cut off by a crash)
    is left out with a warning; any other bad line is a ``StorageError`` naming ``file:line``."""
    lines = Path(path).read_text(errors="replace").split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a metrics row (no 'step')")
        except ValueError as exc:
            if not any(rest.strip() for rest in lines[number:]):
                logger.warning("%s:%d: dropping a cut-off last line (%s)", path, number, exc)
                break
            raise StorageError(f"{path}:{number}: {exc}") from None
        rows.append(row)
    return rows


def plot_curves(jsonl: Path, out: Path) -> Path | None:
    """Reward (train) and validation score against step, one PNG."""
    if not jsonl.exists():
        return None
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed: no %s (the metrics are in %s)", out, jsonl)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl)
    series = {
        "train reward (critic/score/mean)": "critic/score/mean",
        "validation score (val/score/mean)": "val/score/mean",
    }
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = False
    for label, key in series.items():
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
            plotted = True
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.grid(alpha=0.3)
    if plotted:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True
