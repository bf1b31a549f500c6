"""Model update into an engine: trainer -> roll's ``vllm`` or ``sglang`` strategy, timed against
the NCCL bound.

Three processes on two GPUs, running the production pieces (``Link``, ``BucketSender``,
``BucketReceiver`` with the engine attached as the pipeline attaches it, the engine's own weight
loading):

- a trainer on GPU 0 holding random bf16 weights with the HF names and shapes of ``--presets``;
- ``colocated``: an engine on GPU 0 (the trainer's device): buckets by CUDA IPC;
- ``disagg``: an engine on GPU 1: buckets by NCCL broadcast into the engine's own processes (vLLM:
  its workers' buffers on roll's group; SGLang: its schedulers on their own group,
  ``update_weights_from_distributed``, ``model_update_transport: auto``);
- ``disagg-tensor`` (SGLang only): the same engine with ``model_update_transport: tensor``: NCCL
  broadcast into the worker's buffer, then ``update_weights_from_tensor`` by CUDA IPC.

Without 2 GPUs or with the engine missing or of an untested version it prints one line and exits 2.

The engines start with ``load_format=dummy`` from a config-only directory, so no checkpoint is
written. ``sync`` is one whole update (all buckets, checksums on both ends, loads), median of
``--reps`` after one untimed update. ``bw`` is a 1 GiB NCCL broadcast GPU 0 -> GPU 1 between the
trainer and the disagg engine process in the same run (median of 5); ``bound`` = bytes / bw and
``ratio`` = sync / bound. Process coordination uses store-based groups, never the default group,
which vLLM's in-process engine takes for itself.

    python benchmarks/model_update_engine.py --presets qwen2.5-1.5b,qwen2.5-7b --reps 3
    python benchmarks/model_update_engine.py --engine sglang --presets qwen2.5-7b
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from roll.distributed.model_update.receiver import BucketReceiver  # noqa: E402
from roll.distributed.model_update.sender import BucketSender  # noqa: E402
from roll.distributed.transport.link import Link, LinkSpec  # noqa: E402
from roll.distributed.transport.process_group import (  # noqa: E402
    broadcast_options,
    new_group,
    open_store,
)
from roll.utils.ports import free_port  # noqa: E402

TIMEOUT = datetime.timedelta(minutes=10)
TRAINER, COLOCATED, DISAGG = 0, 1, 2
LAYOUTS = {"colocated": COLOCATED, "disagg": DISAGG}
# SGLang's worker-received path beside its own group (model_update_transport: tensor).
EXTRA_LAYOUTS = {"sglang": {"disagg-tensor": DISAGG}}


def layouts(engine: str) -> dict[str, int]:
    """Layout name -> the process that owns its engine."""
    return LAYOUTS | EXTRA_LAYOUTS.get(engine, {})


def write_config_dir(preset: str, root: Path, tokenizer: str) -> Path:
    """config.json + tokenizer of the preset, no weights (the engines use load_format=dummy)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from roll.models.random_checkpoint import preset_config
    from roll.models.tokenizer import load_tokenizer

    out = root / preset
    tok = load_tokenizer(tokenizer)
    config = preset_config(
        preset,
        None,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config.torch_dtype = torch.bfloat16
    # What model.save_pretrained would record; SGLang reads the model class from it (vLLM infers it).
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def hf_shapes(config_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def coordinator(rank: int, port: int):
    store = open_store("127.0.0.1", port, 3, rank == 0, TIMEOUT)
    return store, new_group("gloo", store, "bench/ctrl", rank, 3, TIMEOUT)


def barrier(group) -> None:
    group.barrier().wait()


def link_spec(layout: str, port: int, engine: str) -> LinkSpec:
    """The link ``plan_links`` would give the layout (SGLang's ``disagg``: its own group)."""
    local = layout == "colocated"
    owner = layouts(engine)[layout]
    group = engine == "sglang" and layout == "disagg"
    return LinkSpec(
        f"bench/{layout}", 0, "127.0.0.1", port, (owner,), (local,), "nccl", 0, engine_group=group
    )


MEMBER_NAMES = {TRAINER: "trainer", COLOCATED: "colocated engine", DISAGG: "disaggregated engine"}


def member(rank: int, args: argparse.Namespace, config_dirs: dict[str, str], ports: dict[str, int], out: str):
    """One of the three processes. torch.multiprocessing reports the first process it sees fail,
    often a peer whose connection this one's death closed, so each prints its own error first."""
    try:
        _member(rank, args, config_dirs, ports, out)
    except BaseException:
        print(
            f"model_update_engine: the {MEMBER_NAMES[rank]} (process {rank}) failed:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        raise


def _member(
    rank: int, args: argparse.Namespace, config_dirs: dict[str, str], ports: dict[str, int], out: str
):
    # One visible GPU per process, as Ray gives each worker: vLLM's in-process executor always takes
    # the first visible device (the first run of this script let the "disagg" engine land on GPU 0).
    os.environ["CUDA_VISIBLE_DEVICES"] = "1" if rank == DISAGG else "0"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store, ctrl = coordinator(rank, ports["ctrl"])
    bw = measure_bandwidth(rank, store, device) if rank in (TRAINER, DISAGG) else None
    barrier(ctrl)
    results = []
    for preset, config_dir in config_dirs.items():
        if rank == TRAINER:
            results += trainer_rounds(args, preset, config_dir, ports, ctrl, device)
        else:
            engine_rounds(args, rank, config_dir, preset, ports, ctrl, device)
    if rank == TRAINER:
        Path(out).write_text(json.dumps({"bw": bw, "rows": results}))


def measure_bandwidth(rank: int, store, device: torch.device) -> float:
    """GB/s of a 1 GiB NCCL broadcast GPU 0 -> GPU 1 (median of 5, after a warm-up)."""
    # Each process sees its one GPU as cuda:0 (see ``member``).
    group = new_group("nccl", store, "bench/bw", 0 if rank == TRAINER else 1, 2, TIMEOUT)
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    times = []
    for i in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        group.broadcast([buf], broadcast_options(0)).wait()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return buf.numel() / statistics.median(times) / 1e9


def trainer_rounds(args, preset, config_dir, ports, ctrl, device) -> list[dict]:
    shapes = hf_shapes(Path(config_dir))
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [
        (n, torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 0.02) for n, s in shapes
    ]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    barrier(ctrl)  # engines are up
    rows = []
    for layout in layouts(args.engine):
        spec = link_spec(layout, ports[f"{preset}/{layout}"], args.engine)
        link = Link.connect(spec, "sender", device, TIMEOUT)
        sender = BucketSender(link, device, args.bucket_mb << 20)
        times = []
        for version in range(args.reps + 1):
            barrier(ctrl)
            t0 = time.perf_counter()
            sender.send(iter(weights), version)
            barrier(ctrl)  # the engine has loaded everything
            if version:
                times.append(time.perf_counter() - t0)
        rows.append({"preset": preset, "layout": layout, "bytes": nbytes, "sync_s": statistics.median(times)})
    del weights
    torch.cuda.empty_cache()
    barrier(ctrl)  # engines may stop
    return rows


def receiving_engine(strategy, spec: LinkSpec, rank: int):
    """(engine, join) as the pipeline's receiver picks them (``ModelUpdateReceiverMixin``): the
    strategy takes buckets in its own processes only where it implements that link's Protocol
    (vLLM: both; SGLang: colocated, and on a link of its own group; on ``disagg-tensor`` a bucket
    lands in the worker's buffer and goes in by ``load_weights``), and only such an engine joins the
    broadcast group."""
    from roll.distributed.model_update.worker_mixin import _engine_join, _engine_receives

    engine = strategy if _engine_receives(strategy, spec, rank) else None
    return engine, _engine_join(engine, spec, rank) if engine is not None else None


def engine_rounds(args, rank, config_dir, preset, ports, ctrl, device) -> None:
    strategy = start_engine(args.engine, config_dir, device, rank)
    barrier(ctrl)
    for layout, owner in layouts(args.engine).items():
        if owner != rank:
            for _ in range(args.reps + 1):
                barrier(ctrl)
                barrier(ctrl)
            continue
        spec = link_spec(layout, ports[f"{preset}/{layout}"], args.engine)
        engine, join = receiving_engine(strategy, spec, rank)
        link = Link.connect(spec, rank, device, TIMEOUT, join_data=join)
        receiver = BucketReceiver(link, device, engine=engine)
        for version in range(args.reps + 1):
            barrier(ctrl)
            receiver.receive(strategy.load_weights, version)
            strategy.finish_model_update(version)
            barrier(ctrl)
    barrier(ctrl)
    if rank == DISAGG and hasattr(strategy, "leave_model_update_group"):
        strategy.leave_model_update_group()
    if hasattr(strategy, "shutdown"):
        strategy.shutdown()
    else:
        del strategy.llm
    torch.cuda.empty_cache()


ENGINE_OPTIONS = {
    "vllm": dict(gpu_memory_utilization=0.3, enforce_eager=True, load_format="dummy", sleep_level=0),
    "sglang": dict(mem_fraction_static=0.3, disable_cuda_graph=True, load_format="dummy"),
}


def start_engine(engine: str, config_dir: str, device: torch.device, rank: int):
    from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs
    from roll.core.worker_context import WorkerContext
    from roll.distributed.strategy.registry import load_strategy_class

    args = StrategyArgs(engine, ENGINE_OPTIONS[engine])
    role = RoleConfig(model_args=ModelArgs(model_name_or_path=config_dir, dtype="bf16"), strategy_args=args)
    ctx = WorkerContext("actor_infer", rank - 1, 2, 0, device, seed=0)
    strategy = load_strategy_class(engine)(role, ctx)
    strategy.initialize()
    return strategy


# How each layout's buckets reach the engine (roll's strategy, as the pipeline drives it).
PATHS = {
    "vllm": "colocated: CUDA IPC into vLLM's workers; disagg: NCCL broadcast into vLLM's workers",
    "sglang": "colocated: CUDA IPC, then Engine.update_weights_from_tensor; disagg: NCCL broadcast "
    "into SGLang's schedulers, Engine.update_weights_from_distributed; disagg-tensor: NCCL broadcast "
    "into the worker's buffer, then Engine.update_weights_from_tensor (CUDA IPC)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", default="vllm", choices=sorted(ENGINE_OPTIONS))
    parser.add_argument("--presets", default="qwen2.5-1.5b,qwen2.5-7b")
    parser.add_argument("--tokenizer", default="output/default_example/sft_model")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket_mb", type=int, default=1024)
    parser.add_argument("--out", default=None, help="write the rows as JSON here too")
    args = parser.parse_args(argv)
    from roll.models.random_checkpoint import PRESETS

    unknown = [p for p in args.presets.split(",") if p not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown {unknown}; known: {', '.join(sorted(PRESETS))}")
    if args.reps < 1 or args.bucket_mb < 1:
        parser.error("--reps and --bucket_mb must be >= 1")
    return args


def cannot_run(engine: str, gpus: int) -> str | None:
    """Why the benchmark cannot run here (one line), before any process starts; None if it can."""
    from roll.configs.errors import ConfigError
    from roll.configs.strategies import check_engine_version, get_strategy_spec
    from roll.distributed.strategy.registry import load_strategy_class

    if gpus < 2:
        return (
            f"needs 2 GPUs (trainer and colocated engine on GPU 0, disaggregated engine on GPU 1); "
            f"{gpus} visible"
        )
    try:
        spec = get_strategy_spec(engine)
        check_engine_version(spec, "--engine")
        load_strategy_class(engine, "--engine")
    except ConfigError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = cannot_run(args.engine, torch.cuda.device_count())
    if problem:
        print(f"model_update_engine: {problem}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {p: str(write_config_dir(p, Path(tmp), args.tokenizer)) for p in args.presets.split(",")}
        ports = {"ctrl": free_port()} | {
            f"{p}/{lay}": free_port() for p in dirs for lay in layouts(args.engine)
        }
        result = Path(tmp) / "result.json"
        mp.start_processes(member, args=(args, dirs, ports, str(result)), nprocs=3, start_method="spawn")
        data = json.loads(result.read_text())
    print_table(data, args.engine)
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1))
    return 0


def print_table(data: dict, engine: str) -> None:
    from importlib.metadata import version

    print("\n" + "\n".join(table_lines(data, engine, version(engine))))


def table_lines(data: dict, engine: str, engine_version: str) -> list[str]:
    """The table, the same columns for every engine: bytes, median sync, the NCCL bound (bytes /
    the measured broadcast bandwidth) and sync / bound."""
    bw = data["bw"]
    lines = [
        f"model update into {engine} {engine_version} (roll {engine} strategy), "
        f"NCCL broadcast GPU0->GPU1: {bw:.1f} GB/s",
        f"({PATHS[engine]})",
        f"{'preset':<14}{'layout':<15}{'GB':>7}{'sync ms':>10}{'bound ms':>10}{'ratio':>8}",
    ]
    for r in data["rows"]:
        bound = r["bytes"] / (bw * 1e9)
        lines.append(
            f"{r['preset']:<14}{r['layout']:<15}{r['bytes'] / 1e9:>7.2f}{r['sync_s'] * 1e3:>10.1f}"
            f"{bound * 1e3:>10.1f}{r['sync_s'] / bound:>8.2f}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
