"""Pure placement planning: device mappings -> nodes, workers, local slots and shared devices."""

from __future__ import annotations

import pytest

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.errors import ConfigError
from roll.configs.pipeline_config import RLVRConfig
from roll.configs.role import RewardConfig, RoleConfig, StrategyArgs
from roll.configs.strategy_configs import HFInferConfig, MegatronConfig, SGLangConfig, VLLMConfig
from roll.distributed.scheduler.placement import format_plan, plan_placement, plan_role


def role(mapping: str | list[int] | None, strategy: str | None = None, typed=None, **kwargs) -> RoleConfig:
    args = None
    if strategy is not None:
        args = StrategyArgs(strategy, typed)
    return RoleConfig(strategy_args=args, device_mapping=parse_device_mapping(mapping), **kwargs)


def config(per_node: int = 8, **roles) -> RLVRConfig:
    roles.setdefault("actor_train", role("0-3"))
    roles.setdefault("actor_infer", role("0-3"))
    return RLVRConfig(num_gpus_per_node=per_node, **roles)


@pytest.mark.parametrize(
    ("mapping", "per_node", "nodes", "local"),
    [
        ("0-7", 8, [0] * 8, list(range(8))),
        ("list(range(0,16))", 8, [0] * 8 + [1] * 8, list(range(8)) * 2),
        ("list(range(0, 16, 2))", 8, [0] * 4 + [1] * 4, [0, 2, 4, 6] * 2),
        ("4-11", 8, [0] * 4 + [1] * 4, [4, 5, 6, 7, 0, 1, 2, 3]),
        ([5, 1], 4, [1, 0], [1, 1]),
        ("0-3", 2, [0, 0, 1, 1], [0, 1, 0, 1]),
    ],
)
def test_one_device_workers_land_on_node_and_slot(mapping, per_node, nodes, local):
    rp = plan_role("actor_train", role(mapping, "megatron_train", MegatronConfig()), per_node)
    assert [w.node for w in rp.workers] == nodes
    assert [w.local_devices for w in rp.workers] == [(slot,) for slot in local]
    assert [w.rank for w in rp.workers] == list(range(len(nodes)))
    assert rp.world_size == len(nodes) and rp.nodes == tuple(sorted(set(nodes)))


