"""Work per token of megatron_infer's KV-cached generation, counted on CPU: a number that does not
move with the host's load, unlike seconds.

``generate_tokens`` (roll/models/megatron/kv_generate.py) runs one model forward per generated
token, so on a GPU its speed is the host's: Python calls, kernel launches (one per aten op) and the
points where the host waits for the device. This script builds a tiny Qwen3-MoE (grouped experts,
the all-to-all dispatcher, random weights) on gloo CPU ranks with a given checkout's roll, runs
``generate_tokens`` once to warm up and once counted, and prints per phase (set-up, prefill,
the mean decode step, the end):

- ``aten ops``: operators dispatched (``TorchDispatchMode``): on a GPU roughly one kernel launch
  each (views and metadata ops included, so it is an upper bound of launches);
- ``py calls``: Python function calls (``sys.setprofile``): the host's interpreter work;
- ``syncs``: points where a GPU run stalls the host on the device: ``.item()`` / ``bool()`` /
  ``int()`` of a tensor (``_local_scalar_dense``), ``nonzero``, ``.tolist()``, ``.cpu()``,
  ``.numpy()``, a CUDA event or stream ``synchronize`` (the MoE all-to-all dispatcher's split
  sizes); each is listed with its source line under ``--sites``;
- ``collectives``: c10d operations (TP/EP/DP all-reduces, broadcasts, all-to-alls).

    python benchmarks/megatron_decode_ops.py                                  # this checkout, TP=EP=1
    python benchmarks/megatron_decode_ops.py --tp 2 --ep 2                    # 4 gloo ranks, rank 0 shown
    python benchmarks/megatron_decode_ops.py --repo /tmp/wt_fd7c501 --sites   # another checkout's roll

The CPU shims (tests/megatron/compat.py, cuda_on_cpu.py) and the model's config
(tests/tiny_models.py) come from this checkout: they patch megatron-core and torch, not roll. ``--repo`` only changes which ``roll`` is imported; the small
adapter below (``_roll_api``) covers the import paths that moved since 2026-11-21 (fd7c501).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SYNC_ATEN = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive"}
SYNC_METHODS = {"tolist", "cpu", "numpy"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", default=str(HERE), help="checkout whose roll is counted")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--rows", type=int, default=8, help="rows (prompts x samples) per rank")
    parser.add_argument("--new_tokens", type=int, default=6)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8, help="routed experts (top-2)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sites", action="store_true", help="list each sync's source line")
    parser.add_argument(
        "--top", type=int, default=0, help="list the N most frequent ops and Python functions"
    )
    parser.add_argument("--json", help="also write the counts here")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------- adapter
def _roll_api() -> dict:
    """The few roll names this script needs, wherever the checkout keeps them."""
    try:
        from roll.core.sampling import SamplingParams
        from roll.core.worker_context import WorkerContext
    except ImportError:  # before aba25f2 (2026-11-24)
        from roll.distributed.strategy.base import SamplingParams, WorkerContext
    from roll.configs.role import ModelArgs, RoleConfig
    from roll.configs.strategy_configs import MegatronConfig
    from roll.models.megatron.forward import shape_sync_group
    from roll.models.megatron.kv_generate import generate_tokens
    from roll.models.megatron.runtime import build_chunks

    return dict(
        SamplingParams=SamplingParams,
        WorkerContext=WorkerContext,
        ModelArgs=ModelArgs,
        RoleConfig=RoleConfig,
        MegatronConfig=MegatronConfig,
        shape_sync_group=shape_sync_group,
        generate_tokens=generate_tokens,
        build_chunks=build_chunks,
    )


# ---------------------------------------------------------------------------------- counting
# Python frames that exist only because this script and the CPU shims watch torch calls.
WATCHERS = (__file__, "cuda_on_cpu.py", "torch/overrides.py", "torch/utils/_python_dispatch.py")


class Counts:
    """Per phase: aten ops, Python calls, syncs (by kind and by source line), collectives."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.on = False  # ops and syncs are counted in the counted run only
        self.data: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.detail: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, key: str, sync_kind: str | None = None, detail: str | None = None) -> None:
        if not self.on:
            return
        self.data[self.phase][key] += 1
        if detail is not None:
            self.detail[self.phase][detail] += 1
        if sync_kind is not None:
            self.data[self.phase]["sync:" + sync_kind] += 1
            self.sites[self.phase][f"{sync_kind} @ {_caller()}"] += 1


