"""SGLang's own model-update path (``model_update_transport``) on CPU, against a fake SGLang engine.

``FakeSGLang`` makes the engine calls roll's ``SGLangEngineCalls`` makes, the way SGLang 0.5.16's
schedulers run them: ``init_weights_update_group`` rendezvous at ``tcp://host:port`` as
``rank_offset`` and builds its group with torch's own group helper over the store scoped by the
group name; ``update_weights_from_distributed(load_format="flattened_bucket")`` allocates each
tensor, receives one broadcast of them back to back and views them by dtype; so a sender whose
group or wire layout differs from SGLang's fails here. Members are separate processes over gloo,
built with the production pieces (``plan_links``' specs, ``Link``, ``BucketSender``,
``BucketReceiver`` with the engine attached as the worker attaches it, ``SGLangStrategy``).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import shutil
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_model_update import mixed_tensors, same
from test_sglang_config_checks import INFER_CFG, launch, one_config_error, write_config

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs
from roll.core.worker_context import WorkerContext
from roll.distributed.model_update import group as group_module
from roll.distributed.model_update.errors import ModelUpdateError
from roll.distributed.model_update.group import ModelUpdateGroup, check_update, plan_links
from roll.distributed.model_update.probe import build_probe_batch
from roll.distributed.model_update.receiver import BucketReceiver, ReceiveResult, receive_links
from roll.distributed.model_update.sender import BucketSender, SendResult
from roll.distributed.model_update.worker_mixin import DeviceInfo, _engine_join, _engine_receives, device_info
from roll.distributed.strategy.sglang_strategy import SGLangStrategy
from roll.distributed.transport.bucket import pack_bucket, tight_bucket, tight_nbytes
from roll.distributed.transport.link import Link
from roll.distributed.transport.process_group import broadcast_options
from roll.utils.ports import free_port

torch.set_num_threads(1)
TIMEOUT = datetime.timedelta(seconds=60)


# ------------------------------------------------------------------------------ the fake engine


class FakeSGLang:
    """The weight-update calls of ``sglang.Engine`` with one TP scheduler (run in this process).
    ``fail_at``: the distributed bucket (counted from 0) whose load reports failure; ``die_at``: the
    one at which the process dies."""

    def __init__(self, fail_at: int | None = None, die_at: int | None = None) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.groups: dict[str, object] = {}
        self.calls: list[tuple] = []
        self.fail_at, self.die_at = fail_at, die_at
        self.distributed = 0

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="nccl"
    ):
        from torch.distributed.distributed_c10d import (
            Backend,
            PrefixStore,
            _new_process_group_helper,
            rendezvous,
        )

        url = f"tcp://{master_address}:{master_port}"
        store, rank, world = next(rendezvous(url, rank_offset, world_size, timeout=TIMEOUT))
        store.set_timeout(TIMEOUT)
        group, _ = _new_process_group_helper(
            world,
            rank,
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            timeout=TIMEOUT,
        )
        self.groups[group_name] = group
        self.calls.append(("init_weights_update_group", group_name, rank, world))
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name="weight_update_group", flush_cache=True, load_format=None
    ):
        index, self.distributed = self.distributed, self.distributed + 1
        self.calls.append(
            ("update_weights_from_distributed", group_name, list(names), flush_cache, load_format)
        )
        if index == self.die_at:
            os._exit(3)
        if index == self.fail_at:
            return False, "Failed to update parameter online: injected"
        assert load_format == "flattened_bucket", load_format
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes)]
        flat = torch.cat([t.flatten().view(torch.uint8) for t in tensors])
        self.groups[group_name].broadcast([flat], broadcast_options(0)).wait()
        start = 0
        for name, t in zip(names, tensors):
            end = start + t.numel() * t.element_size()
            self.weights[name] = flat[start:end].view(t.dtype).reshape(t.shape).clone()
            start = end
        return True, "Succeeded to update parameter online."

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", [n for n, _ in named_tensors], flush_cache))
        self.weights.update({name: t.detach().clone() for name, t in named_tensors})
        return True, "Success"

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        return self.weights[name].float().tolist()[:truncate_size]

    def flush_cache(self):
        self.calls.append(("flush_cache",))

    def release_memory_occupation(self, tags=None):
        return True, ""

    def resume_memory_occupation(self, tags=None):
        return True, ""


def sglang_worker(transport: str, rank: int, engine: FakeSGLang | None = None) -> SGLangStrategy:
    """An ``SGLangStrategy`` as an ``actor_infer`` worker holds it once ``initialize`` started the engine."""
    args = StrategyArgs("sglang", {"model_update_transport": transport})
    role = RoleConfig(model_args=ModelArgs(model_name_or_path="unused"), strategy_args=args)
    ctx = WorkerContext(
        role="actor_infer", rank=rank, world_size=2, local_rank=0, device=torch.device("cpu"), seed=0
    )
    strategy = SGLangStrategy(role, ctx)
    strategy.engine = strategy.engine_calls.engine = engine
    return strategy


# ------------------------------------------------------------------------------ the members


def weights_of(sender: int, version: int) -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and odd sizes (padded buckets, offsets that do not suit the next dtype), one
    tensor bigger than a bucket."""
    named = [(f"s{sender}.{name}", t) for name, t in mixed_tensors(seed=10 * sender + version)]
    return named + [(f"s{sender}.big", torch.randn(700, generator=torch.Generator().manual_seed(version)))]


