"""Predicted (roll/planner) against measured peak memory of the GPU runs recorded in docs/.

    python benchmarks/memory_plan_check.py        # prints the markdown table of docs/memory_planner.md

Measured numbers are copied from docs/benchmarks.md and docs/megatron.md, each with its kind:
``alloc`` is a process's ``torch.cuda.max_memory_allocated`` (compared with the role's predicted
tensors, without the process overhead), ``device`` the device-wide used memory (compared with the
predicted device peak, overheads included). Shipped configs are planned as ``--dry_run`` plans them,
with a config.json of the preset the run used.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.megatron_train_step import small_moe  # noqa: E402
from roll.configs.loader import load_config  # noqa: E402
from roll.distributed.scheduler.placement import plan_placement  # noqa: E402
from roll.models.random_checkpoint import preset_config  # noqa: E402
from roll.planner import memory as mem  # noqa: E402
from roll.planner.model_shape import shape_from_config  # noqa: E402
from roll.planner.report import plan_memory  # noqa: E402
from roll.planner.roles import CONTEXT_BYTES  # noqa: E402

GIB = mem.GIB
H200 = int(140.4 * GIB)
CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "config"


def train_step_rows() -> list[tuple[str, str, float, float]]:
    """benchmarks/megatron_train_step.py: one rank's allocator peak, 8 micro-batches of 4096 tokens."""
    cases = [
        ("Qwen2.5-1.5B, 1 GPU", preset_config("qwen2.5-1.5b"), mem.Split(), 1, False, 51.8),
        # Re-measured with the chunked log-probs (H100, 2026-11-24; docs/memory_planner.md).
        (
            "Qwen2.5-1.5B, 1 GPU, chunked log-probs",
            preset_config("qwen2.5-1.5b"),
            mem.Split(),
            1,
            False,
            43.7,
        ),
        ("Qwen2.5-7B 16 layers, 1 GPU", preset_config("qwen2.5-7b", 16), mem.Split(), 1, False, 101.8),
        # benchmarks/memory_train_cases.py (H200, 2026-11-24), one case per process.
        ("MoE 3.2B, 1 GPU", small_moe(), mem.Split(), 1, False, 68.0),
        ("Qwen2.5-1.5B, DP2 dist-opt", preset_config("qwen2.5-1.5b"), mem.Split(), 2, True, 43.2),
        ("MoE 3.2B, EP2 DP2 dist-opt", small_moe(), mem.Split(ep=2), 2, True, 61.2),
        (
            "Qwen2.5-7B, TP2 SP",
            preset_config("qwen2.5-7b"),
            mem.Split(tp=2, sequence_parallel=True),
            1,
            False,
            113.2,
        ),
    ]
    rows = []
    recompute = mem.megatron_train(
        shape_from_config(preset_config("qwen2.5-1.5b").to_dict()),
        mem.Split(vocab_multiple=128),
        1,
        2,
        4096,
        True,
        False,
    )
    rows.append(
        (
            "train step: Qwen2.5-1.5B full recompute, 1 GPU",
            "actor_train (alloc)",
            sum(recompute.values()) / GIB,
            31.8,
        )
    )
    for name, cfg, split, dp, dist, measured in cases:
        split = mem.Split(
            split.tp, ep=split.ep, etp=split.tp, sequence_parallel=split.sequence_parallel, vocab_multiple=128
        )
        parts = mem.megatron_train(shape_from_config(cfg.to_dict()), split, dp, 2, 4096, False, dist)
        rows.append((f"train step: {name}", "actor_train (alloc)", sum(parts.values()) / GIB, measured))
    return rows


def rollout_rows() -> list[tuple[str, str, float, float]]:
    """benchmarks/rollout.py, one H200: 256 prompts of 128 tokens a call, 512 new tokens; device used."""
    shape = shape_from_config(preset_config("qwen2.5-1.5b").to_dict())
    weights = shape.total_params() * 2
    hf = weights + sum(mem.generation_bytes(shape, 256, 128, 640, mem.Split(), kv_copies=2).values())
    meg = weights + sum(mem.generation_bytes(shape, 256, 128, 640, mem.Split(vocab_multiple=128)).values())
    return [
        ("rollout: vllm, gpu_memory_utilization 0.85", "actor_infer (device)", 0.85 * H200 / GIB, 119.7),
        ("rollout: hf_infer", "actor_infer (device)", (hf + CONTEXT_BYTES) / GIB, 12.9),
        ("rollout: megatron_infer", "actor_infer (device)", (meg + CONTEXT_BYTES) / GIB, 19.9),
    ]


def planned(name: str, preset: str, layers: int | None, overrides: list[str]):
    """The dry-run memory plan of a shipped config, its model a config.json of ``preset``."""
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(preset_config(preset, layers).to_json_string())
    config = load_config(CONFIGS / f"{name}.yaml", [f"pretrain={tmp}", *overrides])
    return plan_memory(config, plan_placement(config), H200, "H200")


def pipeline_rows() -> list[tuple[str, str, float, float]]:
    rows = []
    moe = planned("qwen3-30B-A3B-rlvr_megatron_4gpus", "qwen3-30b-a3b", 4, ["response_length=128"])
    group = moe.groups[0]
    for role, measured in (("actor_train", 18.4), ("actor_infer", 6.5), ("reference", 3.6)):
        r = next(r for r in group.roles if r.role == role)
        rows.append(
            ("30B-A3B 4 layers, colocated, 4 GPUs", f"{role} (alloc)", sum(r.parts.values()) / GIB, measured)
        )
    rows.append(("30B-A3B 4 layers, colocated, 4 GPUs", "device 0-3 (device)", group.peak()[1] / GIB, 48.3))
    disagg = planned("qwen3-30B-A3B-rlvr_megatron_4gpus_disagg", "qwen3-30b-a3b", 4, ["response_length=128"])
    for group, measured in zip(disagg.groups, (53.9, 16.6)):
        ids = f"{group.devices[0]}-{group.devices[-1]}"
        rows.append(
            ("30B-A3B 4 layers, disaggregated", f"device {ids} (device)", group.peak()[1] / GIB, measured)
        )
    name = "qwen2.5-1.5B-rlvr_megatron_vllm_2gpus"
    vllm = planned(name, "qwen2.5-1.5b", None, [])
    rows.append(
        ("1.5B RLVR 2 GPUs, vllm colocated", "device 0-1 (device)", vllm.groups[0].peak()[1] / GIB, 88.3)
    )
    infer = "actor_infer.strategy_args={strategy_name: megatron_infer, strategy_config: {tensor_model_parallel_size: 1}}"
    meg = planned(name, "qwen2.5-1.5b", None, [infer])
    rows.append(
        (
            "1.5B RLVR 2 GPUs, megatron_infer colocated",
            "device 0-1 (device)",
            meg.groups[0].peak()[1] / GIB,
            47.3,
        )
    )
    return rows


def main() -> None:
    print("| run | role / device (measured as) | predicted GiB | measured GiB | error |")
    print("|---|---|---:|---:|---:|")
    for run, role, predicted, measured in train_step_rows() + rollout_rows() + pipeline_rows():
        error = (predicted - measured) / measured
        flag = "" if abs(error) <= 0.15 else " **"
        print(f"| {run} | {role} | {predicted:.1f} | {measured:.1f} | {error:+.0%}{flag} |")


if __name__ == "__main__":
    main()
