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
                # queued; checksums at the end
                assert receiver.receive("link0/data", meta, verify=True) is None
            out[rank] = receiver.take_checksums("link0/data")
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
    flats = receivers[0].groups["link0/data"].buffers.flats
    assert flats[0].data_ptr() != flats[1].data_ptr()  # two buffers, taken by bucket index
    assert receivers[0].take_checksums("link0/data") == []  # forgotten once taken
    receivers[0].leave()
    assert receivers[0].take_checksums("link0/data") == []


def test_one_engine_fed_by_two_trainer_ranks_keeps_a_group_for_each():
    """A data-parallel or pipeline-parallel trainer feeds each engine from several ranks, one data
    group each. The engine joins both groups before either sends (as the pipeline's setup does) and
    receives their buckets interleaved: every bucket arrives on its own group, both ranks' tensors
    load, and each group's checksums are its own buckets'. (With one group slot, joining the
    second group dropped the first and the first rank's broadcast waited for good.)"""
    ranks = {
        "rank0/data": [
            pack_bucket([("a", torch.full((6,), 1.0))], 1, 0, False),
            pack_bucket([("b", torch.full((3,), 2.0))], 1, 1, True),
        ],
        "rank1/data": [
            pack_bucket([("c", torch.full((5,), 3.0))], 1, 0, False),
            pack_bucket([("d", torch.full((4,), 4.0))], 1, 1, True),
        ],
    }
    ports = {group: free_port() for group in ranks}
    stores = {group: open_store("127.0.0.1", ports[group], world_size=2, is_master=True) for group in ranks}
    engine = Engine()
    receiver = EngineReceiver(CPU, engine.load)
    errors: list[BaseException] = []

    def sender(group: str) -> None:
        try:
            transport = BroadcastTransport(new_group("gloo", stores[group], group, 0, 2), 0)
            for _, flat in ranks[group]:
                transport.send(flat).wait()
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    def join(group: str) -> None:
        try:
            receiver.join("127.0.0.1", ports[group], group, 1, 2, "gloo")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(group,)) for group in ranks]
    joins = [threading.Thread(target=join, args=(group,)) for group in ranks]
    for thread in threads + joins:
        thread.start()
    for thread in joins:
        thread.join(timeout=60)
    assert not errors and sorted(receiver.groups) == sorted(ranks)
    for index in range(2):  # bucket 0 of each rank, then bucket 1 of each
        for group in ranks:
            receiver.receive(group, ranks[group][index][0], verify=True)
    sums = {group: receiver.take_checksums(group) for group in ranks}
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    for group, buckets in ranks.items():
        assert sums[group] == sums_of(buckets)
    assert sorted(name for name, _ in engine.loaded) == ["a", "b", "c", "d"]
    assert_same(
        sorted(engine.loaded, key=lambda item: item[0]),
        [
            ("a", torch.full((6,), 1.0)),
            ("b", torch.full((3,), 2.0)),
            ("c", torch.full((5,), 3.0)),
            ("d", torch.full((4,), 4.0)),
        ],
    )


class BroadcastEngine:
    """A vLLM-like engine for ``BucketReceiver``: its own receiver joins the data groups and takes
    the broadcast buckets (``BroadcastBucketEngine``'s calls, as ``VLLMStrategy`` makes them)."""

    def __init__(self) -> None:
        self.engine = Engine()
        self.receiver = EngineReceiver(CPU, self.engine.load)

    def model_update_ranks(self) -> int:
        return 1

    def join_model_update_group(self, host, port, prefix, rank_offset, world_size, backend="nccl"):
        self.receiver.join(host, port, prefix, rank_offset, world_size, backend)

    def receive_bucket(self, group, meta, verify=False) -> None:
        self.receiver.receive(group, meta, verify)

    def take_checksums(self, group):
        return self.receiver.take_checksums(group)


def test_an_engine_receives_every_trainer_ranks_link_through_its_own_group():
    """The pipeline's path for a trainer whose ranks all send (pipeline stages): two senders, each
    with its own link to one engine worker that takes broadcasts in its own processes. The worker
    joins both links' data groups in order and receives both links at once (``receive_links``, as
    ``model_update_receive`` does): every tensor of both ranks loads once, with its sender's
    checksums."""
    from roll.distributed.model_update.receiver import BucketReceiver, receive_links
    from roll.distributed.model_update.sender import BucketSender
    from roll.distributed.transport.link import Link, LinkSpec

    stages = [weights(1.0), [(f"s1.{name}", t) for name, t in weights(2.0)]]
    specs = [
        LinkSpec(
            f"train->infer/{rank}", rank, "127.0.0.1", free_port(), (0,), (False,), "gloo", data_ranks=(1,)
        )
        for rank in range(2)
    ]
    sent: dict[int, object] = {}
    errors: list[BaseException] = []

    def sender(rank: int) -> None:
        try:
            link = Link.connect(specs[rank], "sender", CPU)
            sent[rank] = BucketSender(link, CPU, bucket_bytes=64).send(iter(stages[rank]), version=3)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    engine = BroadcastEngine()
    receivers = []
    for spec in specs:  # in order, as model_update_connect_receiver joins them
        join = lambda *args: engine.join_model_update_group(*args)  # noqa: E731
        receivers.append(BucketReceiver(Link.connect(spec, 0, CPU, join_data=join), CPU, engine=engine))
    results = receive_links(receivers, load=lambda named: None, version=3)
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert sorted(engine.receiver.groups) == ["train->infer/0/data", "train->infer/1/data"]
    for rank in range(2):
        assert results[rank].names == sent[rank].names and results[rank].checksums == sent[rank].checksums
        assert results[rank].buckets > 1  # several buckets per link, interleaved with the other's
    loaded = dict(engine.engine.loaded)
    assert len(loaded) == len(engine.engine.loaded) == 6
    assert_same(
        sorted(engine.engine.loaded, key=lambda item: item[0]),
        sorted(stages[0] + stages[1], key=lambda item: item[0]),
    )


def test_a_bucket_on_a_group_not_joined_is_refused_naming_it():
    meta, _ = pack_bucket(weights(1.0), 1, 0, True)
    with pytest.raises(RuntimeError, match="'link7/data', which this engine has not joined"):
        EngineReceiver(CPU, Engine().load).receive("link7/data", meta)


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
