"""Model update on CPU: bucket format, gloo broadcast links, shared-memory links, and (with Ray) the
whole trainer -> engine path with a tiny model.

The transport tests spawn real processes and build the links exactly like the workers do
(``Link.connect`` on a ``TCPStore`` hosted by the sender, separate from any default group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile

import pytest
import torch
from gloo_ranks import process_group, start_processes
from tiny_models import VOCAB_SIZE, build_tiny_model_dir

from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
from roll.distributed.executor.dispatch import Dispatch, register
from roll.distributed.model_update.errors import ModelUpdateError
from roll.distributed.model_update.group import ModelUpdateGroup
from roll.distributed.model_update.probe import build_probe_batch
from roll.distributed.model_update.receiver import BucketReceiver, receive_links
from roll.distributed.model_update.sender import BucketSender
from roll.distributed.scheduler.placement import PlacementPlan, plan_role
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.distributed.transport.bucket import (
    ALIGN,
    BucketMeta,
    iter_buckets,
    iter_buckets_with_last,
    pack_bucket,
    unpack_bucket,
)
from roll.distributed.transport.checksum import bucket_checksums, first_mismatch, tensor_checksum
from roll.distributed.transport.link import Link, LinkSpec
from roll.pipeline.workers.model_worker import ModelCluster, ModelWorker
from roll.utils.ports import free_port

torch.set_num_threads(1)
# Ray workers cannot import this test module by name; ship its classes and functions by value.
ray_cloudpickle = pytest.importorskip("ray.cloudpickle")
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


def sender_weights(sender: int, version: int) -> list[tuple[str, torch.Tensor]]:
    """Distinct tensors per sender and version; sender 1 sends an oversized tensor; sender 2 nothing."""
    if sender == 2:
        return []
    named = [(f"s{sender}.{name}", t) for name, t in mixed_tensors(seed=10 * sender + version)]
    if sender == 1:
        named.append(("s1.big", torch.randn(3000, generator=torch.Generator().manual_seed(version))))
    return named


def member_device(gpu: int, backend: str) -> torch.device:
    """CPU under gloo, else ``cuda:gpu``."""
    if backend == "gloo":
        return torch.device("cpu")
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def _transport_member(
    index: int, members: list[tuple], out_dir: str, backend: str, bucket_bytes: int
) -> None:
    torch.set_num_threads(1)
    kind, who, specs, gpu = members[index]
    device = member_device(gpu, backend)
    if kind == "sender":
        link = Link.connect(specs[0], "sender", device)
        sender = BucketSender(link, device, bucket_bytes=bucket_bytes)
        results = [
            sender.send(((n, t.to(device)) for n, t in sender_weights(who, v)), version=v) for v in (1, 2)
        ]
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
                assert tensor.device == device, f"{name} arrived on {tensor.device}, not {device}"
                got[name] = tensor.cpu().clone()

        results = receive_links(receivers, load, version)
        got_by_version.append((got, [(r.names, r.checksums) for r in results]))
    torch.save(got_by_version, f"{out_dir}/receiver{who}.pt")


def run_transport(
    num_senders: int,
    num_receivers: int,
    local: dict[int, set[int]],
    backend: str = "gloo",
    bucket_bytes: int = 2048,
    receiver_gpus: list[int] | None = None,
) -> None:
    """Spawn the members; ``local[s]`` lists the receivers that share sender ``s``'s device.
    Under NCCL sender s runs on GPU s and receiver r on ``receiver_gpus[r]`` (default: GPU r)."""
    receiver_gpus = receiver_gpus or list(range(num_receivers))
    specs = [
        LinkSpec(
            name=f"test/{s}",
            sender=s,
            host="127.0.0.1",
            port=free_port(),
            receivers=tuple(range(num_receivers)),
            local=tuple(r in local.get(s, set()) for r in range(num_receivers)),
            backend=backend,
        )
        for s in range(num_senders)
    ]
    members = [("sender", s, [specs[s]], s) for s in range(num_senders)]
    members += [("receiver", r, specs, receiver_gpus[r]) for r in range(num_receivers)]
    with tempfile.TemporaryDirectory() as out_dir:
        start_processes(_transport_member, len(members), members, out_dir, backend, bucket_bytes)
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


# ------------------------------------------------- Megatron TP / PP / EP trainer -> two receivers

MEGATRON_CASES = {
    "TP2": ("qwen2", {"tensor_model_parallel_size": 2}),
    "PP2": ("qwen2", {"pipeline_model_parallel_size": 2}),
    "EP2": ("qwen3_moe", {"expert_model_parallel_size": 2}),
}


def megatron_checkpoints(root) -> dict[str, str]:
    """A tied tiny Qwen2 and a tiny Qwen3-MoE (fp32 safetensors)."""
    import transformers

    qwen2 = build_tiny_model_dir(root / "qwen2")
    config = transformers.Qwen3MoeConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        vocab_size=130,
        head_dim=16,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(root / "qwen3_moe")
    return {"qwen2": str(qwen2), "qwen3_moe": str(root / "qwen3_moe")}


def _megatron_sender(rank: int, port: int, cases: list[str], specs: dict, ckpts: dict, backend: str) -> None:
    """Trainer rank ``rank`` of a 2-rank Megatron world: for each case, build and load the model,
    then stream ``export_hf_weights`` (the strategies' ``iter_hf_weights``) into its link."""
    import transformers
    from megatron.core import parallel_state as ps

    from roll.configs.strategy_configs import MegatronConfig
    from roll.models.megatron.hf_io import export_hf_weights, load_hf_weights
    from roll.models.megatron.model_builder import build_model_chunks, local_layer_spec

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "megatron"))
    import compat  # tests/megatron/compat.py: megatron-core on CPU

    device = member_device(rank, backend)
    with process_group(rank, 2, port, backend=backend):  # the two trainer ranks; receivers stay out
        compat.apply()
        for case in cases:
            family, layout = MEGATRON_CASES[case]
            ps.initialize_model_parallel(**layout)
            compat.seed(1234)
            hf_config = transformers.AutoConfig.from_pretrained(ckpts[family])
            chunks = build_model_chunks(hf_config, MegatronConfig(**layout), torch.float32, local_layer_spec)
            load_hf_weights(chunks, ckpts[family])
            link = Link.connect(specs[case][rank], "sender", device)
            BucketSender(link, device, bucket_bytes=16 << 10).send(export_hf_weights(chunks), version=1)
            ps.destroy_model_parallel()


