"""``megatron_train`` on an RL-shaped ragged batch: padded rows vs packed rows vs packed rows with a
token budget.

The batch: ``--rows`` sequences of a ``--prompt``-token prompt and a response whose length is drawn
from a long-tailed (log-normal) distribution between 16 and ``--max-response`` tokens (median
``--max-response / 8``). One optimizer step of ``MegatronTrainStrategy.train_step`` (PPO-clip
loss, token-mean) per timing, random weights of the chosen architecture, one process. Columns:

- computed tokens: what the model runs on (padded: micro-batches x rows x longest row, each padded
  to a multiple of 8; packed: micro-batches x longest packed row); real tokens are the same for all;
- useful tokens/s: real tokens / median step time; peak GiB: CUDA only.

    python benchmarks/packing.py --device cuda                        # Qwen2.5-1.5B shape, 1 GPU
    python benchmarks/packing.py --device cpu                         # a tiny model, seconds
    torchrun --nproc_per_node 2 benchmarks/packing.py --context-parallel --preset qwen2.5-7b \
        --rows 1 --fixed --max-response 65024                           # one 64k sequence, CP=2

Under torchrun every rank gets the same batch: DP over the ranks, or CP with ``--context-parallel``
(packed paths only).

On CPU (gloo) it uses the test-only shims of ``tests/megatron`` that let megatron-core run without
CUDA; timings there only show the shape of the gain, not GPU numbers.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402
from roll.models.microbatch import rebudget  # noqa: E402
from roll.models.packing import round_up, sequence_lengths  # noqa: E402
from roll.models.random_checkpoint import preset_config  # noqa: E402
from roll.pipeline.rlvr.algorithms.losses import actor_loss  # noqa: E402

COLUMNS = ("path", "micro-batches", "computed tokens", "real tokens", "step s", "useful tokens/s", "peak GiB")


def tiny_config() -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def ragged_batch(
    rows: int, prompt: int, max_response: int, vocab: int, fixed: bool = False, seed: int = 0
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    median = max_response / 8
    draws = torch.exp(math.log(median) + torch.randn(rows, generator=gen))
    lengths = [max_response] * rows if fixed else draws.clamp(16, max_response).long().tolist()
    prompts = torch.randint(3, vocab, (rows, prompt), generator=gen)
    responses = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    base = Batch.from_dict({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)})
    batch = build_generation_batch(base, responses, None, 1, 0, max_response)
    batch.tensors["advantages"] = torch.randn(rows, max_response, generator=gen)
    batch.tensors["old_log_probs"] = -torch.rand(rows, max_response, generator=gen) * 5
    return batch


def computed_tokens(micro: list[Batch], packed: bool) -> int:
    """Tokens the model runs on: every micro-batch is padded to the call's common shape."""
    lengths = [sequence_lengths(b) for b in micro]
    if packed:
        return len(micro) * round_up(max(int(n.sum()) for n in lengths), 8)
    rows = max(len(b) for b in micro)
    return len(micro) * rows * round_up(max(int(n.max()) for n in lengths), 8)


def loss_fn(outputs: dict, batch: Batch):
    return actor_loss(
        outputs,
        batch,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip_c=None,
        loss_agg_mode="token-mean",
        entropy_coef=0.0,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        kl_loss_type="k1",
    )


def time_step(strategy, micro: list[Batch], steps: int, cuda: bool) -> float:
    times = []
    for _ in range(steps + 1):  # the first step warms up
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        strategy.train_step(micro, loss_fn)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def set_packing_attention(strategy, kind: str) -> None:
    """Point every core-attention module of the built model at ``kind`` (``packing_attention``)."""
    for chunk in strategy.model:
        for module in chunk.modules():
            if hasattr(module, "packing_attention"):
                module.packing_attention = kind


