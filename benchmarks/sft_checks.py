"""The SFT pipeline's GPU checks (docs/sft.md, "What ran"): a Qwen3-MoE-shaped model at EP2 with
the router frozen and not, and a dense model trained by megatron_train beside fsdp2_train on the
same data. Random weights at real shapes (``roll.models.random_checkpoint``), the default example's
tokenizer and SFT data; each run is ``examples/start_sft_pipeline.py`` on a config written here.

    python examples/prepare_default_example.py                 # tokenizer + data (once)
    python benchmarks/sft_checks.py --out output/sft_checks    # 2 GPUs: both cases
    python benchmarks/sft_checks.py --case moe --out DIR       # one case

Checks (exit 1 if one fails):
- moe: the training loss falls in both runs; frozen: every router weight of the exported model
  equals the starting checkpoint's bit for bit; not frozen: they moved.
- dense: megatron_train (TP2, two micro-batches) and fsdp2_train (DP2) take the same rows each step;
  their training losses agree to 1e-3 over the first 4 steps and their last-10-step means within
  ``--tolerance`` (relative; see ``compare_curves``).
``--tiny`` shrinks both models to test size (for a CPU run of the plumbing with ``--device cpu``,
where megatron_train needs the test shims: ROLL_TEST_MEGATRON_CPU=1 and tests/megatron/ray_cpu_shim
on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from roll.utils.tracking import read_metrics  # noqa: E402

EXAMPLE = REPO / "output" / "default_example"


def make_model(preset: str, layers: int | None, out: Path, device: str, **overrides: Any) -> Path:
    """A random checkpoint of ``preset`` with the default example's tokenizer (kept when present)."""
    from roll.models.random_checkpoint import write_random_checkpoint

    if not (out / "config.json").exists():
        write_random_checkpoint(preset, out, layers, EXAMPLE / "sft_model", device, 0, **overrides)
    return out


