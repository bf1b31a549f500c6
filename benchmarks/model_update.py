"""Model-update benchmark: trainer -> engine weight sync time by phase, against the NCCL bound.

``--gpus N`` (2 or 4; with ``--device cpu`` the "GPUs" are slots) starts 2N processes: a trainer
rank and an engine rank per GPU (ranks 0..N-1 = trainers on GPUs 0..N-1, ranks N..2N-1 = engines on
GPUs 0..N-1). They run the production pieces (``Link``, ``BucketSender``, ``receive_links``) with
random weights in bf16:

- the trainer side holds Megatron-layout shards (QKV fused and interleaved per KV group, gate/up
  fused, MoE experts stacked) and its ``iter_hf_weights`` gathers TP shards over NCCL and converts
  them to HF names, as ``megatron_train`` does; experts go out from their EP rank. As in production,
  the TP lead (trainer rank 0 of the layout) sends every dense tensor and each EP rank its own
  experts; a rank with nothing to send sends one empty bucket;
- the engine side holds HF-named parameters and loads each bucket with ``copy_into`` (as ``hf_infer``:
  one multi-tensor copy per bucket).

Layouts (``LAYOUTS``; a trainer and an engine on one GPU talk by CUDA IPC, the others by NCCL):

- 2 GPUs: ``disagg`` (trainer GPU 0 -> engine GPU 1), ``colocated`` (trainer and engine on GPU 0),
  ``colocated_tp2`` (TP2/EP2 trainer on GPUs 0-1, an engine on each: one IPC and one NCCL link each);
- 4 GPUs, besides those three: ``disagg_tp2`` (TP2/EP2 trainer on GPUs 0-1 -> engines on GPUs 2-3,
  each engine on two NCCL links), ``disagg_1to3`` (trainer GPU 0 -> engines on GPUs 1-3, one NCCL
  broadcast to three receivers), ``colocated_tp4`` (TP4/EP4 trainer on GPUs 0-3, an engine on
  each: one IPC and three NCCL links per engine).

Phases, each timed alone with the device synchronized (after one untimed pass): gather+convert
(the weight generator), pack (copies into bucket buffers), checksum, wire (NCCL broadcast of the
same buckets), load (unpack + ``copy_into`` the engine, as ``hf_infer``). ``sync`` is the real pipelined update (median of ``--reps``).

Bandwidth (``BANDWIDTHS``, 1 GiB NCCL broadcasts in the same run, median of 5): ``bw`` = GPU 0 ->
GPU 1; with 4 GPUs also ``bw_1to2`` = GPU 0 -> GPUs 2-3 and ``bw_1to3`` = GPU 0 -> GPUs 1-3. Each
row's bound uses the broadcast of its lead trainer's fan-out (the ``bw`` column names it):
``disagg``, ``colocated_tp2`` -> ``bw``; ``disagg_tp2`` -> ``bw_1to2``; ``disagg_1to3``,
``colocated_tp4`` -> ``bw_1to3``; ``colocated`` (IPC only) is held to ``bw``. ``bound`` = bytes /
that bandwidth (one stream: EP senders sending at once can beat it) and ``ratio`` = sync / bound.

    python benchmarks/model_update.py --models 1.5b,7b,moe --out model_update.json
    python benchmarks/model_update.py --gpus 4 --models 1.5b,7b,moe --out model_update_4gpu.json
    python benchmarks/model_update.py --device cpu --models tiny      # the same code on gloo
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from roll.distributed.model_update.receiver import BucketReceiver, receive_links  # noqa: E402
from roll.distributed.model_update.sender import BucketSender  # noqa: E402
from roll.distributed.transport.bucket import align, iter_buckets, pack_bucket, unpack_bucket  # noqa: E402
from roll.distributed.transport.checksum import bucket_checksums  # noqa: E402
from roll.distributed.transport.link import Link, LinkSpec  # noqa: E402
from roll.models.weights import copy_into  # noqa: E402
from roll.utils.ports import free_port  # noqa: E402


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
# name -> (source GPU, destination GPUs): a broadcast from the trainer rank on the source GPU to the
# engine ranks on the destination GPUs.
BANDWIDTHS = {"bw": (0, (1,)), "bw_1to2": (0, (2, 3)), "bw_1to3": (0, (1, 2, 3))}


@dataclass(frozen=True)
class Layout:
    """Trainer GPUs (one TP/EP group), engine GPUs, and the ``BANDWIDTHS`` entry that bounds it.

    Trainer rank = its GPU; engine rank = ``gpus`` + its GPU (``gpus`` = processes per side). A trainer
    reaches the engine on its own GPU by IPC and the others by NCCL. ``bw`` must be the broadcast
    of the lead trainer's fan-out: from its GPU to the engines' GPUs other than its own."""

    trainer_gpus: tuple[int, ...]
    engine_gpus: tuple[int, ...]
    bw: str

    def __post_init__(self) -> None:
        lead = self.trainer_gpus[0]
        remote = tuple(g for g in self.engine_gpus if g != lead)
        if remote and BANDWIDTHS[self.bw] != (lead, remote):
            raise ValueError(f"layout {self}: bandwidth {self.bw} is not GPU {lead} -> GPUs {remote}")

    @property
    def gpus_needed(self) -> int:
        return 1 + max(self.trainer_gpus + self.engine_gpus)

    def engines(self, gpus: int) -> tuple[int, ...]:
        return tuple(gpus + g for g in self.engine_gpus)

    def local(self, trainer_gpu: int) -> tuple[bool, ...]:
        """Per engine: does it share ``trainer_gpu`` (an IPC link) or not (NCCL)."""
        return tuple(g == trainer_gpu for g in self.engine_gpus)


LAYOUTS = {
    "disagg": Layout((0,), (1,), "bw"),
    "colocated": Layout((0,), (0,), "bw"),
    "colocated_tp2": Layout((0, 1), (0, 1), "bw"),
    "disagg_tp2": Layout((0, 1), (2, 3), "bw_1to2"),
    "disagg_1to3": Layout((0,), (1, 2, 3), "bw_1to3"),
    "colocated_tp4": Layout((0, 1, 2, 3), (0, 1, 2, 3), "bw_1to3"),
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


def check_split(spec: ModelSpec, tp: int) -> None:
    """Raise if ``spec`` does not split evenly over ``tp`` trainer ranks (rows, heads, experts)."""
    dims = {
        "vocab": spec.vocab,
        "(heads + 2 * kv_heads) * head_dim": (spec.heads + 2 * spec.kv_heads) * spec.head_dim,
        "heads * head_dim": spec.heads * spec.head_dim,
    }
    dims |= {"experts": spec.experts} if spec.experts else {"inter": spec.inter}
    uneven = [f"{name}={value}" for name, value in dims.items() if value % tp]
    if uneven:
        raise SystemExit(f"model {spec.name}: {', '.join(uneven)} not divisible by TP/EP {tp}")


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


def nccl_bandwidth(group, device, nbytes: int, member: bool, reps: int = 5) -> float | None:
    """GB/s of a broadcast from group rank 0 (median over ``reps`` after a warm-up), timed on the
    source from a world barrier to the end of its broadcast. Every rank calls this (the barriers are
    the world's, over gloo); only ``member`` ranks broadcast. Returns None off the group."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device) if member else None
    times = []
    for i in range(reps + 1):
        sync(device)
        barrier()
        start = time.perf_counter()
        if member:
            dist.broadcast(buf, group_src(group, 0), group=group)
            sync(device)
        if i:
            times.append(time.perf_counter() - start)
    barrier()
    return nbytes / statistics.median(times) / 1e9 if member else None


def group_src(group, rank_in_group: int) -> int:
    return dist.get_global_rank(group, rank_in_group)


def synced_barrier(device) -> None:
    """The device's queued work done, then a world (gloo) barrier."""
    sync(device)
    barrier()


# ---------------------------------------------------------------------------------- members
@dataclass
class Member:
    """One process: its rank, device, the TP/EP groups (by trainer ranks) and the run's arguments."""

    rank: int
    gpus: int
    device: torch.device
    backend: str
    args: argparse.Namespace
    tp_groups: dict


def run_member(rank: int, args: argparse.Namespace, world_port: int) -> None:
    torch.set_num_threads(1)
    cuda, gpus = args.device == "cuda", args.gpus
    device = torch.device("cuda", rank % gpus) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(world_port))
    dist.init_process_group("gloo", rank=rank, world_size=2 * gpus, timeout=datetime.timedelta(minutes=10))
    faulthandler.dump_traceback_later(args.watchdog_s, exit=False)  # set-up and bandwidths
    backend = "nccl" if cuda else "gloo"
    layouts = args.layouts.split(",")
    member = Member(rank, gpus, device, backend, args, make_tp_groups(layouts, rank, device, backend))
    nbytes = bandwidth_bytes(args.device)
    bw = measure_bandwidths(bandwidths_for(layouts), member, nbytes)
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        print(f"[model_update] bandwidths: {bw}", flush=True)
    rows = []
    for model in args.models.split(","):
        spec = MODELS[model]
        shapes = hf_shapes(spec)
        for layout in layouts:
            start = time.perf_counter()
            # A layout that hangs (a collective some member never joins) prints every thread's
            # stack instead of dying silently at the caller's time limit.
            faulthandler.dump_traceback_later(args.watchdog_s, exit=False)
            rows.append(run_layout(member, spec, shapes, layout))
            faulthandler.cancel_dump_traceback_later()
            if rank == 0:
                took = time.perf_counter() - start
                print(f"[model_update] {model}/{layout}: done in {took:.1f} s", flush=True)
    gathered = [None] * (2 * gpus)
    dist.all_gather_object(gathered, {"rows": rows, "bw": bw})
    if rank == 0:
        report(gathered, args)
    dist.destroy_process_group()


