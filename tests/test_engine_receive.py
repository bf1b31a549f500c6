"""The engine side of a model update (``roll.distributed.transport.engine_receive``), on CPU.

``EngineReceiver`` is what vLLM's TP workers and SGLang's worker receive with; here its "engine"
is a function that records what it was handed, its broadcast group is gloo between threads, and a
colocated bucket is a ``/dev/shm`` buffer, so the same code runs as on the GPUs.
"""

from __future__ import annotations

import threading

import pytest
import torch

from roll.distributed.transport.broadcast import BroadcastTransport
from roll.distributed.transport.bucket import pack_bucket, unpack_bucket
from roll.distributed.transport.checksum import bucket_checksums
from roll.distributed.transport.engine_receive import EngineReceiver, ReceiveBuffers, bucket_over_storage
from roll.distributed.transport.ipc import allocate_shared
from roll.distributed.transport.process_group import new_group, open_store
from roll.utils.ports import free_port

torch.set_num_threads(1)
CPU = torch.device("cpu")


def weights(fill: float) -> list[tuple[str, torch.Tensor]]:
    return [
        ("a", torch.full((2, 3), fill)),
        ("b", torch.arange(5, dtype=torch.int64) + int(fill)),
        ("c", torch.full((7,), -fill, dtype=torch.bfloat16)),
    ]