def sft_config(
    name: str,
    out: Path,
    model: Path,
    args: argparse.Namespace,
    strategy: str,
    layout: dict,
    batch: int,
    accum: int,
) -> Path:
    """A config file for one run: ``batch`` rows per rank and micro-batch, ``accum`` micro-batches."""
    raw = {
        "exp_name": name,
        "seed": 0,
        "output_dir": str(out / name),
        "overwrite_output_dir": True,
        "track_with": "none",
        "device": args.device,
        "num_gpus_per_node": 2,
        "max_steps": args.steps,
        "eval_steps": args.steps,
        "save_steps": 0,
        "logging_steps": 1,
        "data": {
            "train_files": [str(EXAMPLE / "data" / "sft.jsonl")],
            "val_files": [str(EXAMPLE / "data" / "val.jsonl")],
            "response_key": "solution",
            "max_length": 96,
        },
        "actor_train": {
            "model_args": {"model_name_or_path": str(model), "dtype": args.dtype},
            "training_args": {
                "learning_rate": args.lr,
                "lr_scheduler_type": "constant",
                "warmup_steps": 0,
                "weight_decay": 0.0,
                "max_grad_norm": 1.0,
                "per_device_train_batch_size": batch,
                "gradient_accumulation_steps": accum,
            },
            "strategy_args": {"strategy_name": strategy, "strategy_config": layout},
            "device_mapping": "0-1",
        },
    }
    path = out / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def run_sft(config: Path) -> dict[str, Any]:
    """Run the pipeline on ``config``; its per-step training losses, last validation loss, wall time."""
    start = time.perf_counter()
    cmd = [sys.executable, str(REPO / "examples" / "start_sft_pipeline.py")]
    cmd += ["--config_path", str(config.parent), "--config_name", config.stem]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-6000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"{config.stem}: exit {done.returncode}")
    run_dir = Path(yaml.safe_load(config.read_text())["output_dir"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    step_s = [r["time/train"] for r in rows if "time/train" in r][1:]
    return {
        "losses": losses,
        "val": val,
        "wall_s": wall,
        "step_s": sum(step_s) / max(len(step_s), 1),
        "hf_model": run_dir / "hf_model",
    }


def router_weights(model_dir: Path) -> dict[str, Any]:
    """Every MoE router weight (``mlp.gate.weight``) of a safetensors checkpoint."""
    from safetensors import safe_open

    out = {}
    for part in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(part), framework="pt") as f:
            out |= {k: f.get_tensor(k) for k in f.keys() if k.endswith("mlp.gate.weight")}
    return out


def case_moe(out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.tiny:
        model = make_model("tiny-qwen3-moe", 2, out / "moe_model", args.init_device)
    else:  # Qwen3-30B-A3B's layer (128 experts, top 8) cut to a few layers
        model = make_model("qwen3-30b-a3b", args.moe_layers, out / "moe_model", args.init_device)
    start = router_weights(model)
    rows = []
    for frozen in (True, False):
        layout = {
            "expert_model_parallel_size": 2,
            "freeze_moe_router": frozen,
            "use_distributed_optimizer": True,
        }
        name = f"moe_ep2_{'frozen' if frozen else 'trained'}"
        result = run_sft(sft_config(name, out, model, args, "megatron_train", layout, args.batch, 1))
        end = router_weights(result["hf_model"])
        moved = max(float((end[k].float() - start[k].float()).abs().max()) for k in start)
        falls = result["losses"][-1] < result["losses"][0] - 0.5
        ok = falls and (moved == 0.0 if frozen else moved > 0.0)
        rows.append(
            {
                "run": name,
                "loss first -> last": f"{result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}",
                "val loss": f"{result['val'][-1]:.3f}" if result["val"] else "-",
                "router max |change|": f"{moved:.3g} ({len(start)} routers)",
                "train s/step": f"{result['step_s']:.3f}",
                "wall s": f"{result['wall_s']:.0f}",
                "check": "ok" if ok else "FAILED",
            }
        )
    return rows


def case_dense(out: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.tiny:
        model = make_model(
            "qwen2.5-1.5b", 2, out / "dense_model", args.init_device,
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
        )  # fmt: skip
    else:
        model = make_model("qwen2.5-1.5b", None, out / "dense_model", args.init_device)
    # The same 2 x batch rows per step: megatron TP2 (DP1) in two micro-batches, FSDP2 over two ranks.
    megatron = run_sft(
        sft_config("dense_megatron_tp2", out, model, args, "megatron_train",
                   {"tensor_model_parallel_size": 2}, args.batch, 2)
    )  # fmt: skip
    fsdp2 = run_sft(
        sft_config(
            "dense_fsdp2_dp2", out, model, args, "fsdp2_train", {"sharding": "full_shard"}, args.batch, 1
        )
    )
    ok, verdict = compare_curves(megatron["losses"], fsdp2["losses"], args.tolerance)
    rows = []
    for name, result in (("dense_megatron_tp2", megatron), ("dense_fsdp2_dp2", fsdp2)):
        rows.append(
            {
                "run": name,
                "loss first -> last": f"{result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}",
                "val loss": f"{result['val'][-1]:.3f}" if result["val"] else "-",
                "router max |change|": "-",
                "train s/step": f"{result['step_s']:.3f}",
                "wall s": f"{result['wall_s']:.0f}",
                "check": verdict + (": ok" if ok else ": FAILED"),
            }
        )
    (out / "dense_losses.json").write_text(
        json.dumps({"megatron_tp2": megatron["losses"], "fsdp2_dp2": fsdp2["losses"]})
    )
    return rows


def compare_curves(a: list[float], b: list[float], tolerance: float, early: int = 4) -> tuple[bool, str]:
    """Whether two runs' per-step training losses agree: the first ``early`` steps within 1e-3
    (relative; same weights and rows, so only rounding differs), and the means of the last 10 steps
    within ``tolerance`` (relative). Later steps are not compared one by one: from random weights,
    Adam turns rounding differences in near-zero gradients into full-size updates (lr x sign), so
    single steps drift apart by a few percent in fp32 as in bf16 while the curves keep together."""
    if len(a) != len(b) or len(a) < early + 10:
        return False, f"{len(a)} vs {len(b)} steps (need >= {early + 10} each)"
    first = max(abs(x - y) / abs(y) for x, y in zip(a[:early], b[:early]))
    tail_a, tail_b = sum(a[-10:]) / 10, sum(b[-10:]) / 10
    tail = abs(tail_a - tail_b) / tail_b
    falls = a[-1] < a[0] - 0.5 and b[-1] < b[0] - 0.5
    ok = first <= 1e-3 and tail <= tolerance and falls
    step_max = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    return ok, (
        f"steps 1-{early} rel. diff {first:.1e}; last-10 means {tail_a:.3f} vs {tail_b:.3f} "
        f"({tail:.1%}); any single step <= {step_max:.1%}"
    )


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="output/sft_checks")
    parser.add_argument("--case", choices=("moe", "dense", "all"), default="all")
    parser.add_argument("--device", default="cuda", help="the configs' device (cuda or cpu)")
    parser.add_argument(
        "--init_device", default=None, help="where random weights are drawn (default: --device)"
    )
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="rows per rank and micro-batch")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--moe_layers", type=int, default=4)
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.03,
        help="dense: relative difference of the last-10-step mean losses",
    )
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    args.init_device = args.init_device or args.device
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if args.case in ("moe", "all"):
        rows += case_moe(out, args)
        print(table(rows), flush=True)
    if args.case in ("dense", "all"):
        rows += case_dense(out, args)
    print(table(rows))
    (out / "table.md").write_text(table(rows) + "\n")
    return 0 if all(r["check"].endswith("ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