def make_tp_groups(layouts: list[str], rank: int, device, backend: str) -> dict:
    """One TP/EP group per distinct trainer set of ``layouts``, keyed by its ranks.

    ``new_group`` is collective over the world: every rank creates every group, in one order."""
    sets = sorted({LAYOUTS[name].trainer_gpus for name in layouts if len(LAYOUTS[name].trainer_gpus) > 1})
    groups = {ranks: dist.new_group(list(ranks), backend=backend) for ranks in sets}
    for ranks, group in groups.items():  # start the communicators outside the timed phases
        if rank in ranks:
            out = torch.empty(len(ranks), device=device)
            dist.all_gather_into_tensor(out, torch.ones(1, device=device), group=group)
    return groups


def bandwidths_for(layouts: list[str]) -> list[str]:
    """``bw`` (always, the reference of the IPC-only rows) and each layout's fan-out, in table order."""
    wanted = {"bw"} | {LAYOUTS[name].bw for name in layouts}
    return [name for name in BANDWIDTHS if name in wanted]


def measure_bandwidths(names: list[str], member: Member, nbytes: int) -> dict[str, float]:
    """GB/s of each named broadcast; only its members measure (trainer rank 0, the source, is in all)."""
    members = {}
    for name in names:
        src, dsts = BANDWIDTHS[name]
        members[name] = [src, *(member.gpus + d for d in dsts)]
    groups = {name: dist.new_group(ranks, backend=member.backend) for name, ranks in members.items()}
    measured = {
        name: nccl_bandwidth(groups[name], member.device, nbytes, member.rank in members[name])
        for name in names
    }
    return {name: value for name, value in measured.items() if value is not None}