def run(args: argparse.Namespace, hf_config, device: torch.device) -> list[dict]:
    from roll.distributed.strategy.megatron_strategy import MegatronTrainStrategy

    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = {"context_parallel_size": world} if args.context_parallel else {}
    role = RoleConfig(
        model_args=ModelArgs(dtype="bf16" if cuda else "fp32"),
        training_args=TrainingArgs(learning_rate=1e-7),
        strategy_args=StrategyArgs("megatron_train", layout),
    )
    strategy = MegatronTrainStrategy(role, WorkerContext("actor_train", rank, world, rank, device))
    strategy.initialize(hf_config=hf_config)
    batch = ragged_batch(args.rows, args.prompt, args.max_response, hf_config.vocab_size, args.fixed)
    real = int(sequence_lengths(batch).sum())
    budget = args.budget or args.prompt + args.max_response
    kinds = args.attention.split(",")
    paths = {"padded": (False, batch.split(args.rows_per_micro), None)}
    for kind in kinds:
        paths[f"packed ({kind})"] = (True, batch.split(args.rows_per_micro), kind)
        if args.budget != 0:
            paths[f"packed ({kind}) + budget {budget}"] = (True, rebudget([batch], budget), kind)
    if args.context_parallel:
        del paths["padded"]  # context parallelism runs on packed rows only
    rows = []
    for name, (packed, micro, kind) in paths.items():
        strategy.config.sequence_packing = packed
        if kind is not None:
            set_packing_attention(strategy, kind)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step_s = time_step(strategy, micro, args.steps, cuda)
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")])
        if cuda and world > 1:
            peak = peak.to(device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peak = float(peak)
        computed = computed_tokens(micro, packed)
        rows.append(dict(path=name, micro=len(micro), computed=computed, real=real, step_s=step_s, peak=peak))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = [r["path"], r["micro"], f"{r['computed']:,}", f"{r['real']:,}", f"{r['step_s']:.3f}"]
        cells += [f"{r['real'] / r['step_s']:,.0f}", "-" if math.isnan(r["peak"]) else f"{r['peak']:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _init(device: torch.device) -> None:
    """One process, or the ranks torchrun started (RANK / WORLD_SIZE / MASTER_* set)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--preset", default=None, help="architecture (roll.models.random_checkpoint presets)")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--rows-per-micro", type=int, default=2, help="rows per micro-batch (padded, packed)")
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--max-response", type=int, default=None)
    parser.add_argument(
        "--budget",
        type=int,
        default=None,
        help="max_tokens_per_microbatch (default: prompt + max response; 0: no budget rows)",
    )
    parser.add_argument(
        "--attention",
        default="auto",
        help="comma-separated packing_attention kinds, one packed row each (auto, sdpa, flex, varlen)",
    )
    parser.add_argument("--fixed", action="store_true", help="every response --max-response tokens")
    parser.add_argument("--context-parallel", action="store_true", help="CP over the torchrun ranks")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 3 on CUDA, 1 on CPU)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    defaults = dict(rows=16, prompt=512, max_response=8192, steps=3)
    if not cuda:
        defaults = dict(rows=8, prompt=32, max_response=256, steps=1)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.preset:
        hf_config = preset_config(args.preset, args.layers)
    else:
        hf_config = preset_config("qwen2.5-1.5b", args.layers) if cuda else tiny_config()
    warnings.filterwarnings("ignore")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    _init(device)
    if cuda:
        rows = run(args, hf_config, device)
    else:
        sys.path.insert(0, str(ROOT / "tests" / "megatron"))
        import compat
        from cuda_on_cpu import cuda_on_cpu

        compat.apply()
        with cuda_on_cpu():
            rows = run(args, hf_config, device)
    if dist.get_rank() == 0:
        shape = f"{args.max_response}" if args.fixed else f"16..{args.max_response} (log-normal)"
        cp = f", CP={dist.get_world_size()}" if args.context_parallel else ""
        print(f"{args.rows} rows, prompt {args.prompt}, responses {shape}, {args.device}{cp}")
        print(table(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
