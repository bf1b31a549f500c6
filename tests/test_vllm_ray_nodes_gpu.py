"""A vLLM engine at TP 2 across two Ray nodes on one 2-GPU host, through roll's strategy.

Two ``ray start`` nodes (``benchmarks/two_nodes_one_host.py``'s ``TwoNodes``): the head with
``CUDA_VISIBLE_DEVICES=0 --num-gpus=1``, the second with ``CUDA_VISIBLE_DEVICES=1 --num-gpus=1``;
Ray gives each node's GPU the id it sees there (0 and 1, the physical ids). actor_infer runs
``distributed_executor_backend: ray`` at TP 2 on devices 0-1 with ``num_gpus_per_node: 1``: the
plan makes nodes 0 and 1 one placement group, the worker sits on bundle 0 with no GPU, and vLLM's
Ray executor starts a GPU worker on each bundle, one per node. The engine spans nodes, so roll
turns vLLM's custom all-reduce off: both nodes share this host's /dev/shm, vLLM's test for "one
node", and with it on vLLM 0.24 failed to start (IndexError: device_id 1 is out of range for
assigned_physical_gpu_ids [0], docs/strategies.md). Checked: the GPU workers run on both nodes;
every greedy token is transformers' first choice on the same weights up to bf16 noise (a TP 1
engine's tokens are printed beside them: TP 2 sums in another order, so a near tie may go the other
way, as it did on H200), and their log-probs equal transformers' within bf16 tolerance; a model
update (``load_weights``, by value through every GPU worker's ``RollWorkerExtension``) makes the
engine score like the new weights; sleep and wake keep the greedy tokens.

    pytest -q -m multigpu tests/test_vllm_ray_nodes_gpu.py   # 2 GPUs
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from engine_gpu import (  # noqa: E402
    MAX_TOL,
    assert_close,
    hf_logprobs,
    hf_model,
    hf_response_logps,
    prompt_batch,
    save_tiny_model,
)
from two_nodes_one_host import LOCAL_ONLY, TOKEN_AUTH, TwoNodes  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.executor.dispatch import Dispatch, register  # noqa: E402
from roll.distributed.executor.worker import Worker  # noqa: E402

# Ray workers cannot import this test module by name; ship its classes by value.
pytest.importorskip("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])

GREEDY = SamplingParams(n=1, max_new_tokens=16, top_k=1)


class EngineWorker(Worker):
    """actor_infer's worker with the calls this test makes on its vllm strategy."""

    @register(Dispatch.ONE_TO_ALL)
    def start(self) -> tuple[list[tuple[str, str]], bool]:
        """Start the engine; (Ray node id, CUDA device) of each of its GPU workers, and whether its
        custom all-reduce is off."""
        self.create_strategy()
        self.strategy.initialize()
        parallel = self.strategy.llm.llm_engine.vllm_config.parallel_config
        return self.strategy.llm.collective_rpc(_where), parallel.disable_custom_all_reduce

    @register(Dispatch.ONE_TO_ALL)
    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        return self.strategy.generate(batch, params)

    @register(Dispatch.ONE_TO_ALL)
    def log_probs(self, batch: Batch) -> torch.Tensor:
        return self.strategy.compute_log_probs(batch)["log_probs"]

    @register(Dispatch.ONE_TO_ALL)
    def load_model(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        self.strategy.load_weights(iter(model.state_dict().items()))

    @register(Dispatch.ONE_TO_ALL)
    def sleep_and_wake(self) -> None:
        self.strategy.offload_states()
        self.strategy.reload_states()


def _where(worker) -> tuple[str, str]:
    import ray

    return ray.get_runtime_context().get_node_id(), str(worker.device)


def greedy_gap(model, batch: Batch) -> torch.Tensor:
    """[B, R] transformers' largest log-prob at each response position less that of the token the
    engine chose there: 0 where the engine's greedy pick is transformers' too, within bf16 noise
    where the two are nearly tied (TP 2 sums its partial products in another order than TP 1, so
    such a tie may go either way), large where the engine computed something else."""
    logps = hf_response_logps(model, batch)
    chosen = logps.gather(-1, batch["responses"].cuda().unsqueeze(-1)).squeeze(-1)
    return (logps.max(dim=-1).values - chosen).cpu()


def infer_role(model_dir: Path, **strategy_config) -> RoleConfig:
    engine = {"gpu_memory_utilization": 0.25, "enforce_eager": True, "sleep_level": 1, "max_model_len": 128}
    return RoleConfig(
        model_args=ModelArgs(model_name_or_path=str(model_dir), dtype="bf16"),
        strategy_args=StrategyArgs("vllm", strategy_config={**engine, **strategy_config}),
        device_mapping=[0, 1],
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_ray_nodes")
    return save_tiny_model(root / "a", seed=0), save_tiny_model(root / "b", seed=1)


@pytest.fixture(scope="module")
def one_gpu_tokens(models):
    """Greedy responses of a TP 1 engine (mp, in this process) on GPU 0: the reference."""
    from engine_gpu import make_strategy

    engine = make_strategy("vllm", models[0], gpu_memory_utilization=0.25, enforce_eager=True)
    try:
        return engine.generate(prompt_batch(models[0]), GREEDY)
    finally:
        del engine.llm
        torch.cuda.empty_cache()


def test_tp2_engine_across_two_nodes(models, one_gpu_tokens, tmp_path, monkeypatch):
    import ray

    from roll.distributed.scheduler.cluster import Cluster
    from roll.distributed.scheduler.placement import PlacementPlan, node_groups, plan_role
    from roll.distributed.scheduler.resource_manager import ResourceManager

    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv("PYTHONPATH", path)  # the nodes' workers import roll as this process does
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "0,1"))
    nodes = TwoNodes(gpus_per_node=1, cpus_per_node=4, out=tmp_path)
    nodes.start()
    rm = None
    try:
        for key, value in {**LOCAL_ONLY, **TOKEN_AUTH, "RAY_ADDRESS": nodes.address}.items():
            monkeypatch.setenv(key, value)
        role = infer_role(models[0], tensor_parallel_size=2, distributed_executor_backend="ray")
        rp = plan_role("actor_infer", role, devices_per_node=1)
        roles = {"actor_infer": rp}
        plan = PlacementPlan(2, 1, roles, (), node_groups(roles, 2, 1))
        assert plan.node_groups == ((0, 1),) and rp.workers_on_ray
        rm = ResourceManager(plan, "cuda", log_to_driver=True)
        print(rm.describe())
        engine = Cluster("actor_infer", EngineWorker, rm, rp, role)
        ((where, no_custom_all_reduce),) = engine.call(EngineWorker.start)
        print("GPU workers (Ray node, device):", where)
        assert no_custom_all_reduce, "an engine across nodes runs without vLLM's custom all-reduce"
        assert [node for node, _ in where] == [rm.slots[0].node_id, rm.slots[1].node_id]
        assert rm.slots[0].node_id != rm.slots[1].node_id

        batch = prompt_batch(models[0])
        (greedy,) = engine.call(EngineWorker.generate, batch, GREEDY)
        same_rows = (greedy["responses"] == one_gpu_tokens["responses"]).all(dim=1)
        print(f"greedy rows equal to TP 1's: {int(same_rows.sum())} of {len(same_rows)}")
        old = hf_model(models[0])
        gap = greedy_gap(old, greedy)[greedy["response_mask"].bool()]
        print(f"transformers' best log-prob less the chosen token's: max {gap.max():.4g}")
        assert gap.max() < MAX_TOL, "TP 2 across nodes picked a token transformers does not rank first"
        # top_k=1 makes every sampled log-prob 0 (the engine reports them after top-k): sample
        (out,) = engine.call(EngineWorker.generate, batch, SamplingParams(n=2, max_new_tokens=16, seed=4))
        assert_close(out["infer_logprobs"], hf_logprobs(old, out), out["response_mask"], "TP2 across nodes")

        engine.call(EngineWorker.load_model, str(models[1]))  # the model update, into both GPU workers
        (scores,) = engine.call(EngineWorker.log_probs, out)
        assert_close(scores, hf_logprobs(hf_model(models[1]), out), out["response_mask"], "after the update")
        engine.call(EngineWorker.load_model, str(models[0]))

        engine.call(EngineWorker.sleep_and_wake)
        (again,) = engine.call(EngineWorker.generate, batch, GREEDY)
        assert torch.equal(again["responses"], greedy["responses"]), "after sleep and wake"
        engine.shutdown()
    finally:
        if rm is not None:
            rm.destroy()
        ray.shutdown()
        nodes.stop()