@pytest.mark.parametrize(
    ("tp", "mapping", "devices"),
    [
        (2, "0-7", [(0, 1), (2, 3), (4, 5), (6, 7)]),
        (4, "0-7", [(0, 1, 2, 3), (4, 5, 6, 7)]),
        (8, "8-15", [tuple(range(8, 16))]),
        (2, [6, 7, 8, 9], [(6, 7), (8, 9)]),
    ],
)
def test_engine_workers_own_tp_devices(tp, mapping, devices):
    for typed, name in (
        (VLLMConfig(tensor_parallel_size=tp), "vllm"),
        (SGLangConfig(tensor_parallel_size=tp), "sglang"),
    ):
        rp = plan_role("actor_infer", role(mapping, name, typed), devices_per_node=8)
        assert [w.devices for w in rp.workers] == devices
        assert [w.node for w in rp.workers] == [d[0] // 8 for d in devices]
        assert rp.parallel.tp == tp and rp.parallel.dp == len(devices)


def test_engine_worker_may_not_span_nodes():
    with pytest.raises(ConfigError, match=r"^actor_infer.device_mapping: worker 1 would span nodes \[0, 1\]"):
        plan_role(
            "actor_infer", role("2-9", "sglang", SGLangConfig(tensor_parallel_size=4)), devices_per_node=8
        )


def test_vllm_engine_across_nodes_needs_the_ray_backend():
    key = r"^actor_infer.strategy_args.strategy_config.distributed_executor_backend: is 'mp' but worker 1"
    with pytest.raises(
        ConfigError, match=key + r" would span nodes \[0, 1\] \(devices 6-9\).*set it to 'ray'"
    ):
        plan_role("actor_infer", role("2-9", "vllm", VLLMConfig(tensor_parallel_size=4)), devices_per_node=8)


@pytest.mark.parametrize(
    ("mapping", "tp", "per_node", "message"),
    [
        (
            "4-19",
            16,
            8,
            r"worker 0 would span nodes \[0, 1, 2\] \(devices 4-19\) but does not fill node\(s\) \[0, 2\]",
        ),
        (
            "2-9",
            4,
            8,
            r"worker 1 would span nodes \[0, 1\] \(devices 6-9\) but does not fill node\(s\) \[0, 1\]",
        ),
        ([0, 1, 2, 3, 8, 9, 10, 11], 8, 4, r"worker 0 would span nodes \[0, 2\]"),  # whole nodes, apart: fine
    ],
)
def test_ray_engine_across_nodes_fills_whole_nodes(mapping, tp, per_node, message):
    typed = VLLMConfig(tensor_parallel_size=tp, distributed_executor_backend="ray")
    if "fill" not in message:
        rp = plan_role("actor_infer", role(mapping, "vllm", typed), per_node)
        assert rp.workers_on_ray and rp.workers[0].devices == tuple(parse_device_mapping(mapping))
        return
    with pytest.raises(ConfigError, match=r"^actor_infer.device_mapping: " + message):
        plan_role("actor_infer", role(mapping, "vllm", typed), per_node)


def ray_engines(mapping: str, tp: int, **roles) -> RLVRConfig:
    typed = VLLMConfig(tensor_parallel_size=tp, distributed_executor_backend="ray")
    roles.setdefault("actor_train", role("0-7", "megatron_train", MegatronConfig()))
    return config(actor_infer=role(mapping, "vllm", typed), **roles)


def test_roll_397a17_layout_engines_span_node_pairs():
    """ROLL's Qwen3.5-397A17 file: actor_infer on 256-319 at TP 16, 8 GPUs a node: four engines,
    each on two whole nodes, each pair of nodes one placement group; every other node alone."""
    cfg = ray_engines(
        "list(range(256,320))", 16, actor_train=role("list(range(0,256))", "megatron_train", MegatronConfig())
    )
    plan = plan_placement(cfg)
    rp = plan.roles["actor_infer"]
    assert rp.workers_on_ray and rp.world_size == 4 and rp.parallel.tp == 16
    assert [w.node for w in rp.workers] == [32, 34, 36, 38]
    assert [w.devices for w in rp.workers] == [tuple(range(256 + 16 * r, 272 + 16 * r)) for r in range(4)]
    assert plan.num_nodes == 40
    assert plan.node_groups == tuple((n,) for n in range(32)) + ((32, 33), (34, 35), (36, 37), (38, 39))
    assert not plan.roles["actor_train"].workers_on_ray


def test_single_node_plans_keep_one_group_per_node():
    plan = plan_placement(ray_engines("8-15", 4))
    assert plan.node_groups == ((0,), (1,))
    plan = plan_placement(config())
    assert plan.node_groups == ((0,),)


def test_ray_engine_may_not_share_devices_with_actor_train():
    with pytest.raises(
        ConfigError,
        match=r"^actor_infer.device_mapping: shares devices 8-15 with actor_train, "
        r"but its engine runs on distributed_executor_backend 'ray'",
    ):
        plan_placement(ray_engines("8-23", 16, actor_train=role("0-15", "megatron_train", MegatronConfig())))


def test_ray_engine_may_share_devices_with_the_reference():
    ref = role("16-31", "megatron_infer", MegatronConfig())
    plan = plan_placement(ray_engines("16-31", 16, reference=ref))
    assert plan.shared == ((("actor_infer", "reference"), tuple(range(16, 32))),)
    assert plan.node_groups == ((0,), (1,), (2, 3))


def test_format_plan_says_where_each_ray_engine_is():
    text = format_plan(plan_placement(ray_engines("16-47", 16)))
    assert (
        "Engines on Ray's executor (one GPU worker per device, in this order; no GPU for the worker):" in text
    )
    assert "  actor_infer rank 0: node2: 16-23; node3: 24-31 (placement group of nodes 2,3)" in text
    assert "  actor_infer rank 1: node4: 32-39; node5: 40-47 (placement group of nodes 4,5)" in text
    assert "Engines on Ray" not in format_plan(plan_placement(config()))


def test_devices_must_divide_into_engine_workers():
    with pytest.raises(ConfigError, match="6 devices do not split into workers of 4 devices"):
        plan_role("actor_infer", role("0-5", "vllm", VLLMConfig(tensor_parallel_size=4)), devices_per_node=8)


def test_megatron_parallel_sizes_come_from_the_strategy():
    typed = MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    rp = plan_role("actor_train", role("0-15", "megatron_train", typed), devices_per_node=8)
    assert rp.world_size == 16
    assert (rp.parallel.tp, rp.parallel.pp, rp.parallel.dp) == (2, 2, 4)


def test_cpu_only_role_has_workers_but_no_devices():
    rp = plan_role("rewards.math", RewardConfig(world_size=3), devices_per_node=8)
    assert rp.cpu_only and rp.devices == () and rp.world_size == 3
    assert [w.devices for w in rp.workers] == [(), (), ()]
    assert plan_role("rewards.math", RewardConfig(), devices_per_node=8).world_size == 1


@pytest.mark.parametrize(
    ("roles", "num_nodes", "shared"),
    [
        ({"actor_train": role("0-7"), "actor_infer": role("8-15")}, 2, ()),
        (
            {"actor_train": role("0-7"), "actor_infer": role("0-7"), "reference": role("0-7")},
            1,
            ((("actor_train", "actor_infer", "reference"), tuple(range(8))),),
        ),
        (
            {"actor_train": role("0-3"), "actor_infer": role("0-7"), "reference": role("4-7")},
            1,
            ((("actor_train", "actor_infer"), (0, 1, 2, 3)), (("actor_infer", "reference"), (4, 5, 6, 7))),
        ),
        (
            {"actor_train": role("0-15"), "actor_infer": role("8-23")},
            3,
            ((("actor_train", "actor_infer"), tuple(range(8, 16))),),
        ),
    ],
)
def test_nodes_and_shared_groups(roles, num_nodes, shared):
    plan = plan_placement(config(**roles))
    assert plan.num_nodes == num_nodes and plan.devices_per_node == 8
    assert plan.shared == shared


def test_roles_on_device_and_cpu_rewards_share_nothing():
    plan = plan_placement(
        config(
            actor_train=role("0-3"),
            actor_infer=role("0-3", "vllm", VLLMConfig(tensor_parallel_size=2)),
            reference=role("2-3"),
            rewards={"math": RewardConfig(world_size=2)},
        )
    )
    assert plan.roles_on_device(0) == ["actor_train", "actor_infer"]
    assert plan.roles_on_device(3) == ["actor_train", "actor_infer", "reference"]
    assert plan.roles_on_device(5) == []
    assert plan.roles["rewards.math"].cpu_only
    assert all("rewards.math" not in owners for owners, _ in plan.shared)


def test_num_nodes_from_config_overrides_the_derived_count():
    assert plan_placement(config(per_node=4)).num_nodes == 1
    cfg = config(per_node=4)
    cfg.num_nodes = 3
    assert plan_placement(cfg).num_nodes == 3


def test_hf_infer_workers_own_one_device_each():
    rp = plan_role("actor_infer", role("0-3", "hf_infer", HFInferConfig()), devices_per_node=8)
    assert [w.devices for w in rp.workers] == [(0,), (1,), (2,), (3,)]


def test_format_plan_lists_roles_and_colocation():
    text = format_plan(
        plan_placement(
            config(
                actor_train=role("0-15"),
                actor_infer=role("8-15"),
                rewards={"math": RewardConfig(world_size=2)},
            )
        )
    )
    assert "2 node(s) x 8 GPU(s) per node" in text
    assert "node0: 0-7; node1: 8-15" in text
    assert "CPU only (2 worker(s))" in text
    assert "actor_train + actor_infer on devices 8-15" in text
