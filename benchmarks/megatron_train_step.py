"""Whole ``megatron_train`` step (forward, backward, grad sync, clip, optimizer) in tokens/s and MFU.

Random weights of Qwen2.5-1.5B / Qwen2.5-7B / a small Qwen3-MoE architecture, sequences of 4096
tokens (512 prompt + 3584 response), micro-batch 1, 8 micro-batches per optimizer step, bf16
with fp32 main params and Adam, through ``MegatronTrainStrategy.train_step`` with a PPO-clip loss
on the vocab-parallel log-probs. MFU = model FLOPs / (step time x GPUs x peak), printed twice:
``MFU (datasheet)`` against the datasheet dense bf16 peak (989 TFLOP/s for H100/H200 SXM, as the
field reports MFU) and ``MFU (measured peak)`` against an 8192^3 bf16 matmul timed on the same device
in the same run. Model FLOPs count 6 x matmul parameters per token (MoE: the activated experts), the
LM head, and causal attention (2 x 2 x seq/2 x heads x head_dim per token forward, x3 for
training); recompute is not counted. The ``layers`` column says how many decoder layers ran.

    torchrun --nproc_per_node 1 benchmarks/megatron_train_step.py --out one.json
    torchrun --nproc_per_node 2 benchmarks/megatron_train_step.py --out two.json
    python benchmarks/megatron_train_step.py --table one.json two.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_speed import DATASHEETS  # noqa: E402
from host_probe import measured_peak_tflops  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402
from roll.models.random_checkpoint import preset_config  # noqa: E402

SEQ, PROMPT = 4096, 512
MICRO_BATCHES = 8
# Dense bf16 tensor-core peak without sparsity, TFLOP/s, from the vendor datasheets (gpu_speed's table).
DATASHEET_BF16_TFLOPS = {name: flops / 1e12 for name, (flops, _) in DATASHEETS.items()}


def qwen25_1p5b() -> transformers.PretrainedConfig:
    return preset_config("qwen2.5-1.5b")


def qwen25_7b(layers: int = 28) -> transformers.PretrainedConfig:
    return preset_config("qwen2.5-7b", num_hidden_layers=layers)


def small_moe() -> transformers.PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=1024,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )


@dataclass
class Case:
    name: str
    make_config: object
    gpus: int
    layout: dict = field(default_factory=dict)
    note: str = ""


CASES = [
    Case("Qwen2.5-1.5B", qwen25_1p5b, 1),
    Case(
        "Qwen2.5-7B, 16 of 28 layers",
        lambda: qwen25_7b(16),
        1,
        note="28 layers need 128 GiB of state (18 B/param) + ~1 GiB/layer activations: over one H200",
    ),
    Case("Qwen2.5-1.5B", qwen25_1p5b, 2, {"use_distributed_optimizer": True}),
    Case(
        "MoE 3.2B (32 experts, top-4)",
        small_moe,
        2,
        {"expert_model_parallel_size": 2, "moe_grouped_gemm": True, "use_distributed_optimizer": True},
    ),
    Case("Qwen2.5-7B", qwen25_7b, 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    Case("Qwen2.5-7B", qwen25_7b, 2, {"use_distributed_optimizer": True}),
]


# ------------------------------------------------------------------------------------ FLOPs
def flops_per_token(cfg) -> float:
    """Training model FLOPs per token (see the module docstring)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q_dim, kv_dim = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    attn_params = h * q_dim + 2 * h * kv_dim + q_dim * h
    if getattr(cfg, "num_experts", 0):
        mlp_params = cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size + h * cfg.num_experts
    else:
        mlp_params = 3 * h * cfg.intermediate_size
    matmul = layers * (attn_params + mlp_params) + h * cfg.vocab_size
    attention = layers * 2 * SEQ * q_dim  # QK^T and AV, causal: SEQ/2 keys on average
    return 3 * (2 * matmul + attention)


def datasheet_peak_tflops(gpu_name: str) -> float | None:
    """The datasheet dense bf16 peak of a device named like ``torch.cuda.get_device_name`` ("NVIDIA
    H100 80GB HBM3"), or None for a device not in ``DATASHEET_BF16_TFLOPS``."""
    return next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in gpu_name.upper()), None)


def mfu(model_tflop: float, step_ms: float, gpus: int, peak_tflops: float) -> float:
    """Model FLOPs utilization: the step's model TFLOP over (seconds x GPUs x peak TFLOP/s)."""
    return model_tflop / (step_ms / 1e3) / gpus / peak_tflops


# ------------------------------------------------------------------------------------- data
def make_batch(rows: int, vocab: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (rows, PROMPT), generator=gen)
    responses = torch.randint(0, vocab, (rows, SEQ - PROMPT), generator=gen)
    ones_p, ones_r = torch.ones_like(prompts), torch.ones_like(responses)
    return Batch.from_dict(
        {
            "prompts": prompts,
            "prompt_mask": ones_p,
            "responses": responses,
            "response_mask": ones_r,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([ones_p, ones_r], 1),
            "old_log_probs": -torch.rand(rows, SEQ - PROMPT, generator=gen) * 10,
            "advantages": torch.randn(rows, SEQ - PROMPT, generator=gen),
        }
    )


def ppo_loss(outputs: dict[str, torch.Tensor], batch: Batch):
    mask = batch["response_mask"].float()
    ratio = torch.exp(outputs["log_probs"] - batch["old_log_probs"])
    adv = batch["advantages"]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    return (pg * mask).sum() / mask.sum(), {}