class Engine:
    """Records every list of tensors ``load`` is handed (copies, as a real engine's weights are)."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.storages: list[int] = []

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        assert isinstance(named, list)
        self.storages.extend(t.untyped_storage().data_ptr() for _, t in named)
        self.loaded.extend((name, t.clone()) for name, t in named)


def assert_same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def sums_of(buckets) -> list[tuple[int, int]]:
    return [tuple(s) for meta, flat in buckets for s in bucket_checksums(meta, flat).tolist()]


def test_broadcast_buckets_reach_every_engine_process_through_the_double_buffer():
    """Three buckets (the third larger, so a buffer grows) from a gloo sender to two engine
    processes (vLLM's TP workers): each loads every tensor, and the checksums come at the end."""
    named = weights(3.0) + [("d", torch.ones(40))]
    buckets = [
        pack_bucket(named[:1], 1, 0, False),
        pack_bucket(named[1:3], 1, 1, False),
        pack_bucket(named[3:], 1, 2, True),
    ]
    port = free_port()
    store = open_store("127.0.0.1", port, world_size=3, is_master=True)
    engines = [Engine(), Engine()]
    receivers = [EngineReceiver(CPU, engine.load) for engine in engines]
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            transport = BroadcastTransport(new_group("gloo", store, "link0/data", 0, 3), 0)
            for _, flat in buckets:
                transport.send(flat).wait()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    def engine_process(rank: int, out: dict) -> None:
        try:
            receiver = receivers[rank - 1]
            receiver.join("127.0.0.1", port, "link0/data", rank, 3, "gloo")
            for meta, _ in buckets:
                assert receiver.receive(meta, verify=True) is None  # queued; checksums at the end
            out[rank] = receiver.take_checksums()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    sums: dict[int, list] = {}
    threads = [threading.Thread(target=sender)] + [
        threading.Thread(target=engine_process, args=(rank, sums)) for rank in (1, 2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    for rank, engine in zip((1, 2), engines):
        assert_same(engine.loaded, named)
        assert sums[rank] == sums_of(buckets)
    flats = receivers[0].buffers.flats
    assert flats[0].data_ptr() != flats[1].data_ptr()  # two buffers, taken by bucket index
    assert receivers[0].take_checksums() == []  # forgotten once taken
    receivers[0].leave()
    assert receivers[0].take_checksums() == []


def test_a_bucket_before_the_group_is_refused():
    meta, _ = pack_bucket(weights(1.0), 1, 0, True)
    with pytest.raises(RuntimeError, match="before this engine joined"):
        EngineReceiver(CPU, Engine().load).receive(meta)


@pytest.mark.parametrize("reshare", [False, True])
def test_a_colocated_bucket_loads_from_the_senders_buffer(reshare):
    """The engine gets views into the mapped buffer itself (one unpack, no copy on CPU, where
    ``reshare`` has nothing to do), with the sender's checksums."""
    named = weights(5.0)
    total = pack_bucket(named, 4, 0, True)[0].nbytes
    flat, handle = allocate_shared(total, CPU, key=("test-engine-receive", reshare))
    meta, _ = pack_bucket(named, 4, 0, True, out=flat)
    engine = Engine()
    receiver = EngineReceiver(CPU, engine.load, reshare=reshare)
    sums = receiver.load_shared(meta, handle, verify=True)
    assert_same(engine.loaded, named)
    assert sums == sums_of([(meta, flat)])
    mapped = receiver.ipc.open(handle, CPU)
    assert set(engine.storages) == {mapped.untyped_storage().data_ptr()}
    assert receiver.load_shared(meta, handle) is None  # no checksums unless asked


def test_receive_buffers_alternate_and_grow():
    class Transport:
        def __init__(self) -> None:
            self.into: list[torch.Tensor] = []

        def recv(self, flat: torch.Tensor):
            self.into.append(flat)
            flat.fill_(len(self.into))
            return None

    buffers, transport = ReceiveBuffers(CPU), Transport()
    first, work = buffers.post_recv(0, 8, transport)
    with buffers.reading(0, work):
        assert first.tolist() == [1] * 8
    second, _ = buffers.post_recv(1, 8, transport)
    third, _ = buffers.post_recv(2, 4, transport)
    assert second.data_ptr() != first.data_ptr() and third.data_ptr() == first.data_ptr()
    grown, _ = buffers.post_recv(3, 16, transport)
    assert grown.numel() == 16 and buffers.flats[1].numel() == 16


def test_bucket_over_storage_describes_views_without_copying():
    named = [
        ("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
        ("b", torch.tensor([7, 8], dtype=torch.int64)),
    ]
    meta, flat = pack_bucket(named, version=1, index=0, last=True)
    views = unpack_bucket(meta, flat)
    view_meta, view_flat = bucket_over_storage(views)
    assert view_flat.data_ptr() == flat.data_ptr() and view_flat.numel() == flat.untyped_storage().nbytes()
    assert [(t.name, t.offset, t.nbytes, t.shape) for t in view_meta.tensors] == [
        (t.name, t.offset, t.nbytes, t.shape) for t in meta.tensors
    ]
    for (_, got), (_, want) in zip(unpack_bucket(view_meta, view_flat), named):
        assert torch.equal(got, want)
    assert bucket_over_storage(named) is None  # two separate storages
    assert bucket_over_storage([("t", torch.zeros(3, 4).t())]) is None  # not contiguous
    assert bucket_over_storage([]) is None


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_shareable_bucket_shares_own_buffer_and_packs_scattered_tensors():
    from roll.distributed.transport.engine_receive import shareable_bucket

    named = [("a", torch.randn(5, 3, device="cuda")), ("b", torch.randn(7, device="cuda"))]
    meta, flat = pack_bucket(named, version=1, index=0, last=True)
    _, shared, handle = shareable_bucket(unpack_bucket(meta, flat))
    assert shared.data_ptr() == flat.data_ptr() and handle.kind == "cuda"  # no copy
    packed_meta, packed, _ = shareable_bucket(named)
    assert packed.data_ptr() != named[0][1].data_ptr()
    for (_, got), (_, want) in zip(unpack_bucket(packed_meta, packed), named):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_shareable_tensors_hands_views_of_our_buffer_over_as_they_are():
    from roll.distributed.transport.engine_receive import shareable_tensors

    named = [("a", torch.randn(5, 3, device="cuda")), ("b", torch.randn(7, device="cuda"))]
    views = unpack_bucket(*pack_bucket(named, version=1, index=0, last=True))
    same = shareable_tensors(views)
    assert [t.data_ptr() for _, t in same] == [t.data_ptr() for _, t in views]  # no copy
    packed = shareable_tensors(named)
    assert packed[0][1].untyped_storage().data_ptr() == packed[1][1].untyped_storage().data_ptr()
    assert_same(packed, named)