def plan(receiver_devices: list[int], transport: str, senders: int) -> list:
    """``plan_links`` over CPU workers with the given global device ids (sender s on device s)."""
    infos = [DeviceInfo(s, [s], "127.0.0.1", False, 1) for s in range(senders)]
    receivers = [
        device_info(sglang_worker(transport, r), r, [d], "127.0.0.1", False)
        for r, d in enumerate(receiver_devices)
    ]
    addresses = [("127.0.0.1", free_port()) for _ in range(senders)]
    return plan_links("actor_train", "actor_infer", infos, receivers, addresses)


def run_sender(who: int, specs: list, versions: int, bucket_bytes: int) -> dict:
    link = Link.connect(specs[who], "sender", torch.device("cpu"), TIMEOUT)
    sender = BucketSender(link, torch.device("cpu"), bucket_bytes)
    results = [sender.send(iter(weights_of(who, v)), version=v) for v in range(1, versions + 1)]
    return {"results": results}


def run_receiver(who: int, specs: list, versions: int, transport: str, engine_args: dict) -> dict:
    engine = FakeSGLang(**engine_args)
    strategy = sglang_worker(transport, who, engine)
    receivers = []
    for spec in specs:
        inside = strategy if _engine_receives(strategy, spec, who) else None
        join = _engine_join(inside, spec, who) if inside is not None else None
        link = Link.connect(spec, who, torch.device("cpu"), TIMEOUT, join_data=join)
        receivers.append(BucketReceiver(link, torch.device("cpu"), engine=inside))
    out = []
    for version in range(1, versions + 1):
        results = receive_links(receivers, strategy.load_weights, version)
        strategy.finish_model_update(version)
        out.append({"results": results, "weights": dict(engine.weights)})
    return {"versions": out, "calls": engine.calls}


