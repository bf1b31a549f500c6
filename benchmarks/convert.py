"""The offline converter (``python -m roll.models.megatron.convert``): time, peak memory and bytes of
``hf-to-mcore`` and ``mcore-to-hf`` on a random-weight checkpoint, a bit-exact round-trip check,
and (``--startup``) megatron_train's start-up from the HF checkpoint vs from the dist checkpoint.

    python benchmarks/convert.py --preset tiny-qwen3-moe --ep 2                  # CPU, seconds
    python benchmarks/convert.py --preset qwen2.5-1.5b --layers 8 --tp 2         # CPU, ~1 GB bf16
    python benchmarks/convert.py --preset qwen2.5-7b --tp 2 --startup            # 2 GPUs

The HF input is ``roll.models.random_checkpoint.write_random_checkpoint`` (bf16, transformers'
initialisation, a byte-level test tokenizer). Each conversion runs the command line as a
subprocess (its own TP x PP x EP ranks). Memory: a sampler reads the process tree every 50 ms
(psutil) and reports the peak of the ranks' summed RSS, split into anonymous memory (what the
converter holds) and file-backed pages (the mmapped safetensors / checkpoint files the ranks
touched: page cache, given back under memory pressure); ``maxrss`` is ``wait4``'s ``ru_maxrss``
(the largest single process of the tree, file pages included). The round trip compares every
tensor of the two HF directories one at a time.

``--startup``: ``MegatronTrainStrategy.initialize()`` (bf16, the layout's TP/PP/EP, one process
per rank, each start in a fresh world) from HF (``model_name_or_path``) and from the dist
checkpoint (``strategy_config.mcore_checkpoint``), alternating, ``--startup_repeats`` times each;
the table gives each start's seconds (rank 0, barrier to barrier: model build, weight load, DDP
and optimizer set-up) and whether both starts hold the same weights (a float64 checksum per
parameter on every rank). The first start may read cold files; later ones find them in the page
cache. On CPU this runs through the CPU test shims (tests/megatron), fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 2**20


# ------------------------------------------------------------------------------------ memory
class TreeSampler(threading.Thread):
    """Peak summed RSS (anonymous / file-backed) of a process and its descendants."""

    def __init__(self, pid: int, period: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.period = period
        self.peak_anon = self.peak_file = self.peak_total = 0
        self.done = threading.Event()

    def _sample(self) -> None:
        import psutil

        anon = file = 0
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                mem = proc.memory_info()
            except psutil.Error:
                continue
            anon += mem.rss - mem.shared
            file += mem.shared
        self.peak_anon = max(self.peak_anon, anon)
        self.peak_file = max(self.peak_file, file)
        self.peak_total = max(self.peak_total, anon + file)

    def run(self) -> None:
        while not self.done.is_set():
            self._sample()
            time.sleep(self.period)


def run_measured(argv: list[str]) -> dict:
    """Run ``argv``; wall seconds, peak tree RSS (anon / file / total) and wait4's ru_maxrss."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} exited with {proc.returncode}")
    return {
        "seconds": seconds,
        "anon": sampler.peak_anon,
        "file": sampler.peak_file,
        "total": sampler.peak_total,
        "maxrss": usage.ru_maxrss * 1024,  # KiB on Linux
    }


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------- checkpoints
def write_input(preset: str, layers: int | None, out: Path, dtype: torch.dtype) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tiny_tokenizer

    from roll.models.random_checkpoint import write_random_checkpoint

    tok_dir = out.parent / "tokenizer"
    build_tiny_tokenizer().save_pretrained(tok_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # transformers' initialisation is slow on CPU
    return write_random_checkpoint(
        preset, out, num_hidden_layers=layers, tokenizer_dir=tok_dir, device=device, dtype=dtype
    )


def same_tensors(a: Path, b: Path) -> tuple[bool, int]:
    """Whether the HF checkpoints in ``a`` and ``b`` hold the same tensors bit for bit (names,
    dtypes, shapes, bytes), read one tensor at a time; and how many tensors."""
    from safetensors import safe_open

    def names(d: Path) -> dict[str, Path]:
        return {n: f for f in sorted(d.glob("*.safetensors")) for n in safe_open(f, "pt").keys()}

    left, right = names(a), names(b)
    if left.keys() != right.keys():
        return False, len(left)
    for name in sorted(left):
        with safe_open(left[name], "pt") as fa, safe_open(right[name], "pt") as fb:
            x, y = fa.get_tensor(name), fb.get_tensor(name)
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
        ):
            return False, len(left)
    return True, len(left)


# ------------------------------------------------------------------------------------ start-up
def _startup_rank(rank: int, port: int, world: int, hf_dir: str, layout: dict, out: str) -> None:
    """One rank of a fresh world: ``MegatronTrainStrategy.initialize()`` once, timed barrier to
    barrier; rank 0 writes the seconds and every rank its parameters' checksums."""
    import json
    import warnings

    import torch.distributed as dist

    from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
    from roll.core.worker_context import WorkerContext
    from roll.distributed.strategy.registry import load_strategy_class
    from roll.utils.process_group import init_default_group

    warnings.filterwarnings("ignore")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    init_default_group(rank, world, device, master_addr="127.0.0.1", master_port=port)
    with contextlib.ExitStack() as stack:
        if not cuda:
            sys.path.insert(0, str(ROOT / "tests" / "megatron"))
            import compat
            from cuda_on_cpu import cuda_on_cpu

            compat.apply()
            stack.enter_context(cuda_on_cpu())
        stack.callback(dist.destroy_process_group)
        role = RoleConfig(
            model_args=ModelArgs(model_name_or_path=hf_dir, dtype="bf16" if cuda else "fp32"),
            training_args=TrainingArgs(learning_rate=1e-6),
            strategy_args=StrategyArgs("megatron_train", dict(layout)),
        )
        strategy = load_strategy_class("megatron_train")(
            role, WorkerContext("actor_train", rank, world, rank, device)
        )
        dist.barrier()
        start = time.perf_counter()
        strategy.initialize()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        seconds = time.perf_counter() - start
        checksum = [float(p.detach().double().sum()) for c in strategy.model for p in c.parameters()]
        Path(f"{out}.rank{rank}").write_text(json.dumps({"seconds": seconds, "checksum": checksum}))


