"""Model update on CPU: bucket format, gloo broadcast links, shared-memory links, and (with Ray) the
whole trainer -> engine path with a tiny model.

The transport tests spawn real processes and build the links exactly like the workers do
(``Link.connect`` on a ``TCPStore`` hosted by the sender, separate from any default group).
"""

from __future__ import annotations

import socket
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from roll.distributed.model_update.bucket import (
    ALIGN,
    BucketMeta,
    iter_buckets,
    iter_buckets_with_last,
    pack_bucket,
    unpack_bucket,
)
from roll.distributed.model_update.checksum import bucket_checksums, first_mismatch, tensor_checksum
from roll.distributed.model_update.errors import ModelUpdateError
from roll.distributed.model_update.link import Link, LinkSpec
from roll.distributed.model_update.receiver import BucketReceiver, receive_links
from roll.distributed.model_update.sender import BucketSender

torch.set_num_threads(1)
# Forked members start in a fraction of a second (a spawned one re-imports torch: seconds each on a
# small machine); nothing in the parent has started threads or CUDA at that point.
START_METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def mixed_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(37, 16, generator=g)),
        ("norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("steps", torch.randint(-(2**40), 2**40, (3,), generator=g)),
        ("mask", torch.rand(5, generator=g) > 0.5),
        ("scale", torch.tensor(1.5, dtype=torch.float16)),
        ("empty", torch.zeros(0, 4)),
        ("transposed", torch.randn(6, 9, generator=g).t()),
        ("ids", torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g)),
    ]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: dtype, shape and every byte."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


# ---------------------------------------------------------------------------------------- (a) buckets


def test_pack_unpack_roundtrip_alignment_and_views():
    named = mixed_tensors()
    meta, flat = pack_bucket(named, version=7, index=2, last=True)
    assert isinstance(meta, BucketMeta) and (meta.version, meta.index, meta.last) == (7, 2, True)
    assert flat.dtype == torch.uint8 and flat.numel() == meta.nbytes and meta.nbytes % ALIGN == 0
    assert all(t.offset % ALIGN == 0 for t in meta.tensors)
    out = unpack_bucket(meta, flat)
    assert [n for n, _ in out] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, out):
        assert same(want, got)
        if got.numel():
            assert got.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view