def _member(kind: str, who: int, args: tuple, out: str) -> None:
    torch.set_num_threads(1)
    try:
        value = (run_sender if kind == "sender" else run_receiver)(who, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test through the file
        value = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    torch.save(value, out)


def run_members(
    specs, senders: int, receivers: int, transport="auto", versions=2, bucket_bytes=2048, engine_args=None
):
    """Spawn every member; returns {("sender"|"receiver", who): its result dict, or None if it died}."""
    engine_args = engine_args or {}
    ctx = multiprocessing.get_context("spawn")
    outs, procs = {}, []
    tmp = Path(tempfile.mkdtemp(prefix="sglang_dist_"))
    members = [("sender", s, (specs, versions, bucket_bytes)) for s in range(senders)]
    members += [
        ("receiver", r, (specs, versions, transport, engine_args.get(r, {}))) for r in range(receivers)
    ]
    for kind, who, args in members:
        outs[(kind, who)] = tmp / f"{kind}{who}.pt"
        proc = ctx.Process(target=_member, args=(kind, who, args, str(outs[(kind, who)])))
        proc.start()
        procs.append(proc)
    for proc in procs:
        proc.join(150)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    got = {key: torch.load(path, weights_only=False) if path.exists() else None for key, path in outs.items()}
    shutil.rmtree(tmp, ignore_errors=True)
    return got


def ok(value: dict | None, what: str) -> dict:
    assert value is not None, f"{what} died"
    assert "error" not in value, f"{what}: {value.get('trace')}"
    return value


# ------------------------------------------------------------------------------ tests


def test_tight_bucket_is_sglangs_flattened_layout():
    named = mixed_tensors()
    meta, flat = pack_bucket(named, version=1, index=0, last=True)
    want = torch.cat([t.contiguous().flatten().view(torch.uint8) for _, t in named])
    with pytest.raises(ValueError, match="without padding"):
        tight_bucket(meta, flat)  # padded: needs a buffer
    got = tight_bucket(meta, flat, torch.empty(tight_nbytes(meta) + 7, dtype=torch.uint8))
    assert torch.equal(got, want)
    aligned = [("a", torch.randn(64)), ("b", torch.randn(4, 64).to(torch.bfloat16)), ("c", torch.randn(5))]
    meta, flat = pack_bucket(aligned, version=1, index=0, last=True)
    got = tight_bucket(meta, flat)  # only the last tensor is padded: the bucket itself, no copy
    assert got.data_ptr() == flat.data_ptr() and got.numel() == 256 + 512 + 20
    assert torch.equal(got, torch.cat([t.flatten().view(torch.uint8) for _, t in aligned]))


def test_auto_takes_cuda_ipc_on_a_shared_device_and_sglangs_group_elsewhere():
    # Sender 0 on device 0, sender 1 on device 1; receiver 0 on device 0, receiver 1 on device 2.
    specs = plan([0, 2], "auto", senders=2)
    assert [s.local for s in specs] == [(True, False), (False, False)]
    assert [s.engine_group for s in specs] == [True, True]
    worker = sglang_worker("auto", 0)
    assert not _engine_group_used(worker, specs[0], 0)  # colocated: CUDA IPC / shared memory
    assert _engine_receives(worker, specs[0], 0)  # ... into the engine (load_shared_bucket)
    assert _engine_group_used(worker, specs[1], 0) and _engine_receives(worker, specs[1], 0)
    # tensor: the worker receives remote buckets itself (the data group of roll's own links)
    specs = plan([0, 2], "tensor", senders=2)
    assert [s.engine_group for s in specs] == [False, False]
    assert not _engine_receives(sglang_worker("tensor", 1), specs[1], 1)
    # distributed: the same from other devices; from the receiver's own device it is refused
    specs = plan([0, 2], "distributed", senders=2)
    assert [s.engine_group for s in specs] == [True, True]
    with pytest.raises(
        RuntimeError, match="model_update_transport is 'distributed'.*shares this worker's device"
    ):
        _engine_receives(sglang_worker("distributed", 0), specs[0], 0)
    # TP 2: the engine adds two ranks to the group (its two schedulers)
    tp2 = sglang_worker("auto", 0)
    tp2.config.tensor_parallel_size = 2
    assert device_info(tp2, 0, [4, 5], "h", True).data_ranks == 2
    assert device_info(sglang_worker("tensor", 0), 0, [4], "h", True).data_ranks == 1


def _engine_group_used(strategy, spec, rank) -> bool:
    return spec.engine_group and not spec.is_local(rank) and _engine_receives(strategy, spec, rank)


def test_one_link_cannot_mix_sglangs_group_with_roll_s():
    infos = [DeviceInfo(0, [0], "h", False, 1)]
    receivers = [
        device_info(sglang_worker("auto", 0), 0, [1], "h", False),
        device_info(sglang_worker("tensor", 1), 1, [2], "h", False),
    ]
    with pytest.raises(ModelUpdateError, match="one link needs one kind"):
        plan_links("actor_train", "actor_infer", infos, receivers, [("h", 1)])


def test_distributed_next_to_actor_train_is_one_config_error_before_launch(tmp_path, capsys):
    write_config(tmp_path)  # actor_infer shares actor_train's two devices
    assert launch(tmp_path, f"{INFER_CFG}.model_update_transport=distributed", dry_run=True) == 2
    line = one_config_error(capsys, f"{INFER_CFG}.model_update_transport")
    assert "is 'distributed' but actor_infer shares devices" in line and "'auto'" in line
    assert launch(tmp_path, f"{INFER_CFG}.model_update_transport=auto", dry_run=True) == 0
    name = "rlvr_megatron_sglang_2gpus_disagg"
    write_config(tmp_path, name)
    assert launch(tmp_path, f"{INFER_CFG}.model_update_transport=distributed", name=name, dry_run=True) == 0
    capsys.readouterr()
    assert launch(tmp_path, f"{INFER_CFG}.model_update_transport=nccl", dry_run=True) == 2
    assert "'auto', 'tensor', 'distributed'" in one_config_error(
        capsys, f"{INFER_CFG}.model_update_transport"
    )


@pytest.mark.timeout(240)
def test_buckets_reach_sglang_by_name_dtype_and_value_over_its_own_groups():
    # Two trainer ranks (as PP=2): receiver 0 shares sender 0's device (shared memory, then
    # update_weights_from_tensor) and joins sender 1's SGLang group; receiver 1 joins both groups.
    specs = plan([0, 2], "auto", senders=2)
    got = run_members(specs, senders=2, receivers=2)
    sent = {s: ok(got[("sender", s)], f"sender {s}")["results"] for s in range(2)}
    for r in range(2):
        value = ok(got[("receiver", r)], f"receiver {r}")
        for v, per_version in enumerate(value["versions"]):
            want = dict(weights_of(0, v + 1) + weights_of(1, v + 1))
            assert sorted(per_version["weights"]) == sorted(want)
            for name, tensor in want.items():
                assert same(tensor, per_version["weights"][name]), f"receiver {r} v{v + 1}: {name}"
            results: list[ReceiveResult] = per_version["results"]
            for s, result in enumerate(results):
                assert result.names == sent[s][v].names
                local = specs[s].is_local(r)
                assert (result.checksums is None) != local, (r, s)  # SGLang's group returns none
                if local:
                    assert result.checksums == sent[s][v].checksums
        calls = value["calls"]
        groups = [c[1] for c in calls if c[0] == "init_weights_update_group"]
        assert groups == [specs[s].data_prefix for s in range(2) if not specs[s].is_local(r)]
        updates = [c for c in calls if c[0] == "update_weights_from_distributed"]
        assert all(c[3] is False and c[4] == "flattened_bucket" for c in updates)
        per_link = {g: sum(c[1] == g for c in updates) for g in groups}
        assert all(n > 2 for n in per_link.values()), per_link  # several buckets per update
        assert ("update_weights_from_tensor" in {c[0] for c in calls}) == (r == 0)
    assert all(result.buckets > 3 for results in sent.values() for result in results)


@pytest.mark.timeout(240)
def test_an_engine_that_fails_or_dies_mid_update_is_a_clear_error():
    specs = plan([1], "auto", senders=1)
    got = run_members(specs, 1, 1, versions=1, engine_args={0: {"fail_at": 2}})
    error = got[("receiver", 0)]["error"]
    assert error.startswith("RuntimeError: SGLang update_weights_from_distributed of bucket 2 on ")
    assert specs[0].data_prefix in error and "injected" in error
    specs = plan([1], "auto", senders=1)
    got = run_members(specs, 1, 1, versions=1, engine_args={0: {"die_at": 1}})
    assert got[("receiver", 0)] is None  # the engine's process died
    error = got[("sender", 0)]["error"]
    assert error.startswith(f"ModelUpdateError: link {specs[0].name}: ")
    assert "a receiver of the link died or left its group" in error


# ------------------------------------------------------------ the driver: check 1 without checksums


def sent_and_received(checksums_back: bool) -> tuple[list[SendResult], list[list[ReceiveResult]]]:
    names, sums = ["a", "b"], [(1, 2), (3, 4)]
    sent = [SendResult(names=names, checksums=sums, nbytes=512, buckets=1, version=1)]
    local = ReceiveResult(names=names, checksums=list(sums), version=1)
    engine = ReceiveResult(names=names, checksums=list(sums) if checksums_back else None, version=1)
    return sent, [[local], [engine]]


def test_check_update_takes_links_without_checksums_by_their_names():
    sent, received = sent_and_received(checksums_back=False)
    check_update(sent, received, "actor_train", "actor_infer")
    received[1][0].names = ["a"]
    with pytest.raises(ModelUpdateError, match="actor_infer rank 1: got tensors"):
        check_update(sent, received, "actor_train", "actor_infer")
    received[1][0] = ReceiveResult(names=["a", "b"], checksums=[(1, 2), (3, 5)], version=1)
    with pytest.raises(ModelUpdateError, match="tensor 'b' from actor_train rank 0 arrived different"):
        check_update(sent, received, "actor_train", "actor_infer")


class _FakeCluster:
    """``call``/``async_call`` answered at once by ``answers[method name]`` (``get_all`` is patched)."""

    def __init__(self, role: str, answers: dict):
        self.role, self.answers, self.calls = role, answers, []

    def call(self, method, *args):
        self.calls.append(method.__name__)
        return self.answers[method.__name__]

    def async_call(self, method, *args):
        return lambda: self.call(method, *args)


def test_sync_notes_links_without_checksums_once_and_still_probes(monkeypatch, caplog):
    monkeypatch.setattr(group_module, "get_all", lambda *calls: [call() for call in calls])
    sent, received = sent_and_received(checksums_back=False)
    probe = build_probe_batch(64, size=2, seed=0)
    logps = torch.zeros(probe["responses"].shape)
    train = _FakeCluster("actor_train", {"model_update_send": sent, "model_update_probe_log_probs": [logps]})
    infer = _FakeCluster(
        "actor_infer", {"model_update_receive": received, "model_update_probe_log_probs": [logps, logps]}
    )
    config = SimpleNamespace(model_update_buffer_size_mb=1, model_update_probe_tolerance=None)
    config.actor_train = config.actor_infer = SimpleNamespace(model_args=SimpleNamespace(dtype="bf16"))
    group = ModelUpdateGroup(train, infer, config, probe_batch=probe)
    group.specs = []  # set up
    with caplog.at_level(logging.INFO, logger="roll"):
        metrics = [group.sync(version) for version in (1, 2)]
    notes = [r.getMessage() for r in caplog.records if "return no checksums" in r.getMessage()]
    assert notes == [
        "model update actor_train->actor_infer: actor_infer ranks [1] receive in the engine's own "
        "processes and return no checksums; the probe checks their weights"
    ]
    assert [m["model_update/links_without_checksums"] for m in metrics] == [1.0, 1.0]
    assert all(m["model_update/probe_logprob_diff"] == 0.0 for m in metrics)
    assert infer.calls.count("model_update_probe_log_probs") == 2  # the probe ran on every sync
    # Where the probe asks for a tensor-by-tensor comparison, the message says what was not checksummed.
    infer.answers["model_update_can_verify"] = [True, False]
    assert (
        "ranks [1] received into the engine's own parameters without checksums" in group.locate_mismatch(2)[1]
    )