def measure_startup(hf_dir: Path, mcore_dir: Path, args: argparse.Namespace, scratch: Path) -> dict:
    """``args.startup_repeats`` starts from HF and as many from the dist checkpoint, alternating,
    each in a fresh world of TP x PP x EP processes."""
    import json

    import torch.multiprocessing as mp

    from roll.utils.ports import free_port

    layout = {
        "tensor_model_parallel_size": args.tp,
        "pipeline_model_parallel_size": args.pp,
        "expert_model_parallel_size": args.ep,
    }
    if args.vpp:
        layout["virtual_pipeline_model_parallel_size"] = args.vpp
    world = args.tp * args.pp * args.ep
    rows, sums = [], {}
    for i in range(2 * args.startup_repeats):
        source = ("hf", "mcore")[i % 2]
        config = dict(layout, **({"mcore_checkpoint": str(mcore_dir)} if source == "mcore" else {}))
        out = scratch / f"startup{i}"
        mp.spawn(
            _startup_rank, args=(free_port(), world, str(hf_dir), config, str(out)), nprocs=world, join=True
        )
        ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]
        rows.append({"source": source, "seconds": ranks[0]["seconds"]})
        sums.setdefault(source, [r["checksum"] for r in ranks])
    return {"rows": rows, "same_weights": sums["hf"] == sums["mcore"]}


# ---------------------------------------------------------------------------------------- main
def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    from transformers import AutoConfig

    from roll.models.random_checkpoint import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the preset's)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    for flag in ("tp", "pp", "ep"):
        parser.add_argument(f"--{flag}", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--max_shard_size", default="2GB", help="mcore-to-hf's file size limit")
    parser.add_argument(
        "--workdir", default=None, help="where the checkpoints go (default: a temp dir, removed)"
    )
    parser.add_argument(
        "--startup", action="store_true", help="also time megatron_train's start-up, HF vs mcore"
    )
    parser.add_argument("--startup_repeats", type=int, default=2)
    args = parser.parse_args()

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="convert_bench_")
    work = Path(args.workdir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    dirs = {"hf": work / "hf", "mcore": work / "mcore", "hf_back": work / "hf_back"}
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    try:
        if not (dirs["hf"] / "config.json").exists():
            write_input(args.preset, args.layers, dirs["hf"], dtype)
        layout = ["--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep)]
        layout += ["--vpp", str(args.vpp)] if args.vpp else []
        cli = [sys.executable, "-m", "roll.models.megatron.convert"]
        hf, mcore, back = (str(dirs[k]) for k in ("hf", "mcore", "hf_back"))
        steps = {
            "hf-to-mcore": run_measured([*cli, "hf-to-mcore", "--hf", hf, "--out", mcore, *layout]),
            "mcore-to-hf": run_measured(
                [
                    *cli,
                    "mcore-to-hf",
                    "--mcore",
                    mcore,
                    "--out",
                    back,
                    "--max_shard_size",
                    args.max_shard_size,
                ]
            ),
        }
        exact, count = same_tensors(dirs["hf"], dirs["hf_back"])
        sizes = {k: dir_bytes(d) for k, d in dirs.items()}
        layers = AutoConfig.from_pretrained(hf).num_hidden_layers
        startup = measure_startup(dirs["hf"], dirs["mcore"], args, work) if args.startup else None
    finally:
        if tmp is not None:
            tmp.cleanup()

    lay = f"TP{args.tp} PP{args.pp} EP{args.ep}" + (f" VPP{args.vpp}" if args.vpp else "")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{args.preset}, {layers} layers, {args.dtype}; layout {lay}; {device}; {os.cpu_count()} CPUs")
    rows = [
        [
            "step",
            "seconds",
            "peak RSS anon (MiB)",
            "peak RSS file (MiB)",
            "maxrss (MiB)",
            "in (MiB)",
            "out (MiB)",
        ]
    ]
    for name, (src, dst) in (("hf-to-mcore", ("hf", "mcore")), ("mcore-to-hf", ("mcore", "hf_back"))):
        m = steps[name]
        rows.append(
            [name, f"{m['seconds']:.1f}"]
            + [f"{m[k] / MIB:.0f}" for k in ("anon", "file", "maxrss")]
            + [f"{sizes[src] / MIB:.1f}", f"{sizes[dst] / MIB:.1f}"]
        )
    print(_table(rows))
    print(f"round trip HF -> mcore -> HF: {count} tensors, {'bit-exact' if exact else 'DIFFERENT'}")
    if startup is not None:
        srows = [["start-up from", "seconds (rank 0)"]]
        srows += [[r["source"], f"{r['seconds']:.1f}"] for r in startup["rows"]]
        print(_table(srows))
        print(f"same weights from HF and from mcore: {startup['same_weights']}")
    if not exact or (startup is not None and not startup["same_weights"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
