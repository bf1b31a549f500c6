"""``Worker``: the base class of every role's Ray actor (one process per rank).

A role's workers are started by ``roll.distributed.scheduler.cluster.Cluster``; subclasses add the
role's methods and mark them with ``@register`` so the cluster knows how to call them; the role's
``Cluster`` subclass offers one typed method per worker method::

    class RewardWorker(Worker):
        @register(Dispatch.DP_COMPUTE)
        def compute_rewards(self, batch: Batch) -> Batch:
            ...

    class RewardCluster(Cluster):
        def compute_rewards(self, batch: Batch) -> Batch:
            return self.call(RewardWorker.compute_rewards, batch)

    rewards = RewardCluster("rewards.math", RewardWorker, resource_manager, plan.roles["rewards.math"], cfg, config)
    scored = rewards.compute_rewards(batch)

What the base class does, in order: apply the environment the resource manager chose
(``CUDA_VISIBLE_DEVICES``, ``ROLL_DEVICE``, ``OMP_NUM_THREADS``, ``LOCAL_RANK``, the role's
``system_envs``), set ``RANK``/``WORLD_SIZE``, pick the device (``cuda:0`` of the visible devices on
GPU, else ``cpu``), build ``self.ctx`` and seed the RNGs with ``seed + rank``. The process group is
made later by ``init_process_group`` (the cluster calls it on every rank once all are up).

Strategies must use ``ctx.device``, not ``LOCAL_RANK``, to pick a GPU: a worker sees only its own
devices, so its device is always ``cuda:0``. ``LOCAL_RANK`` is the rank among the role's workers on
the same node (torchrun's meaning).
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import ray
import torch
import torch.distributed as dist

from roll.configs.strategies import STRATEGIES
from roll.core.worker_context import WorkerContext
from roll.distributed.executor.dispatch import Dispatch, DPRank, register
from roll.distributed.strategy.registry import load_strategy_class
from roll.utils.memory import DeviceMemoryMonitor, memory_stats
from roll.utils.ports import free_port
from roll.utils.preload import preload
from roll.utils.process_group import init_default_group
from roll.utils.start_marks import StartMarks

if TYPE_CHECKING:
    from roll.configs.pipeline_config import RLVRConfig
    from roll.configs.role import RoleConfig


class Worker:
    """One rank of one role. See the module docstring for an example."""

    # Methods a host process (``worker_host.py``) runs for one of its members at a time: building
    # a strategy imports engine modules, and transformers' lazy imports are not thread-safe.
    one_member_at_a_time: ClassVar[frozenset[str]] = frozenset({"initialize"})

    def __init__(
        self,
        role: str,
        role_config: RoleConfig,
        pipeline_config: RLVRConfig | None,
        rank: int,
        world_size: int,
        env: dict[str, str],
        shared_process: bool = False,
    ):
        # A worker in a host process (``worker_host.py``) leaves the environment to the host.
        self.shared_process = shared_process
        self.made_default_group = False
        if not shared_process:
            os.environ.update(env)
            os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size)})
            os.environ.setdefault("LOCAL_RANK", "0")
            if os.environ.get("OMP_NUM_THREADS", "").isdigit():
                torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        self.role = role
        self.role_config = role_config
        self.pipeline_config = pipeline_config
        self.rank = rank
        self.world_size = world_size
        seed = pipeline_config.seed if pipeline_config is not None else 42
        self.ctx = WorkerContext(
            role=role,
            rank=rank,
            world_size=world_size,
            local_rank=int(env.get("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))),
            device=self._pick_device(env.get("ROLL_DEVICE", os.environ.get("ROLL_DEVICE", "cpu"))),
            seed=seed,
            # An RLVR run pads generations to its response_length; an SFT run has none.
            response_length=getattr(pipeline_config, "response_length", None),
        )
        random.seed(seed + rank)
        np.random.seed((seed + rank) % 2**32)
        torch.manual_seed(seed + rank)
        self.strategy = None
        self.memory_monitor = DeviceMemoryMonitor(self.ctx.device) if self.ctx.is_cuda else None
        # An engine's import (StrategySpec.preload) starts now and overlaps the other roles' start-up;
        # create_strategy waits for it, so the two threads never import at the same time.
        self._preloading = self._start_preload() if self.ctx.is_cuda else None
        # Process start and construction (the worker module's imports done): the start-up timeline.
        self.start_marks = StartMarks()

    def _pick_device(self, kind: str) -> torch.device:
        if kind != "cuda":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"ROLL_DEVICE=cuda but torch sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)

    @register(Dispatch.RANK_ZERO)
    def get_master_address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port for the role's process group rendezvous."""
        return ray.util.get_node_ip_address(), free_port()

    @register(Dispatch.ONE_TO_ALL)
    def init_process_group(self, master_addr: str, master_port: int, force: bool = False) -> bool:
        """Join the role's default torch.distributed group (nccl on GPU, gloo on CPU).

        Sets MASTER_ADDR/MASTER_PORT either way, so a strategy may build its own group from the
        environment. A single-rank role gets no group unless ``force``. Returns whether one was made.
        """
        os.environ.update({"MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        if dist.is_initialized():
            return True
        if self.world_size == 1 and not force:
            return False
        self.made_default_group = init_default_group(
            self.rank,
            self.world_size,
            self.ctx.device,
            master_addr=master_addr,
            master_port=master_port,
            who=self.role,
        )
        return self.made_default_group

    def create_strategy(self) -> None:
        """Build the role's strategy (``strategy_args.strategy_name``) as ``self.strategy``."""
        args = self.role_config.strategy_args
        if args is None:
            raise ValueError(f"{self.role} has no strategy_args, so it has no strategy to create")
        if self._preloading is not None:
            waited = time.perf_counter()
            self._preloading.join()
            self._preloading = None
            self.start_marks.span("imports_wait", time.perf_counter() - waited)
        strategy_cls = load_strategy_class(args.strategy_name, f"{self.role}.strategy_args.strategy_name")
        self.strategy = strategy_cls(self.role_config, self.ctx)

    def _start_preload(self) -> threading.Thread | None:
        args = getattr(self.role_config, "strategy_args", None)  # reward roles may have none
        spec = STRATEGIES.get(args.strategy_name) if args is not None else None
        return preload(spec.preload) if spec is not None else None

    @register(Dispatch.ONE_TO_ALL)
    def dp_layout(self) -> DPRank:
        """(dp_rank, dp_size, is_output): the strategy's answer when it has one (Megatron: TP/PP
        ranks share a DP rank and one of them returns output), else every rank is its own DP rank."""
        if self.strategy is None:
            return DPRank(self.rank, self.world_size, True)
        return DPRank(*self.strategy.dp_layout())

    @register(Dispatch.ONE_TO_ALL)
    def ping(self) -> dict[str, object]:
        return {
            "role": self.role,
            "rank": self.rank,
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "device": str(self.ctx.device),
        }

    @register(Dispatch.ONE_TO_ALL)
    def memory_stats(self) -> dict[str, float]:
        """Peak memory (GiB) since the previous call; see ``roll.utils.memory.memory_stats``."""
        return memory_stats(self.ctx.device, self.memory_monitor)

    @register(Dispatch.ONE_TO_ALL)
    def shutdown(self) -> None:
        if self.memory_monitor is not None:
            self.memory_monitor.stop()
        # In a shared process the default group is its owner's, left to the owner's shutdown.
        if dist.is_initialized() and (self.made_default_group or not self.shared_process):
            dist.destroy_process_group()
