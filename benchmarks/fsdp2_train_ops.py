"""Work of one fsdp2_train training step, counted on CPU: a number that does not move with the host's
load, unlike the seconds of a tiny model's train stage on a GPU host (host-bound: Python calls,
kernel launches, host syncs).

Builds ``actor_train`` of an RLVR config (its model, ``training_args`` and fsdp2 options, on one gloo
CPU rank), runs the actor's loss (``make_actor_loss_fn``) over one mini-batch of random rows of the
config's shape (``rollout_batch_size x num_return_sequences_in_group`` rows of ``prompt_length`` +
``response_length`` tokens, ``per_device_train_batch_size`` per micro-batch), once to warm up and
once counted, with the counters of ``megatron_decode_ops.py`` (aten ops, Python calls, host syncs by
kind, collectives). ``--repo`` imports another checkout's roll and reads its config, for A/B counts::

    python benchmarks/fsdp2_train_ops.py                                   # rlvr_vllm_1gpu, this checkout
    python benchmarks/fsdp2_train_ops.py --repo /tmp/c61b7fd --repo .      # two checkouts, one table
    python benchmarks/fsdp2_train_ops.py --config rlvr_config --model output/default_example/sft_model

The model is ``--model`` (default: the default example's SFT model, ``python
examples/prepare_default_example.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
COUNTERS = ("aten ops", "py calls", "syncs", "collectives")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", action="append", help="checkout whose roll is counted (repeatable)")
    parser.add_argument("--config", default="rlvr_vllm_1gpu", help="examples/config/<name>.yaml of each repo")
    parser.add_argument("--model", default=str(HERE / "output" / "default_example" / "sft_model"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: count one repo, write JSON here
    return parser.parse_args(argv)


def count_one(repo: str, config_name: str, model: str, out: str) -> None:
    """Count one step of ``repo``'s fsdp2_train (in this process: run it as a subprocess per repo)."""
    sys.path[:0] = [repo, str(HERE / "benchmarks")]
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import megatron_decode_ops as ops
    import torch
    import torch.distributed as dist

    from roll.configs.loader import load_config
    from roll.core.batch import Batch
    from roll.core.loss import LogProbRecorder
    from roll.core.worker_context import WorkerContext
    from roll.distributed.strategy.registry import load_strategy_class
    from roll.pipeline.rlvr.algorithms.losses import make_actor_loss_fn
    from roll.utils.ports import free_port

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    config = load_config(Path(repo) / "examples" / "config" / f"{config_name}.yaml", [f"pretrain={model}"])
    role = config.actor_train
    ctx = WorkerContext("actor_train", 0, 1, 0, torch.device("cpu"), seed=0, total_optimizer_steps=60)
    strategy = load_strategy_class("fsdp2_train")(role, ctx)
    strategy.initialize()
    rows = config.rollout_batch_size * config.num_return_sequences_in_group
    prompt, response = config.prompt_length, config.response_length
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 200, (rows, prompt), generator=gen)
    responses = torch.randint(3, 200, (rows, response), generator=gen)
    input_ids = torch.cat([prompts, responses], 1)
    batch = Batch.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(prompt + response).expand(rows, -1).clone(),
            "prompt_mask": torch.ones(rows, prompt),
            "response_mask": torch.ones(rows, response),
            "advantages": torch.randn(rows, response, generator=gen),
            "ref_log_probs": -torch.rand(rows, response, generator=gen),
            "old_log_probs": -torch.rand(rows, response, generator=gen),
            "row_index": torch.arange(rows),
        }
    )
    micro = batch.split(role.training_args.per_device_train_batch_size)
    loss_fn = make_actor_loss_fn(config)

    def step() -> None:
        strategy.train_step(micro, LogProbRecorder(loss_fn))

    step()  # warm-up: lazy state, first-call caches
    counts = ops.Counts()
    counts.phase = "step"
    sys.setprofile(ops._profile(counts))
    try:
        step()
    finally:
        sys.setprofile(None)
    dispatch, function = ops._modes(counts)
    counts.on = True
    with function, dispatch:
        step()
    counts.on = False
    result = {"rows": rows, "micro_batches": len(micro), "counts": dict(counts.data["step"])}
    Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def table(results: dict[str, dict]) -> str:
    kinds = sorted({k for r in results.values() for k in r["counts"] if k.startswith("sync:")})
    keys = [*COUNTERS, *kinds]
    lines = [
        "| repo | rows | micro-batches | " + " | ".join(keys) + " |",
        "|---|---:|---:|" + "---:|" * len(keys),
    ]
    for repo, r in results.items():
        cells = " | ".join(f"{r['counts'].get(k, 0):g}" for k in keys)
        lines.append(f"| {repo} | {r['rows']} | {r['micro_batches']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        count_one(args.repo[0], args.config, args.model, args.one)
        return 0
    if not Path(args.model).is_dir():
        print(
            f"fsdp2_train_ops: --model {args.model} is not a model directory (run "
            "examples/prepare_default_example.py, or pass --model)",
            file=sys.stderr,
        )
        return 2
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for repo in args.repo or [str(HERE)]:
            out = os.path.join(scratch, f"{len(results)}.json")
            cmd = [
                sys.executable,
                __file__,
                "--one",
                out,
                "--repo",
                str(Path(repo).resolve()),
                "--config",
                args.config,
                "--model",
                str(Path(args.model).resolve()),
            ]
            done = subprocess.run(
                cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True
            )
            if done.returncode:
                print(done.stderr[-2000:], file=sys.stderr)
                return done.returncode
            results[repo] = json.loads(Path(out).read_text())
    print(f"one fsdp2_train step of {args.config} (counted on CPU, one gloo rank):")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
