"""Model-update benchmark: trainer -> engine weight sync time by phase, against the NCCL bound.

Four processes on 2 GPUs (ranks: 0 = trainer on GPU 0, 1 = trainer on GPU 1, 2 = engine on GPU 0,
3 = engine on GPU 1) run the production pieces (``Link``, ``BucketSender``, ``receive_links``)
with random weights in bf16:

- the trainer side holds Megatron-layout shards (QKV fused and interleaved per KV group, gate/up
  fused, MoE experts stacked) and its ``iter_hf_weights`` gathers TP shards over NCCL and converts
  them to HF names, as ``megatron_train`` does; experts go out from their EP rank;
- the engine side holds HF-named parameters and loads each bucket by ``copy_`` (as ``hf_infer``).

Layouts: ``disagg`` (trainer GPU 0 -> engine GPU 1, NCCL), ``colocated`` (trainer and engine on
GPU 0, CUDA IPC), ``colocated_tp2`` (TP2/EP2 trainer on both GPUs, an engine on each: one IPC link
and one NCCL link per engine).

Phases, each timed alone with the device synchronized (after one untimed pass): gather+convert
(the weight generator), pack (copies into bucket buffers), checksum, wire (NCCL broadcast of the
same buckets), load (unpack + copy into the engine, one ``copy_`` per tensor as ``hf_infer``). ``sync`` is the real pipelined update (median of ``--reps``).
``bw`` is a 1 GiB NCCL broadcast GPU 0 -> GPU 1 measured in the same run; ``bound`` = bytes / bw
and ``ratio`` = sync / bound.

    python benchmarks/model_update.py --models 1.5b,7b,moe --out model_update.json
    python benchmarks/model_update.py --device cpu --models tiny      # the same code on gloo
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from roll.distributed.model_update.bucket import align, iter_buckets, pack_bucket, unpack_bucket  # noqa: E402
from roll.distributed.model_update.checksum import bucket_checksums  # noqa: E402
from roll.distributed.model_update.link import Link, LinkSpec  # noqa: E402
from roll.distributed.model_update.receiver import BucketReceiver, receive_links  # noqa: E402
from roll.distributed.model_update.sender import BucketSender  # noqa: E402


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    experts: int = 0
    moe_inter: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


MODELS = {
    "tiny": ModelSpec("tiny", 64, 128, 2, 4, 2, 512, True, 0, 0),
    "tiny_moe": ModelSpec("tiny_moe", 64, 128, 2, 4, 2, 512, False, 4, 32),
    "small": ModelSpec("small", 256, 768, 4, 4, 2, 8192, False),  # CPU smoke run: oversized buckets
    # Qwen2.5-1.5B and Qwen2.5-7B shapes; a small Qwen-MoE-like model (12 layers x 32 experts).
    "1.5b": ModelSpec("1.5b", 1536, 8960, 28, 12, 2, 151936, True),
    "7b": ModelSpec("7b", 3584, 18944, 28, 28, 4, 152064, False),
    "moe": ModelSpec("moe", 2048, 0, 12, 16, 4, 151936, False, 32, 768),
}
TRAINERS, ENGINES = (0, 1), (2, 3)
GPU = {0: 0, 1: 1, 2: 0, 3: 1}
# layout -> (trainer ranks, engine ranks, {trainer rank: engine ranks on the same GPU})
LAYOUTS = {
    "disagg": ((0,), (3,), {}),
    "colocated": ((0,), (2,), {0: {2}}),
    "colocated_tp2": ((0, 1), (2, 3), {0: {2}, 1: {3}}),
}


# ----------------------------------------------------------------------------- trainer side
class ShardedTrainer:
    """Megatron-layout shards of one TP/EP rank and an ``iter_hf_weights`` like megatron_train's."""

    def __init__(self, spec: ModelSpec, rank: int, tp: int, group, device: torch.device, dtype: torch.dtype):
        self.spec, self.rank, self.tp, self.group, self.device = spec, rank, tp, group, device
        s, d = spec, spec.head_dim
        qkv_rows = (s.heads + 2 * s.kv_heads) * d
        self.params: dict[str, torch.Tensor] = {}

        def new(name: str, *shape: int) -> None:
            self.params[name] = torch.empty(shape, dtype=dtype, device=device).uniform_(-0.05, 0.05)

        new("embed", s.vocab // tp, s.hidden)
        if not s.tied:
            new("lm_head", s.vocab // tp, s.hidden)
        new("norm", s.hidden)
        for i in range(s.layers):
            new(f"{i}.qkv", qkv_rows // tp, s.hidden)
            new(f"{i}.qkv_bias", qkv_rows // tp)
            new(f"{i}.proj", s.hidden, s.heads * d // tp)
            new(f"{i}.ln1", s.hidden)
            new(f"{i}.ln2", s.hidden)
            if s.experts:
                new(f"{i}.router", s.experts, s.hidden)
                new(f"{i}.experts_fc1", s.experts // tp, 2 * s.moe_inter, s.hidden)
                new(f"{i}.experts_fc2", s.experts // tp, s.hidden, s.moe_inter)
            else:
                new(f"{i}.fc1", 2 * s.inter // tp, s.hidden)
                new(f"{i}.fc2", s.hidden, s.inter // tp)

    def _gather(self, shard: torch.Tensor, dim: int) -> torch.Tensor:
        if self.tp == 1:
            return shard
        out = torch.empty((self.tp * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=self.device)
        if dim == 0:
            dist.all_gather_into_tensor(out, shard.contiguous(), group=self.group)
            return out
        dist.all_gather_into_tensor(out, shard.contiguous(), group=self.group)  # [tp*rows, cols/tp]
        rows = shard.shape[0]
        return out.view(self.tp, rows, -1).permute(1, 0, 2).reshape(rows, -1)

    def iter_hf_weights(self):
        s, p, d = self.spec, self.params, self.spec.head_dim
        lead = self.rank == 0
        embed = self._gather(p["embed"], 0)
        if lead:
            yield "model.embed_tokens.weight", embed
        for i in range(s.layers):
            yield from self._attention(i, lead, d)
            if s.experts:
                yield from self._experts(i, lead)
            else:
                fc1 = self._gather(p[f"{i}.fc1"], 0).view(self.tp, 2, s.inter // self.tp, s.hidden)
                fc2 = self._gather(p[f"{i}.fc2"], 1)
                if lead:
                    yield f"model.layers.{i}.mlp.gate_proj.weight", fc1[:, 0].reshape(s.inter, s.hidden)
                    yield f"model.layers.{i}.mlp.up_proj.weight", fc1[:, 1].reshape(s.inter, s.hidden)
                    yield f"model.layers.{i}.mlp.down_proj.weight", fc2
        if lead:
            yield "model.norm.weight", p["norm"]
        if not s.tied:
            head = self._gather(p["lm_head"], 0)
            if lead:
                yield "lm_head.weight", head

    def _attention(self, i: int, lead: bool, d: int):
        s, p = self.spec, self.params
        group = s.heads // s.kv_heads
        qkv = self._gather(p[f"{i}.qkv"], 0).view(s.kv_heads, (group + 2) * d, s.hidden)
        bias = self._gather(p[f"{i}.qkv_bias"], 0).view(s.kv_heads, (group + 2) * d)
        proj = self._gather(p[f"{i}.proj"], 1)
        if not lead:
            return
        prefix = f"model.layers.{i}"
        parts = {
            "q": (0, group * d),
            "k": (group * d, (group + 1) * d),
            "v": ((group + 1) * d, (group + 2) * d),
        }
        for name, (a, b) in parts.items():
            yield f"{prefix}.self_attn.{name}_proj.weight", qkv[:, a:b].reshape(-1, s.hidden)
            yield f"{prefix}.self_attn.{name}_proj.bias", bias[:, a:b].reshape(-1)
        yield f"{prefix}.self_attn.o_proj.weight", proj
        yield f"{prefix}.input_layernorm.weight", p[f"{i}.ln1"]
        yield f"{prefix}.post_attention_layernorm.weight", p[f"{i}.ln2"]

    def _experts(self, i: int, lead: bool):
        s, p = self.spec, self.params
        if lead:
            yield f"model.layers.{i}.mlp.gate.weight", p[f"{i}.router"]
        local = s.experts // self.tp
        fc1, fc2 = p[f"{i}.experts_fc1"], p[f"{i}.experts_fc2"]
        for e in range(local):
            name = f"model.layers.{i}.mlp.experts.{self.rank * local + e}"
            yield f"{name}.gate_proj.weight", fc1[e, : s.moe_inter]
            yield f"{name}.up_proj.weight", fc1[e, s.moe_inter :]
            yield f"{name}.down_proj.weight", fc2[e]


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model (what an engine holds): a TP=1 trainer's yield, on meta."""
    trainer = ShardedTrainer(spec, 0, 1, None, torch.device("meta"), torch.bfloat16)
    return {n: tuple(t.shape) for n, t in trainer.iter_hf_weights()}


# ------------------------------------------------------------------------------- measurement
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    dist.barrier()


def phase_iter_pack(trainer: ShardedTrainer, bucket_bytes: int, device) -> dict:
    """Gather+convert, pack and checksum timed apart (device synchronized between them)."""
    times = {"gather_convert_s": 0.0, "pack_s": 0.0, "checksum_s": 0.0}
    sizes, metas = [], []
    buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    named_iter = _timed(trainer.iter_hf_weights(), device, times)
    for index, named in enumerate(iter_buckets(named_iter, bucket_bytes)):
        start = time.perf_counter()
        meta, flat = pack_bucket(named, 0, index, False, out=buffers[index % 2])
        if flat.numel() > buffers[index % 2].numel():  # an oversized tensor: keep the bigger buffer
            buffers[index % 2] = flat
        sync(device)
        times["pack_s"] += time.perf_counter() - start
        start = time.perf_counter()
        bucket_checksums(meta, flat)
        sync(device)
        times["checksum_s"] += time.perf_counter() - start
        sizes.append(meta.nbytes)
        metas.append(meta)
    return times | {"sizes": sizes, "metas": metas}


def _timed(named_iter, device, times: dict):
    while True:
        start = time.perf_counter()
        item = next(named_iter, None)
        sync(device)
        times["gather_convert_s"] += time.perf_counter() - start
        if item is None:
            return
        yield item


def nccl_bandwidth(group, device, nbytes: int, reps: int = 5) -> float:
    """GB/s of a broadcast from group rank 0 (median over ``reps`` after a warm-up)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for i in range(reps + 1):
        barrier_group(group, device)
        start = time.perf_counter()
        dist.broadcast(buf, group_src(group, 0), group=group)
        sync(device)
        barrier_group(group, device)
        if i:
            times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def group_src(group, rank_in_group: int) -> int:
    return dist.get_global_rank(group, rank_in_group)


def barrier_group(group, device) -> None:
    sync(device)
    dist.barrier(group=group)


# ---------------------------------------------------------------------------------- members
def run_member(rank: int, args: argparse.Namespace, ports: dict) -> None:
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(GPU[rank])
    device = torch.device("cuda", GPU[rank]) if cuda else torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["world"]))
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(minutes=10))
    backend = "nccl" if cuda else "gloo"
    tp_group = dist.new_group(list(TRAINERS), backend=backend)
    bw_group = dist.new_group([0, 3], backend=backend)  # GPU 0 -> GPU 1
    if rank in TRAINERS:  # start the TP communicator outside the timed phases
        dist.all_gather_into_tensor(
            torch.empty(2, device=device), torch.ones(1, device=device), group=tp_group
        )
    nbytes = (1 << 30) if cuda else (64 << 20)
    bw = nccl_bandwidth(bw_group, device, nbytes) if rank in (0, 3) else None
    rows = []
    for model in args.models.split(","):
        spec = MODELS[model]
        shapes = hf_shapes(spec)
        for layout in args.layouts.split(","):
            row = run_layout(
                rank, spec, shapes, layout, args, ports[(model, layout)], tp_group, device, backend
            )
            rows.append(row)
    gathered = [None] * 4
    dist.all_gather_object(gathered, {"rows": rows, "bw": bw})
    if rank == 0:
        report(gathered, args)
    dist.destroy_process_group()


def run_layout(rank, spec, shapes, layout, args, port, tp_group, device, backend) -> dict:
    trainers, engines, local = LAYOUTS[layout]
    tp = len(trainers)
    bucket_bytes = align(args.bucket_mb << 20)
    specs = [
        LinkSpec(
            f"bench/{spec.name}/{layout}/{t}",
            i,
            "127.0.0.1",
            port[i],
            tuple(range(len(engines))),
            tuple(e in local.get(t, ()) for e in engines),
            backend,
        )
        for i, t in enumerate(trainers)
    ]
    dtype = torch.bfloat16
    result: dict = {"model": spec.name, "layout": layout, "rank": rank}
    barrier()
    if rank in trainers:
        group = tp_group if tp > 1 else None
        trainer = ShardedTrainer(spec, trainers.index(rank), tp, group, device, dtype)
        sync(device)
        result |= trainer_phases(trainer, specs[trainers.index(rank)], bucket_bytes, device, args.reps)
        del trainer
    elif rank in engines:
        engine = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in shapes.items()}
        result |= engine_phases(engine, specs, engines.index(rank), device, args.reps)
        del engine
    else:
        for _ in range(phase_barriers(args.reps)):
            barrier()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def phase_barriers(reps: int) -> int:
    return 3 + 2 * (reps + 1)


def trainer_phases(trainer: ShardedTrainer, spec: LinkSpec, bucket_bytes: int, device, reps: int) -> dict:
    phase_iter_pack(trainer, bucket_bytes, device)  # warm-up: allocator, kernels
    out = phase_iter_pack(trainer, bucket_bytes, device)
    sizes, metas = out.pop("sizes"), out.pop("metas")
    link = Link.connect(spec, "sender", device)
    barrier()  # 1: links up
    link.control.send([m for m in metas if m.nbytes])  # the layouts, for the receivers' load phase
    wire_s = 0.0
    sizes = [n for n in sizes if n]
    if link.data is not None and sizes:
        flat = torch.empty(max(sizes), dtype=torch.uint8, device=device)
        link.data.send(flat[: sizes[0]]).wait()  # warm-up: the NCCL communicator starts here
        barrier_group(None, device)  # 2
        start = time.perf_counter()
        for n in sizes:
            link.data.send(flat[:n]).wait()
        sync(device)
        wire_s = time.perf_counter() - start
    else:
        barrier()  # 2
    barrier()  # 3: receivers done with the load phase
    sender = BucketSender(link, device, bucket_bytes)
    times, sent = [], None
    for _ in range(reps + 1):  # the first opens IPC handles and NCCL communicators
        barrier_group(None, device)
        start = time.perf_counter()
        sent = sender.send(trainer.iter_hf_weights(), version=1)
        barrier_group(None, device)
        times.append(time.perf_counter() - start)
    return out | {
        "wire_s": wire_s,
        "bytes": sent.nbytes,
        "buckets": sent.buckets,
        "tensors": len(sent.names),
        "sync_s": statistics.median(times[1:]),
        "sync_first_s": times[0],
        # The last update's host-side view: time in the generator, blocked on buffer reuse, total.
        "send_iter_s": sent.iter_s,
        "send_wait_s": sent.wait_s,
        "send_total_s": sent.total_s,
        "checksums": sent.checksums,
        "names": sent.names,
    }


def engine_phases(engine: dict, specs: list[LinkSpec], who: int, device, reps: int) -> dict:
    links = [Link.connect(spec, who, device) for spec in specs]
    barrier()  # 1
    per_link = [link.control.recv() for link in links]
    metas = [m for link_metas in per_link for m in link_metas]
    buffer = torch.empty(max((m.nbytes for m in metas), default=0), dtype=torch.uint8, device=device)
    remote = [(link, m) for link, m in zip(links, per_link) if link.data is not None and m]
    for link, link_metas in remote:
        link.data.recv(buffer[: link_metas[0].nbytes]).wait()  # warm-up
    barrier_group(None, device)  # 2
    for link, link_metas in remote:  # the wire phase (timed on the sender)
        for meta in link_metas:
            link.data.recv(buffer[: meta.nbytes]).wait()
    sync(device)
    start = time.perf_counter()
    for meta in metas:
        for name, tensor in unpack_bucket(meta, buffer):
            engine[name].copy_(tensor)
    sync(device)
    load_s = time.perf_counter() - start
    barrier()  # 3
    receivers = [BucketReceiver(link, device) for link in links]

    def load(named):
        for name, tensor in named:
            engine[name].copy_(tensor)

    results = None
    for _ in range(reps + 1):
        barrier_group(None, device)
        results = receive_links(receivers, load, version=1)
        barrier_group(None, device)
    return {
        "load_s": load_s,
        "links": [(r.names, r.checksums) for r in results],
        "local": [link.is_local for link in links],
        "recv_wait_s": max(r.wait_s for r in results),
        "recv_load_s": max(r.load_s for r in results),
        "recv_total_s": max(r.total_s for r in results),
    }


# --------------------------------------------------------------------------------- reporting
def report(gathered: list[dict], args: argparse.Namespace) -> None:
    bw = gathered[0]["bw"]
    table = []
    by_key: dict[tuple[str, str], list[dict]] = {}
    for member in gathered:
        for row in member["rows"]:
            by_key.setdefault((row["model"], row["layout"]), []).append(row)
    for (model, layout), rows in by_key.items():
        senders = [r for r in rows if "sync_s" in r]
        engines = [r for r in rows if "load_s" in r]
        check_bit_identity(senders, engines, model, layout)
        nbytes = sum(r["bytes"] for r in senders)
        bound = nbytes / (bw * 1e9)
        sync_s = max(r["sync_s"] for r in senders)
        table.append(
            {
                "model": model,
                "layout": layout,
                "GB": nbytes / 1e9,
                "tensors": sum(r["tensors"] for r in senders),
                "buckets": sum(r["buckets"] for r in senders),
                "gather_convert_s": max(r["gather_convert_s"] for r in senders),
                "pack_s": max(r["pack_s"] for r in senders),
                "checksum_s": max(r["checksum_s"] for r in senders),
                "wire_s": max(r["wire_s"] for r in senders),
                "load_s": max(r["load_s"] for r in engines),
                "sync_s": sync_s,
                "sync_first_s": max(r["sync_first_s"] for r in senders),
                "send_iter_s": max(r["send_iter_s"] for r in senders),
                "send_wait_s": max(r["send_wait_s"] for r in senders),
                "send_total_s": max(r["send_total_s"] for r in senders),
                "recv_wait_s": max(r["recv_wait_s"] for r in engines),
                "recv_load_s": max(r["recv_load_s"] for r in engines),
                "recv_total_s": max(r["recv_total_s"] for r in engines),
                "bw_GBps": bw,
                "bound_s": bound,
                "ratio": sync_s / bound,
            }
        )
    cols = ["model", "layout", "GB", "tensors", "buckets", "gather_convert_s", "pack_s", "checksum_s"]
    cols += ["wire_s", "load_s", "sync_s", "bw_GBps", "bound_s", "ratio"]
    host = ["model", "layout", "sync_first_s", "send_iter_s", "send_wait_s", "send_total_s"]
    host += ["recv_wait_s", "recv_load_s", "recv_total_s"]
    for columns in (cols, host):
        print(" | ".join(columns))
        for row in table:
            print(" | ".join(f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c]) for c in columns))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": table}, indent=1))


def check_bit_identity(senders: list[dict], engines: list[dict], model: str, layout: str) -> None:
    """Every engine received every sender's tensors with the sender's checksums."""
    for engine in engines:
        for sender, (names, sums) in zip(sorted(senders, key=lambda r: r["rank"]), engine["links"]):
            if names != sender["names"] or [tuple(s) for s in sums] != [
                tuple(s) for s in sender["checksums"]
            ]:
                raise AssertionError(f"{model}/{layout}: engine rank {engine['rank']} got different tensors")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="1.5b,7b,moe")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--bucket_mb", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 CUDA GPUs (or --device cpu)")
    ports = {"world": _free_port()}
    for model in args.models.split(","):
        for layout in args.layouts.split(","):
            ports[(model, layout)] = [_free_port() for _ in LAYOUTS[layout][0]]
    mp.start_processes(run_member, args=(args, ports), nprocs=4, start_method="spawn")


if __name__ == "__main__":
    main()