def link_ports(trainers: tuple[int, ...], rank: int) -> list[int]:
    """Each trainer rank's store port for this layout, picked by that rank just before its links
    start (ports picked at launch were sometimes taken by the time a late layout ran)."""
    ports: list = [None] * dist.get_world_size()
    dist.all_gather_object(ports, free_ports(1)[0] if rank in trainers else None)
    return [ports[t] for t in trainers]


def run_layout(member: Member, spec: ModelSpec, shapes: dict, name: str) -> dict:
    layout, rank, device = LAYOUTS[name], member.rank, member.device
    trainers, engines = layout.trainer_gpus, layout.engines(member.gpus)
    ports = link_ports(trainers, rank)
    tp = len(trainers)
    bucket_bytes = align(member.args.bucket_mb << 20)
    receivers = tuple(range(len(engines)))
    specs = [
        LinkSpec(
            f"bench/{spec.name}/{name}/{t}",
            i,
            "127.0.0.1",
            ports[i],
            receivers,
            layout.local(t),
            member.backend,
        )
        for i, t in enumerate(trainers)
    ]
    dtype, reps = torch.bfloat16, member.args.reps
    result: dict = {"model": spec.name, "layout": name, "rank": rank}
    barrier()
    if rank in trainers:
        group = member.tp_groups[trainers] if tp > 1 else None
        trainer = ShardedTrainer(spec, trainers.index(rank), tp, group, device, dtype)
        sync(device)
        result |= trainer_phases(trainer, specs[trainers.index(rank)], bucket_bytes, device, reps)
        del trainer
    elif rank in engines:
        engine = {n: torch.zeros(s, dtype=dtype, device=device) for n, s in shapes.items()}
        result |= engine_phases(engine, specs, engines.index(rank), device, reps)
        del engine
    else:  # not in this layout: the same number of world barriers as its members
        for _ in range(phase_barriers(reps)):
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
        synced_barrier(device)  # 2
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
        synced_barrier(device)
        start = time.perf_counter()
        sent = sender.send(trainer.iter_hf_weights(), version=1)
        synced_barrier(device)
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
    synced_barrier(device)  # 2
    for link, link_metas in remote:  # the wire phase (timed on the sender)
        for meta in link_metas:
            link.data.recv(buffer[: meta.nbytes]).wait()
    sync(device)
    start = time.perf_counter()
    for meta in metas:
        copy_into(engine, unpack_bucket(meta, buffer))
    sync(device)
    load_s = time.perf_counter() - start
    barrier()  # 3
    receivers = [BucketReceiver(link, device) for link in links]

    def load(named):
        copy_into(engine, named)

    results = None
    for _ in range(reps + 1):
        synced_barrier(device)
        results = receive_links(receivers, load, version=1)
        synced_barrier(device)
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
    bandwidths = gathered[0]["bw"]  # trainer rank 0 is the source of every broadcast measured
    by_key: dict[tuple[str, str], list[dict]] = {}
    for member in gathered:
        for row in member["rows"]:
            by_key.setdefault((row["model"], row["layout"]), []).append(row)
    table = []
    for (model, layout), rows in by_key.items():
        senders = sorted((r for r in rows if "sync_s" in r), key=lambda r: r["rank"])
        engines = [r for r in rows if "load_s" in r]
        check_bit_identity(senders, engines, model, layout)
        key = LAYOUTS[layout].bw
        table.append(table_row(model, layout, senders, engines, key, bandwidths[key]))
    print(bandwidth_header(bandwidths, args))
    cols = ["model", "layout", "GB", "tensors", "buckets", "gather_convert_s", "pack_s", "checksum_s"]
    cols += ["wire_s", "load_s", "sync_s", "bw", "bw_GBps", "bound_s", "ratio"]
    host = ["model", "layout", "sync_first_s", "send_iter_s", "send_wait_s", "send_total_s"]
    host += ["recv_wait_s", "recv_load_s", "recv_total_s"]
    for columns in (cols, host):
        print(" | ".join(columns))
        for row in table:
            print(" | ".join(f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c]) for c in columns))
    if args.out:
        out = {"args": vars(args), "bandwidths_GBps": bandwidths, "rows": table}
        Path(args.out).write_text(json.dumps(out, indent=1))