def _megatron_member(
    index: int, port: int, cases: list[str], specs: dict, ckpts: dict, out_dir: str, backend: str
):
    torch.set_num_threads(1)
    if index < 2:
        _megatron_sender(index, port, cases, specs, ckpts, backend)
        return
    who = index - 2
    device = member_device(who, backend)
    for case in cases:
        receivers = [BucketReceiver(Link.connect(spec, who, device), device) for spec in specs[case]]
        got: dict[str, torch.Tensor] = {}

        def load(named, got=got):
            for name, tensor in named:
                assert name not in got, f"{name} arrived twice"
                got[name] = tensor.cpu().clone()

        results = receive_links(receivers, load, version=1)
        senders = [sum(1 for _ in r.names) for r in results]
        torch.save((got, senders), f"{out_dir}/{case}_receiver{who}.pt")


def run_megatron_to_receivers(tmp_path, backend: str) -> dict[str, list[int]]:
    """Every case's received tensors equal the checkpoint bit for bit on both receivers; returns
    how many tensors each trainer rank sent per case."""
    from safetensors.torch import load_file

    ckpts = megatron_checkpoints(tmp_path)
    cases = list(MEGATRON_CASES)
    specs = {
        case: [
            LinkSpec(f"megatron/{case}/{s}", s, "127.0.0.1", free_port(), (0, 1), (s == 0, s == 1), backend)
            for s in range(2)
        ]
        for case in cases
    }
    out_dir = str(tmp_path)
    start_processes(_megatron_member, 4, free_port(), cases, specs, ckpts, out_dir, backend)
    per_sender = {}
    for case in cases:
        want = load_file(f"{ckpts[MEGATRON_CASES[case][0]]}/model.safetensors")
        for who in range(2):
            got, senders = torch.load(f"{out_dir}/{case}_receiver{who}.pt")
            assert sorted(got) == sorted(want), f"{case} receiver {who}: {sorted(set(want) ^ set(got))[:5]}"
            for name, tensor in want.items():
                assert same(tensor, got[name]), f"{case} receiver {who}: {name} differs"
            per_sender[case] = senders
    return per_sender


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_megatron_tp_pp_ep_trainer_to_two_receivers_bit_identical(tmp_path):
    pytest.importorskip("megatron.core")
    per_sender = run_megatron_to_receivers(tmp_path, "gloo")
    assert per_sender["TP2"][1] == 0 and per_sender["TP2"][0] > 0  # TP peers gather, one sends
    assert min(per_sender["PP2"]) > 0 and min(per_sender["EP2"]) > 0  # each stage / expert shard sends