# ---------------------------------------------------------------------------------- one case
def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def run_case(case: Case, steps: int, warmup: int) -> dict:
    from roll.distributed.strategy.megatron_strategy import MegatronTrainStrategy

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.reset_peak_memory_stats()
    hf_config = case.make_config()
    role = RoleConfig(
        model_args=ModelArgs(dtype="bf16"),
        training_args=TrainingArgs(learning_rate=1e-6),
        strategy_args=StrategyArgs("megatron_train", dict(case.layout)),
    )
    device = _device()
    strategy = MegatronTrainStrategy(role, WorkerContext("actor_train", rank, world, rank, device))
    strategy.initialize(hf_config=hf_config)
    dp_rank, dp_size, _ = strategy.dp_layout()
    micro = make_batch(MICRO_BATCHES, hf_config.vocab_size, seed=dp_rank).split(1)
    times = []
    for step in range(warmup + steps):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        strategy.train_step(micro, ppo_loss)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    tokens = SEQ * MICRO_BATCHES * dp_size
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    row = {
        "config": case.name,
        "gpus": world,
        "layout": _layout(case, dp_size),
        "seq": SEQ,
        "layers": hf_config.num_hidden_layers,
        "gpu_name": torch.cuda.get_device_name(device),
        "tokens_per_s": tokens / step_s,
        "step_ms": step_s * 1e3,
        "peak_gib": float(peak),
        "model_tflop": flops_per_token(hf_config) * tokens / 1e12,
        "note": case.note,
    }
    row.update(_offload_freed(strategy) if case.layout.get("tensor_model_parallel_size") == 2 else {})
    del strategy
    gc.collect()  # the model, its config and DDP hooks form reference cycles
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def _layout(case: Case, dp: int) -> str:
    tp = case.layout.get("tensor_model_parallel_size", 1)
    parts = [f"TP{tp}" if tp > 1 else "", "SP" if case.layout.get("sequence_parallel") else ""]
    parts += [
        f"EP{case.layout['expert_model_parallel_size']}"
        if "expert_model_parallel_size" in case.layout
        else ""
    ]
    parts += [f"DP{dp}", "dist-opt" if case.layout.get("use_distributed_optimizer") else ""]
    return " ".join(p for p in parts if p)


def _offload_freed(strategy) -> dict:
    """CUDA memory held before / after offloading params, grads and optimizer state (GiB)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() / 2**30
    strategy.config.offload_params = True
    start = time.perf_counter()
    strategy.offload_states()
    offload_s = time.perf_counter() - start
    after = torch.cuda.memory_allocated() / 2**30
    start = time.perf_counter()
    strategy.reload_states()
    torch.cuda.synchronize()
    return {
        "offload_before_gib": before,
        "offload_after_gib": after,
        "offload_s": offload_s,
        "reload_s": time.perf_counter() - start,
    }


# ---------------------------------------------------------------------------------- output
COLUMNS = (
    "config",
    "GPUs",
    "layout",
    "layers",
    "seq",
    "tokens/s",
    "MFU (datasheet)",
    "MFU (measured peak)",
    "peak GiB",
    "step ms",
    "datasheet TFLOP/s",
    "measured TFLOP/s",
)


def table(rows: list[dict], datasheet_tflops: float | None = None) -> str:
    """Markdown table; each row carries the bf16 matmul peak measured in its own run, and its
    device's datasheet peak comes from its ``gpu_name`` (``datasheet_tflops`` wins when given, for
    rows written before the name was recorded)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        sheet = datasheet_tflops or datasheet_peak_tflops(r.get("gpu_name", ""))
        measured = mfu(r["model_tflop"], r["step_ms"], r["gpus"], r["peak_tflops"])
        cells = [
            r["config"],
            r["gpus"],
            r["layout"],
            r.get("layers", "?"),
            r["seq"],
            f"{r['tokens_per_s']:,.0f}",
            f"{mfu(r['model_tflop'], r['step_ms'], r['gpus'], sheet):.1%}" if sheet else "-",
            f"{measured:.1%}",
            f"{r['peak_gib']:.1f}",
            f"{r['step_ms']:.0f}",
            f"{sheet:.0f}" if sheet else "-",
            f"{r['peak_tflops']:.0f}",
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += [f"- {r['config']} ({r['gpus']} GPU): {r['note']}" for r in rows if r["note"]]
    for r in rows:
        if "offload_before_gib" in r:
            lines.append(
                f"- offload ({r['config']}, {r['layout']}): {r['offload_before_gib']:.1f} GiB allocated -> "
                f"{r['offload_after_gib']:.2f} GiB in {r['offload_s']:.1f} s; reload {r['reload_s']:.1f} s"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="write the rows and the measured peak as JSON")
    parser.add_argument("--table", nargs="+", help="print the table of these JSON files and exit")
    parser.add_argument(
        "--datasheet_tflops",
        type=float,
        help="the device's datasheet dense bf16 peak (default: by device name, 989 for H100/H200)",
    )
    parser.add_argument("--only", help="run only cases whose name contains this")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.table:
        runs = [json.loads(Path(p).read_text()) for p in args.table]
        rows = [{"peak_tflops": run["peak"][str(r["gpus"])], **r} for run in runs for r in run["rows"]]
        print(table(rows, args.datasheet_tflops))
        return
    warnings.filterwarnings("ignore")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", torch.cuda.current_device())
    )
    peak = measured_peak_tflops(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for case in CASES:
        if case.gpus != world or (args.only and args.only not in case.name):
            continue
        rows.append({**run_case(case, args.steps, args.warmup), "peak_tflops": peak})
        if rank == 0:  # written after every case, so an out-of-memory crash keeps the earlier rows
            print(json.dumps(rows[-1]), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"rows": rows, "peak": {str(world): peak}}, indent=1))
    if rank == 0:
        print(table(rows, args.datasheet_tflops))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
