"""The ``llm_judge`` reward with its judge served by a real engine (``vllm``, ``sglang``) on CUDA.

The judge role is built as the pipeline builds it: a ``rewards.judge`` ``RewardConfig`` with
``reward_fn: llm_judge`` and the engine in ``strategy_args``, placed by ``plan_placement``, its
``RewardWorker`` started by a ``RewardCluster`` through Ray and scoring with ``compute_rewards``.
The worker here is ``RewardWorker`` plus a record of what the judge's engine was asked and said.
The judge is a tiny random Qwen2 (tests/engine_gpu.py), so its verdicts are arbitrary; the test
checks the plumbing:

- every sample gets a finite score in the reward's range [0, 1], with no reward error (and the
  pipeline's ``check_reward_result`` passes);
- one engine request per sample, and the prompts are the samples' judge prompts
  (``encode_judge_prompt`` of each question, response and reference, in order);
- the same samples judged again (greedy) give the same verdict tokens and the same scores.

Each case skips without its engine package (vLLM or SGLang); the module skips without a GPU.
Run: ``pytest -m gpu tests/test_llm_judge_gpu.py``.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from engine_gpu import save_tiny_model  # noqa: E402

from roll.configs.pipeline_config import RLVRConfig  # noqa: E402
from roll.configs.role import GeneratingArgs, ModelArgs, RewardConfig, RoleConfig, StrategyArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.distributed.executor.dispatch import Dispatch, register  # noqa: E402
from roll.distributed.strategy.generation import prompt_token_lists  # noqa: E402
from roll.pipeline.rewards.health import check_reward_result  # noqa: E402
from roll.pipeline.rewards.llm_judge import encode_judge_prompt  # noqa: E402
from roll.pipeline.workers.reward_worker import RewardCluster, RewardWorker  # noqa: E402

# Ray workers cannot import this test module by name; ship its worker class by value.
pytest.importorskip("ray.cloudpickle").register_pickle_by_value(sys.modules[__name__])

TEMPLATE = "Q: {question} A: {response} Ref: {reference} Verdict [[yes]] or [[no]]:"
JUDGE_KWARGS = {"unparsed_score": 0.5, "max_prompt_tokens": 160}
MAX_NEW_TOKENS = 16
ENGINES = {
    "vllm": {"gpu_memory_utilization": 0.2, "enforce_eager": True, "max_model_len": 256},
    "sglang": {"mem_fraction_static": 0.2, "disable_cuda_graph": True, "context_length": 256},
}
SAMPLES = {
    "prompt_text": ["12 + 7 =", "what is 3 * 4?", "5 - 2 =", "add 40 and 2", "9 + 9 =", "7 * 6 ="],
    "response_text": ["19", "12", "4", "42", "18 or so", ""],
    "ground_truth": ["19", "12", "3", "42", "18", "42"],
}


class RecordingJudgeWorker(RewardWorker):
    """``RewardWorker`` that keeps, per ``generate`` call of its judge strategy, the prompt token
    ids sent and the response token ids that came back."""

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> float:
        seconds = super().initialize()
        self.requests: list[dict[str, list[list[int]]]] = []
        generate = self.strategy.generate

        def recording_generate(batch: Batch, params):
            out = generate(batch, params)
            responses = [
                row[mask.bool()].tolist()
                for row, mask in zip(out["responses"].cpu(), out["response_mask"].cpu())
            ]
            self.requests.append({"prompts": prompt_token_lists(batch), "responses": responses})
            return out

        self.strategy.generate = recording_generate
        return seconds

    @register(Dispatch.ONE_TO_ALL)
    def judge_requests(self) -> list[dict[str, list[list[int]]]]:
        return self.requests


def judge_config(model_dir, engine: str) -> RLVRConfig:
    """One GPU: the judge on device 0 (the actor roles are planned there too, never started)."""
    judge = RewardConfig(
        reward_fn="llm_judge",
        judge_prompt=TEMPLATE,
        reward_kwargs=dict(JUDGE_KWARGS),
        model_args=ModelArgs(model_name_or_path=str(model_dir), dtype="bf16"),
        generating_args=GeneratingArgs(max_new_tokens=MAX_NEW_TOKENS),
        strategy_args=StrategyArgs(engine, strategy_config=dict(ENGINES[engine])),
        device_mapping=[0],
    )
    return RLVRConfig(
        actor_train=RoleConfig(device_mapping=[0]),
        actor_infer=RoleConfig(device_mapping=[0]),
        rewards={"judge": judge},
        num_gpus_per_node=1,
        device="cuda",
    )


def expected_prompts(model_dir) -> list[list[int]]:
    from roll.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    rows = zip(SAMPLES["prompt_text"], SAMPLES["response_text"], SAMPLES["ground_truth"])
    budget = JUDGE_KWARGS["max_prompt_tokens"]
    return [encode_judge_prompt(tok, TEMPLATE, q, r, g, budget, True) for q, r, g in rows]


def check_scores(scored: Batch, config: RewardConfig) -> list[float]:
    check_reward_result("rewards.judge", config, scored)  # the pipeline's check of each reward call
    n = len(SAMPLES["prompt_text"])
    scores = scored["scores"].tolist()
    assert len(scores) == n, scores
    assert all(math.isfinite(s) and 0.0 <= s <= 1.0 for s in scores), scores
    assert scored["reward_error"].sum().item() == 0, list(scored["reward_error_msg"])
    assert scored["reward_timeout"].sum().item() == 0 and scored["reward_skipped"].sum().item() == 0
    return scores


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_llm_judge_reward_served_by_engine(tmp_path, engine):
    pytest.importorskip(engine)
    import ray

    from roll.distributed.scheduler.placement import plan_placement
    from roll.distributed.scheduler.resource_manager import ResourceManager

    model_dir = save_tiny_model(tmp_path / "judge", seed=0)
    if ray.is_initialized():
        ray.shutdown()
    config = judge_config(model_dir, engine)
    plan = plan_placement(config)
    rm = ResourceManager(plan, "cuda", log_to_driver=False)
    try:
        role = "rewards.judge"
        judge = RewardCluster(
            role, RecordingJudgeWorker, rm, plan.roles[role], config.rewards["judge"], config
        )
        judge.initialize()
        batch = Batch.from_dict(non_tensors={k: list(v) for k, v in SAMPLES.items()})
        batch.meta["reward_samples"] = len(batch)  # as roll.pipeline.rlvr.stages.compute_rewards sets it
        first = check_scores(judge.compute_rewards(batch), config.rewards["judge"])
        second = check_scores(judge.compute_rewards(batch), config.rewards["judge"])
        [requests] = judge.call(RecordingJudgeWorker.judge_requests)
        print(f"{engine} judge scores: {first}")

        assert len(requests) == 2, "one engine call per compute_rewards"
        want = expected_prompts(model_dir)
        for call in requests:
            assert len(call["prompts"]) == len(call["responses"]) == len(SAMPLES["prompt_text"])
            assert call["prompts"] == want, "judge prompts are not the samples' prompts, in order"
            assert all(1 <= len(r) <= MAX_NEW_TOKENS for r in call["responses"])
        assert requests[0]["responses"] == requests[1]["responses"], "greedy judging differs"
        assert first == second
        judge.shutdown()
    finally:
        rm.destroy()
        ray.shutdown()
