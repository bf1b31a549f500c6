"""benchmarks/rollout.py's raw rows send what roll's strategies send: the same prompts, request ids
(up to the prefix), ``n``, seeds, log-prob requests and options, checked on the fake engines of
test_vllm_sglang_strategies.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import rollout  # noqa: E402
from test_vllm_sglang_strategies import (  # noqa: E402, F401  (pytest fixtures)
    fake_engines,
    prompt_batch,
    sglang_strategy,
    tokenizer_dir,
    vllm_strategy,
)

ROWS = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]


ARGV = ["--model", "unused", "--prompt_len", "3", "--new_tokens", "4", "--seed", "3"]


def args():
    return rollout.parse_args(ARGV)


def suffix(request_id: str, prefix: str) -> str:
    return request_id.removeprefix(prefix)


def test_raw_sglang_sends_what_the_sglang_strategy_sends(fake_engines, tokenizer_dir) -> None:  # noqa: F811
    strategy, engine = sglang_strategy(tokenizer_dir)
    strategy.generate(prompt_batch(ROWS), rollout.sampling_params(args()))
    sent = engine.generate_calls[-1]
    raw = rollout.raw_sglang_requests(args(), ROWS, "raw", context_len=None)
    assert raw["input_ids"] == sent["input_ids"]
    assert raw["sampling_params"] == sent["sampling_params"]
    assert raw["return_logprob"] is sent["return_logprob"] is True
    prefix = sent["rid"][0].rsplit("-", 2)[0]
    assert [suffix(r, "raw") for r in raw["rid"]] == [suffix(r, prefix) for r in sent["rid"]]
    assert [sp["sampling_seed"] for sp in raw["sampling_params"]] == [3, 4, 5]
    assert all(sp["ignore_eos"] and sp["max_new_tokens"] == 4 for sp in raw["sampling_params"])


@pytest.mark.parametrize("seed_mode, seeds", [("step", [None] * 3), ("request", [3, 4, 5])])
def test_raw_vllm_sends_what_the_vllm_strategy_sends(fake_engines, tokenizer_dir, seed_mode, seeds) -> None:  # noqa: F811
    strategy, llm = vllm_strategy(tokenizer_dir, seed_mode=seed_mode)
    bench_args = rollout.parse_args([*ARGV, "--seed_mode", seed_mode])
    strategy.generate(prompt_batch(ROWS), rollout.sampling_params(bench_args))
    sent = llm.llm_engine.added
    raw = rollout.raw_vllm_requests(bench_args, ROWS, "raw")
    prefix = sent[0][0].rsplit("-", 1)[0]
    assert [(suffix(rid, "raw"), prompt) for rid, prompt, _ in raw] == [
        (suffix(rid, prefix), prompt) for rid, prompt, _ in sent
    ]
    for (_, _, kwargs), (_, _, params) in zip(raw, sent):
        assert {k: getattr(params, k) for k in kwargs} == kwargs
    assert [(kw["n"], kw.get("seed"), kw["logprobs"], kw["ignore_eos"]) for _, _, kw in raw] == [
        (1, seed, 0, True) for seed in seeds
    ]
    assert [p.seed for _, _, p in sent] == seeds


def test_no_logprobs_flag_reaches_the_requests() -> None:
    bench_args = rollout.parse_args([*ARGV, "--no_logprobs"])
    assert all(kw["logprobs"] is None for _, _, kw in rollout.raw_vllm_requests(bench_args, ROWS, "raw"))