def _caller() -> str:
    """The innermost frame outside torch and this file: where a sync was asked for."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith(("megatron_decode_ops.py", "cuda_on_cpu.py")):
            parts = Path(name).parts
            short = "/".join(parts[-3:]) if "roll" not in parts else "/".join(parts[parts.index("roll") :])
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _host(value) -> bool:
    return getattr(value, "_roll_host", False)


def _modes(counts: Counts):
    """A dispatch mode (aten ops, collectives, syncing ops) and a function mode (``tolist``,
    ``cpu``, ``numpy``, ``.to("cpu")``). Tensors that are on the host in a GPU run too (tagged
    ``_roll_host``: the dispatcher's copied split sizes, its index constants, and whatever is
    computed from host tensors only) are not counted as syncs."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils import _pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ns, name = func.namespace, func._schema.name.split("::")[-1]
            inputs = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            host = bool(inputs) and all(_host(t) for t in inputs)
            if ns == "c10d":
                counts.add("collectives", detail=f"c10d.{name}")
            else:
                counts.add("aten ops", detail=f"aten.{name} @ {_caller()}")
                sync = name in SYNC_ATEN or (name == "repeat_interleave" and "output_size" not in kwargs)
                if sync and not host:
                    counts.add("syncs", name)
            out = func(*args, **kwargs)
            if host:
                for t in _pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        t._roll_host = True
            return out

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            cpu_to = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
            if (name in SYNC_METHODS or cpu_to) and not (args and _host(args[0])):
                counts.add("syncs", "to(cpu)" if cpu_to else name)
            return func(*args, **kwargs)

    return Dispatch(), Function()


