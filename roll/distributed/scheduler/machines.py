"""Which placement group and bundle holds each device, and which machines a group spans (pure).

A plan's nodes are reserved in groups (``PlacementPlan.node_groups``): a node alone is one placement
group of ``devices_per_node`` bundles on one machine, bundle ``i`` its slot ``i``. The nodes of an
engine that spans nodes (vLLM on Ray's executor) share one group, node by node in ascending order::

    layout = GroupLayout.of(plan)                  # node groups ((0,), (1,), (2, 3)), 8 devices a node
    layout.bundle(27)                              # (2, 11): group 2, bundle 8 + 3 (node 3, slot 3)
    machines = choose_machines([(2, 3)], {"a": 2, "b": 1, "c": 1}, 8)    # [("a", "b")]
    node_selector(("a", "b"), 8)              # 8 x {"ray.io/node-id": "a"}, 8 x {... "b"}

A group of several nodes pins each node's bundles to one machine by Ray's node-id label, on machines
that the single nodes' groups (reserved first) left whole; distinct machines where the cluster has
them, one machine several times where it holds several nodes' worth (CPU mode's one local node).
"""

from __future__ import annotations

from dataclasses import dataclass

from roll.distributed.scheduler.errors import PlacementError
from roll.distributed.scheduler.placement import PlacementPlan

# Ray's label that every node carries with its own node id (``ray.util.placement_group``).
NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class GroupLayout:
    groups: tuple[tuple[int, ...], ...]
    devices_per_node: int

    @classmethod
    def of(cls, plan: PlacementPlan) -> GroupLayout:
        """The plan's node groups; every node alone when the plan names none."""
        groups = plan.node_groups or tuple((node,) for node in range(plan.num_nodes))
        return cls(tuple(groups), plan.devices_per_node)

    def bundle(self, device: int) -> tuple[int, int]:
        """(group index, bundle index) of global device ``device``."""
        node, slot = divmod(device, self.devices_per_node)
        for index, nodes in enumerate(self.groups):
            if node in nodes:
                return index, nodes.index(node) * self.devices_per_node + slot
        raise PlacementError(
            f"device {device} (node {node}) is in no reserved node group {list(self.groups)}"
        )


def choose_machines(
    groups: list[tuple[int, ...]], free: dict[str, int], devices_per_node: int
) -> list[tuple[str, ...]]:
    """A Ray node id for every node of each group in ``groups`` from ``free`` (Ray node id -> whole
    nodes of ``devices_per_node`` GPUs it still holds): the machine with the most room left that
    the group does not use yet, else (one machine holding several nodes' worth) one it does."""
    left = dict(free)
    chosen = []
    for nodes in groups:
        picked: list[str] = []
        for node in nodes:
            fits = [m for m, room in left.items() if room > 0]
            unused = [m for m in fits if m not in picked]
            pool = unused or fits
            if not pool:
                have = ", ".join(f"{m[:8]}: {room}" for m, room in free.items()) or "none"
                raise PlacementError(
                    f"no machine left with {devices_per_node} free GPUs for node {node} of the nodes "
                    f"{list(nodes)} one engine spans (whole nodes free by Ray node: {have}); see `ray status`"
                )
            machine = max(pool, key=lambda m: left[m])  # first of the roomiest, in ``free``'s order
            left[machine] -= 1
            picked.append(machine)
        chosen.append(tuple(picked))
    return chosen


def node_selector(machines: tuple[str, ...], devices_per_node: int) -> list[dict[str, str]]:
    """Ray's ``bundle_label_selector`` for a group whose nodes are on ``machines`` (in the group's
    node order): each node's ``devices_per_node`` bundles on its machine, in bundle order."""
    return [{NODE_ID_LABEL: machine} for machine in machines for _ in range(devices_per_node)]