def bandwidth_bytes(device: str) -> int:
    return (1 << 30) if device == "cuda" else (64 << 20)


def bandwidth_header(bandwidths: dict[str, float], args: argparse.Namespace) -> str:
    """The line above the table: which broadcast each ``bw`` key is and what it measured."""
    parts = []
    for name, value in bandwidths.items():
        src, dsts = BANDWIDTHS[name]
        where = f"GPU{'s' if len(dsts) > 1 else ''} {','.join(map(str, dsts))}"
        parts.append(f"{name} = GPU {src} -> {where}: {value:.1f} GB/s")
    size = f"{bandwidth_bytes(args.device) >> 20} MiB"
    return (
        f"# {args.gpus} GPUs ({args.device}); bound_s = bytes / the {size} broadcast of the layout's "
        f"fan-out named in column bw (median of 5): " + "; ".join(parts)
    )


SENDER_TIMES = ("gather_convert_s", "pack_s", "checksum_s", "wire_s", "sync_s", "sync_first_s")
SENDER_TIMES += ("send_iter_s", "send_wait_s", "send_total_s")
ENGINE_TIMES = ("load_s", "recv_wait_s", "recv_load_s", "recv_total_s")


def table_row(model: str, layout: str, senders: list[dict], engines: list[dict], key: str, bw: float) -> dict:
    """One layout's row: sums over senders for sizes, the slowest member for times."""
    nbytes = sum(r["bytes"] for r in senders)
    bound = nbytes / (bw * 1e9)
    sync_s = max(r["sync_s"] for r in senders)
    row = {"model": model, "layout": layout, "GB": nbytes / 1e9}
    row |= {name: sum(r[name] for r in senders) for name in ("tensors", "buckets")}
    row |= {name: max(r[name] for r in senders) for name in SENDER_TIMES}
    row |= {name: max(r[name] for r in engines) for name in ENGINE_TIMES}
    return row | {"bw": key, "bw_GBps": bw, "bound_s": bound, "ratio": sync_s / bound}