def tag_host_tensors(chunks, counts: Counts) -> None:
    """Tag what a GPU run keeps on the host: the all-to-all dispatcher's index constants
    (``permute_idx_device`` "cpu") and the split sizes it copies to the host, whose one wait
    (``d2h_event.synchronize``) is counted instead."""
    import cuda_on_cpu
    import torch
    from megatron.core.transformer.moe import token_dispatcher

    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if getattr(dispatcher, "permute_idx_device", None) == "cpu":
                for value in vars(dispatcher).values():
                    if isinstance(value, torch.Tensor):
                        value._roll_host = True
    moved = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.clone()
            tensor._roll_host = True
        return moved(tensor, as_numpy, record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    for cls in (cuda_on_cpu._CpuEvent, cuda_on_cpu._CpuStream):
        cls.synchronize = lambda self: counts.add("syncs", "event.synchronize")


def _profile(counts: Counts):
    """Python function calls, less the frames of the watchers and the calls they make."""

    def hook(frame, event, arg):
        if event != "call":
            return
        for f in (frame, frame.f_back):
            if f is not None and f.f_code.co_filename.endswith(WATCHERS):
                return
        counts.data[counts.phase]["py calls"] += 1
        code = frame.f_code
        parts = Path(code.co_filename).parts
        where = "/".join(parts[parts.index("roll") :] if "roll" in parts else parts[-2:])
        counts.detail[counts.phase][f"py {where}:{code.co_name}"] += 1

    return hook


# ---------------------------------------------------------------------------------- one rank
def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    sys.path[:0] = [args.repo, str(HERE / "tests" / "megatron"), str(HERE / "tests")]
    import compat
    import torch
    import torch.distributed as dist
    from cuda_on_cpu import cuda_on_cpu
    from tiny_models import tiny_qwen3_moe_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    compat.apply()
    api = _roll_api()
    layout = {
        "tensor_model_parallel_size": args.tp,
        "expert_model_parallel_size": args.ep,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": True,
    }
    cfg = api["MegatronConfig"](**layout)
    role = api["RoleConfig"](model_args=api["ModelArgs"](dtype="fp32"))
    ctx = api["WorkerContext"]("actor_infer", rank, world, rank, torch.device("cpu"), seed=7)
    counts = Counts()
    with cuda_on_cpu():
        hf_config, chunks = api["build_chunks"](
            role, ctx, cfg, tiny_qwen3_moe_config(num_hidden_layers=args.layers, num_experts=args.experts)
        )
        for chunk in chunks:
            chunk.eval()
        tag_host_tensors(chunks, counts)
        gen = torch.Generator().manual_seed(dist.get_rank() // args.tp)
        prompts = [torch.randint(3, 250, (4 + i % 5,), generator=gen).tolist() for i in range(args.rows)]
        params = api["SamplingParams"](n=1, max_new_tokens=args.new_tokens, temperature=args.temperature)

        def call():
            torch.manual_seed(11)
            group = api["shape_sync_group"](cfg)
            return api["generate_tokens"](chunks, prompts, params, [], hf_config.vocab_size, 0, None, group)

        call()  # warm-up: lazy buffers, first-call caches
        steps = iter(range(10**9))
        chunks[0].register_forward_pre_hook(lambda *_: setattr(counts, "phase", f"step{next(steps)}"))
        sys.setprofile(_profile(counts))  # Python calls, without the op counters' own frames
        try:
            tokens, _ = call()
        finally:
            sys.setprofile(None)
        counts.phase, steps = "setup", iter(range(10**9))
        dispatch, function = _modes(counts)
        counts.on = True
        with function, dispatch:
            again, _ = call()
        counts.on = False
        if again != tokens:
            raise RuntimeError("the counted runs generated different tokens")
    if rank == 0:
        data = {k: dict(v) for k, v in counts.data.items()}
        sites = {k: dict(v) for k, v in counts.sites.items()}
        detail = {k: dict(v) for k, v in counts.detail.items()}
        Path(out).write_text(json.dumps({"counts": data, "sites": sites, "detail": detail, "tokens": tokens}))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------- report
def summarize(counts: dict[str, dict[str, int]]) -> dict[str, dict[str, float]]:
    """Set-up, the prefill (step 0, with its sampling), the mean decode step (steps 1 .. n-2) and
    the last step with the end (its sampling and the results' copy to the host), per counter."""
    steps = sorted(int(k[4:]) for k in counts if k.startswith("step"))
    decode = [counts[f"step{i}"] for i in steps[1:-1]]
    keys = sorted({key for v in counts.values() for key in v})
    mean = {key: sum(v.get(key, 0) for v in decode) / max(1, len(decode)) for key in keys}
    return {
        "set-up": {k: counts.get("setup", {}).get(k, 0) for k in keys},
        "prefill": {k: counts.get("step0", {}).get(k, 0) for k in keys},
        "decode step": mean,
        "last step + end": {k: counts.get(f"step{steps[-1]}", {}).get(k, 0) for k in keys},
    }


def decode_mean(per_phase: dict[str, dict[str, int]], new_tokens: int) -> collections.Counter:
    """The mean over decode steps 1 .. n-2 of per-phase counters."""
    total: collections.Counter = collections.Counter()
    for phase, values in per_phase.items():
        if phase.startswith("step") and phase not in ("step0", f"step{new_tokens - 1}"):
            total.update(values)
    steps = max(1, new_tokens - 2)
    return collections.Counter({k: v / steps for k, v in total.items()})


def table(summary: dict[str, dict[str, float]]) -> str:
    keys = ["aten ops", "py calls", "syncs", "collectives"]
    keys += sorted(k for k in next(iter(summary.values())) if k.startswith("sync:"))
    lines = ["| phase | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for phase, row in summary.items():
        lines.append(f"| {phase} | " + " | ".join(f"{row.get(k, 0):g}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch.multiprocessing as mp

    sys.path.insert(0, str(HERE))
    from roll.utils.ports import free_port

    world = args.tp * args.ep
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "counts.json")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        mp.spawn(_rank, args=(world, free_port(), args, out), nprocs=world, join=True)
        result = json.loads(Path(out).read_text())
    summary = summarize(result["counts"])
    print(
        f"repo {args.repo}: TP={args.tp} EP={args.ep}, {args.rows} rows/rank, {args.new_tokens} tokens, rank 0"
    )
    print(table(summary))
    if args.sites:
        print("\nsyncs per decode step, by source line:")
        for site, n in decode_mean(result["sites"], args.new_tokens).most_common():
            print(f"  {n:6.1f}  {site}")
    if args.top:
        print(f"\nthe {args.top} most frequent ops and Python functions per decode step:")
        for name, n in decode_mean(result["detail"], args.new_tokens).most_common(args.top):
            print(f"  {n:6.1f}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, **result}, indent=1))


if __name__ == "__main__":
    main()