# ------------------------------------------------------------------- (d) end to end through Ray

E2E_LAYOUTS = {
    # inference role -> device slots (the trainer holds slots 0 and 1; its rank 0 is the one sender)
    "infer_colocated": [0, 1],  # rank 0 maps the sender's buffers, rank 1 gets a broadcast
    "infer_disaggregated": [2, 3],  # both get a broadcast
    "infer_partial": [0, 3],  # one shared slot, one of its own
}
CORRUPTED = "model.layers.1.mlp.up_proj.weight"


class _InspectableModelWorker(ModelWorker):
    """ModelWorker plus read-outs of the weights for the bit-identity checks, and corruption of the
    next update for the checks that must catch it."""

    @register(Dispatch.ONE_TO_ALL)
    def trainer_weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().cpu().clone() for name, t in self.strategy.iter_hf_weights()}

    @register(Dispatch.ONE_TO_ALL)
    def engine_weights(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().cpu().clone() for name, t in self.strategy.model.state_dict().items()}

    @register(Dispatch.ONE_TO_ALL)
    def corrupt_next_update(self, name: str, where: str) -> None:
        """Corrupt tensor ``name`` in the next update: on arrival, before its checksum (``"wire"``:
        the checksums catch it), or in the engine after loading (``"engine"``: the probe catches it)."""
        self.corruption = (name, where)

    @register(Dispatch.ONE_TO_ALL)
    def model_update_receive(self, group: str, version: int):
        name, where = self.__dict__.pop("corruption", (None, None))
        with _corrupt_on_arrival(name) if where == "wire" else contextlib.nullcontext():
            results = super().model_update_receive(group, version)
        if where == "engine":
            weights = dict(self.strategy.iter_hf_weights())
            self.strategy.load_weights(iter([(name, weights[name] + 1.0)]))
        return results


@contextlib.contextmanager
def _corrupt_on_arrival(name: str):
    """Flip a bit of tensor ``name`` in every bucket that arrives, before the receiver's checksums."""
    from roll.distributed.model_update import receiver

    checksums = receiver.bucket_checksums

    def corrupt_then_sum(meta, flat):
        for tensor in meta.tensors:
            if tensor.name == name and tensor.nbytes:
                flat[tensor.offset : tensor.offset + 1].bitwise_xor_(1)
        return checksums(meta, flat)

    receiver.bucket_checksums = corrupt_then_sum
    try:
        yield
    finally:
        receiver.bucket_checksums = checksums