def check_bit_identity(senders: list[dict], engines: list[dict], model: str, layout: str) -> None:
    """Every engine of the layout received every sender's tensors with the sender's checksums
    (``senders`` in rank order, which is the order of each engine's links)."""
    spec = LAYOUTS[layout]
    if len(senders) != len(spec.trainer_gpus) or len(engines) != len(spec.engine_gpus):
        raise AssertionError(f"{model}/{layout}: {len(senders)} senders and {len(engines)} engines reported")
    for engine in engines:
        if len(engine["links"]) != len(senders):
            raise AssertionError(
                f"{model}/{layout}: engine rank {engine['rank']} has {len(engine['links'])} links"
            )
        for sender, (names, sums) in zip(senders, engine["links"]):
            if names != sender["names"] or [tuple(s) for s in sums] != [
                tuple(s) for s in sender["checksums"]
            ]:
                raise AssertionError(f"{model}/{layout}: engine rank {engine['rank']} got different tensors")


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on this host."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port("127.0.0.1")
        if port not in ports:
            ports.append(port)
    return ports


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="1.5b,7b,moe")
    parser.add_argument("--layouts", default=None, help="default: every layout that fits in --gpus")
    parser.add_argument(
        "--gpus", type=int, default=2, choices=(2, 4), help="a trainer and an engine rank per GPU"
    )
    parser.add_argument("--bucket_mb", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--watchdog_s",
        type=float,
        default=300.0,
        help="dump every process's stacks when one layout runs longer",
    )
    args = parser.parse_args()
    fits = [name for name, layout in LAYOUTS.items() if layout.gpus_needed <= args.gpus]
    args.layouts = args.layouts or ",".join(fits)
    for name in args.layouts.split(","):
        if name not in fits:
            raise SystemExit(f"--layouts: {name!r} is not a layout for {args.gpus} GPUs; choose from {fits}")
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"--models: unknown model {model!r}; choose from {list(MODELS)}")
        for name in args.layouts.split(","):
            check_split(MODELS[model], len(LAYOUTS[name].trainer_gpus))
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} CUDA GPUs, found {torch.cuda.device_count()} (or --device cpu)")
    return args


def main() -> None:
    args = parse_args()
    world_port = free_ports(1)[0]
    mp.start_processes(run_member, args=(args, world_port), nprocs=2 * args.gpus, start_method="spawn")


if __name__ == "__main__":
    main()