def test_pack_reuses_out_buffer_and_zeroes_padding():
    named = mixed_tensors()
    out = torch.full((1 << 14,), 0xAB, dtype=torch.uint8)
    meta, flat = pack_bucket(named, 1, 0, False, out=out)
    assert flat.data_ptr() == out.data_ptr() and flat.numel() == meta.nbytes
    for t in meta.tensors:  # padding after each tensor is zero, so equal buckets are equal bytes
        end = t.offset + t.nbytes
        assert int(flat[end : t.offset + (t.nbytes + ALIGN - 1) // ALIGN * ALIGN].sum()) == 0
    small = torch.empty(8, dtype=torch.uint8)
    meta2, flat2 = pack_bucket(named, 1, 0, False, out=small)
    assert flat2.data_ptr() != small.data_ptr() and torch.equal(flat2, flat)
    with pytest.raises(ValueError, match="out must be a 1-D uint8"):
        pack_bucket(named, 1, 0, False, out=torch.empty(4, 4))


def test_iter_buckets_limits_and_oversized_tensor():
    named = [
        ("a", torch.zeros(64)),
        ("big", torch.zeros(4096)),
        ("b", torch.zeros(10)),
        ("c", torch.zeros(10)),
    ]
    buckets = [[n for n, _ in b] for b in iter_buckets(named, 1024)]
    assert buckets == [["a"], ["big"], ["b", "c"]]
    flagged = [last for _, last in iter_buckets_with_last(named, 1024)]
    assert flagged == [False, False, True]
    assert list(iter_buckets_with_last([], 1024)) == [([], True)]
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets(named, 0))


def test_unpack_rejects_short_buffer():
    meta, flat = pack_bucket(mixed_tensors(), 1, 0, True)
    with pytest.raises(ValueError, match="needs"):
        unpack_bucket(meta, flat[: meta.nbytes - ALIGN])


def test_checksums_match_per_tensor_and_catch_changes():
    named = mixed_tensors()
    meta, flat = pack_bucket(named, 1, 0, True)
    sums = bucket_checksums(meta, flat).tolist()
    assert [tuple(s) for s in sums] == [tensor_checksum(t) for _, t in named]
    base = tensor_checksum(named[0][1])
    one_bit = named[0][1].clone()
    one_bit.view(torch.int32)[5, 3] ^= 1
    assert tensor_checksum(one_bit) != base
    swapped = named[0][1].clone()
    swapped[[0, 36]] = swapped[[36, 0]]
    assert tensor_checksum(swapped) != base
    halves = torch.cat([named[0][1][20:], named[0][1][:20]])  # TP shards in the wrong order
    assert tensor_checksum(halves)[1] != base[1]
    expected = [(n, tensor_checksum(t)) for n, t in named]
    actual = dict(expected) | {"steps": (0, 0)}
    assert first_mismatch(expected, actual) == "steps"
    assert first_mismatch(expected, dict(expected)) is None


# ------------------------------------------------------------------------------ (b), (c) transports


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sender_weights(sender: int, version: int) -> list[tuple[str, torch.Tensor]]:
    """Distinct tensors per sender and version; sender 1 sends an oversized tensor; sender 2 nothing."""
    if sender == 2:
        return []
    named = [(f"s{sender}.{name}", t) for name, t in mixed_tensors(seed=10 * sender + version)]
    if sender == 1:
        named.append(("s1.big", torch.randn(3000, generator=torch.Generator().manual_seed(version))))
    return named


def _transport_member(index: int, members: list[tuple], out_dir: str) -> None:
    torch.set_num_threads(1)
    kind, who, specs = members[index]
    device = torch.device("cpu")
    if kind == "sender":
        link = Link.connect(specs[0], "sender", device)
        sender = BucketSender(link, device, bucket_bytes=2048)
        results = [sender.send(iter(sender_weights(who, v)), version=v) for v in (1, 2)]
        torch.save([(r.names, r.checksums, r.nbytes) for r in results], f"{out_dir}/sender{who}.pt")
        return
    links = [Link.connect(spec, who, device) for spec in specs]
    receivers = [BucketReceiver(link, device) for link in links]
    got_by_version = []
    for version in (1, 2):
        got: dict[str, torch.Tensor] = {}

        def load(named, got=got):
            for name, tensor in named:
                assert name not in got, f"{name} loaded twice"
                got[name] = tensor.clone()

        results = receive_links(receivers, load, version)
        got_by_version.append((got, [(r.names, r.checksums) for r in results]))
    torch.save(got_by_version, f"{out_dir}/receiver{who}.pt")


def run_transport(num_senders: int, num_receivers: int, local: dict[int, set[int]]) -> None:
    """Spawn the members; ``local[s]`` lists the receivers that share sender ``s``'s device."""
    specs = [
        LinkSpec(
            name=f"test/{s}",
            sender=s,
            host="127.0.0.1",
            port=_free_port(),
            receivers=tuple(range(num_receivers)),
            local=tuple(r in local.get(s, set()) for r in range(num_receivers)),
            backend="gloo",
        )
        for s in range(num_senders)
    ]
    members = [("sender", s, [specs[s]]) for s in range(num_senders)]
    members += [("receiver", r, specs) for r in range(num_receivers)]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _transport_member, args=(members, out_dir), nprocs=len(members), start_method=START_METHOD
        )
        sent = {s: torch.load(f"{out_dir}/sender{s}.pt") for s in range(num_senders)}
        for r in range(num_receivers):
            per_version = torch.load(f"{out_dir}/receiver{r}.pt")
            for v_index, (got, link_results) in enumerate(per_version):
                version = v_index + 1
                want = dict(t for s in range(num_senders) for t in sender_weights(s, version))
                assert sorted(got) == sorted(want), f"receiver {r} v{version}"
                for name, tensor in want.items():
                    assert same(tensor, got[name]), f"receiver {r} v{version}: {name} differs"
                for s, (names, sums) in enumerate(link_results):
                    sent_names, sent_sums, _ = sent[s][v_index]
                    assert names == sent_names and sums == sent_sums


@pytest.mark.timeout(120)
def test_gloo_broadcast_two_senders_three_receivers_bit_identical():
    run_transport(num_senders=2, num_receivers=3, local={})


@pytest.mark.timeout(120)
def test_shared_memory_colocated_and_partial_overlap_bit_identical():
    # Receiver 0 shares sender 0's device (shared memory), receiver 1 shares sender 1's; every other
    # pair is remote; sender 2 holds no distinct shard and sends an empty update.
    run_transport(num_senders=3, num_receivers=2, local={0: {0}, 1: {1}})


class _FakeControl:
    def __init__(self, messages):
        self.messages = list(messages)

    def recv(self):
        return self.messages.pop(0)


class _FakeLink:
    is_sender = False
    is_local = False

    def __init__(self, messages):
        self.spec = LinkSpec("fake", 0, "127.0.0.1", 0, (0,), (False,), "gloo")
        self.control = _FakeControl(messages)
        self.data = None


def test_receiver_rejects_a_bucket_of_another_version():
    meta, _ = pack_bucket(mixed_tensors(), version=5, index=0, last=True)
    receiver = BucketReceiver(_FakeLink([(meta, None)]), torch.device("cpu"))
    with pytest.raises(ModelUpdateError, match="version 5"):
        receiver.receive(lambda named: None, version=4)