def _policy_loss(outputs, micro):
    mask = micro["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}


def _e2e_config(model_dir) -> RLVRConfig:
    def role(strategy: str, devices: list[int], **strategy_config) -> RoleConfig:
        args = StrategyArgs(strategy, strategy_config=strategy_config)
        return RoleConfig(
            model_args=ModelArgs(model_name_or_path=str(model_dir), dtype="fp32"),
            training_args=TrainingArgs(learning_rate=0.05),
            strategy_args=args,
            device_mapping=devices,
            infer_batch_size=4,
        )

    return RLVRConfig(
        actor_train=role("fsdp2_train", [0, 1], mixed_precision=False),
        actor_infer=role("hf_infer", E2E_LAYOUTS["infer_colocated"]),
        num_gpus_per_node=4,
        device="cpu",
        model_update_buffer_size_mb=1,
        model_update_probe_tolerance=1e-3,
        model_update_probe_size=2,
    )


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    import ray

    os.environ["OMP_NUM_THREADS"] = "1"
    if ray.is_initialized():
        ray.shutdown()
    model_dir = build_tiny_model_dir(tmp_path_factory.mktemp("model") / "tiny")
    config = _e2e_config(model_dir)
    roles = {"actor_train": config.actor_train}
    for name, devices in E2E_LAYOUTS.items():
        roles[name] = dataclasses.replace(config.actor_infer, device_mapping=devices)
    role_plans = {name: plan_role(name, role, config.num_gpus_per_node) for name, role in roles.items()}
    plan = PlacementPlan(1, config.num_gpus_per_node, role_plans, ())
    rm = ResourceManager(plan, "cpu", log_to_driver=False)
    clusters = {}
    try:
        for name, role in roles.items():
            clusters[name] = ModelCluster(name, _InspectableModelWorker, rm, plan.roles[name], role, config)
        for name, cluster in clusters.items():
            cluster.initialize(10) if name == "actor_train" else cluster.initialize()
        groups = {
            name: ModelUpdateGroup(clusters["actor_train"], clusters[name], config) for name in E2E_LAYOUTS
        }
        for group in groups.values():
            group.setup()
        yield clusters, groups, config
    finally:
        # Ray's shutdown ends every worker, also one still blocked in a link after a failed test
        # (Cluster.shutdown would queue behind it).
        rm.destroy()
        ray.shutdown()


def _train_one_step(clusters, seed: int) -> None:
    batch = build_probe_batch(VOCAB_SIZE, size=4, seed=seed)
    clusters["actor_train"].train_step(batch, _policy_loss, seed)


def _assert_engines_hold_trainer_weights(clusters, names) -> dict[str, torch.Tensor]:
    want = clusters["actor_train"].call(_InspectableModelWorker.trainer_weights)[0]
    for name in names:
        for rank, got in enumerate(clusters[name].call(_InspectableModelWorker.engine_weights)):
            assert sorted(got) == sorted(want), f"{name} rank {rank}"
            for key, tensor in want.items():
                assert same(tensor, got[key]), f"{name} rank {rank}: {key} differs"
    return want


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_e2e_fsdp2_to_hf_infer_every_layout_bit_identical_and_versioned(e2e):
    clusters, groups, _ = e2e
    links = {name: [(s.local_receivers, s.remote_receivers) for s in g.specs] for name, g in groups.items()}
    assert links["infer_colocated"][0] == ((0,), (1,)) and links["infer_colocated"][1] == ((1,), (0,))
    assert links["infer_disaggregated"][0] == ((), (0, 1))
    assert links["infer_partial"][0] == ((0,), (1,))
    before = clusters["actor_train"].call(_InspectableModelWorker.trainer_weights)[0]
    _train_one_step(clusters, seed=1)
    for name, group in groups.items():
        metrics = group.sync(version=1)
        assert metrics["model_update/version_train"] == metrics["model_update/version_infer"] == 1
        assert metrics["model_update/probe_logprob_diff"] < 1e-5, name
        assert metrics["model_update/bytes"] > 0 and metrics["model_update/time_s"] > 0
        assert clusters[name].model_update_version() == [1, 1]
    after = _assert_engines_hold_trainer_weights(clusters, E2E_LAYOUTS)
    assert any(not torch.equal(before[k], after[k]) for k in after), "the training step changed nothing"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_e2e_corruption_is_caught_and_named(e2e):
    import ray

    clusters, groups, _ = e2e
    group, infer = groups["infer_partial"], clusters["infer_partial"]
    # On the wire: the checksums catch it and name the tensor and the receiving rank.
    ray.get(infer.workers[1].corrupt_next_update.remote(CORRUPTED, "wire"))
    with pytest.raises(ModelUpdateError, match=rf"infer_partial rank 1: tensor '{CORRUPTED}'"):
        group.sync(version=2)
    # In the engine after loading (a bad load): the probe catches it, the verify pass names it.
    ray.get(infer.workers[0].corrupt_next_update.remote(CORRUPTED, "engine"))
    with pytest.raises(
        ModelUpdateError,
        match=rf"tolerance.*first mismatching tensor: '{CORRUPTED}' on infer_partial rank 0 "
        r"\((\d+) of \1 elements differ, the first at flat index 0, largest \|difference\| 1; "
        r"the engine's copy holds 0 non-finite",
    ):
        group.sync(version=3)
    # The next clean update repairs it.
    metrics = group.sync(version=4)
    assert metrics["model_update/probe_logprob_diff"] < 1e-5
    _assert_engines_hold_trainer_weights(clusters, ["infer_partial"])


def test_non_finite_probe_names_the_broken_side():
    from roll.distributed.model_update.group import non_finite_sides

    good, bad = torch.zeros(2, 3), torch.tensor([[0.0, float("-inf"), 0.0], [0.0, 0.0, 0.0]])
    assert non_finite_sides("actor_train", good, "actor_infer", [good, bad, None]) == "actor_infer ranks [1]"
    assert non_finite_sides("actor_train", bad, "actor_infer", [good]) == "actor_train"
    assert non_finite_sides("t", good, "e", [good]).startswith("neither")


def test_describe_difference_says_how_much_and_where():
    from roll.distributed.model_update.worker_mixin import describe_difference

    want = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    have = want.clone()
    have[1, 2], have[2, 0] = 100.0, float("nan")
    text = describe_difference(want, have)
    assert text == (
        "2 of 12 elements differ, the first at flat index 6, largest |difference| 94; "
        "the engine's copy holds 1 non-finite value(s)"
    )
    assert describe_difference(want, have[:2]) == "shape (2, 4) instead of (3, 4)"
