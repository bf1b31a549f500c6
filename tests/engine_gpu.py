"""Helpers shared by the GPU tests of the engine strategies (``vllm``, ``sglang``): tiny models
saved with larger weights, transformers' log-probs on the same weights, and the bf16 tolerance.

bf16 tolerance: an engine and transformers run different kernels (fused attention and layers vs
eager), so log-probs of the same tokens differ by rounding: we require a mean |difference| below
0.02 and a maximum below 0.25 per token, where a wrong token, position or weight gives differences
of order 1 (the load tests check that the old weights fail this).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs
from roll.core.batch import Batch
from roll.core.sampling import SamplingParams
from roll.core.worker_context import WorkerContext
from roll.distributed.strategy.registry import load_strategy_class

MEAN_TOL, MAX_TOL = 0.02, 0.25
PROMPTS = [
    "12 + 7 =",
    "what is 3 * 4?",
    "5 - 2 =",
    "add 40 and 2",
    "9 + 9 =",
    "1 + 1 =",
    "7 * 6 =",
    "8 - 3 =",
]


# ------------------------------------------------------------------------------------ helpers


def save_tiny_model(path: Path, seed: int, build: Callable[[Any, int], Any] | None = None) -> Path:
    """A tiny causal LM (``build(tokenizer, seed)``; default roll's tiny Qwen2) on a tokenizer of
    ``PROMPTS``, every matrix drawn from N(0, 0.1), saved with the tokenizer in ``path``."""
    from roll.models.tiny import TinyModelSpec, build_tiny_qwen2, build_tokenizer, save_model_and_tokenizer

    tokenizer = build_tokenizer(PROMPTS * 20 + [str(i) for i in range(1000)])
    if build is None:
        model = build_tiny_qwen2(tokenizer, TinyModelSpec(), seed)
    else:
        model = build(tokenizer, seed)
    with torch.no_grad():  # larger weights than the default init, so log-probs spread out
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.1)
    save_model_and_tokenizer(model, tokenizer, path)
    return path


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


@torch.no_grad()
def hf_response_logps(model, batch: Batch) -> torch.Tensor:
    """[B, R, V] log-probs over the vocabulary at each response position under ``model`` (prompts
    left-padded), on the model's device."""
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1).cuda()
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).cuda()
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    width = batch["responses"].shape[1]
    return torch.log_softmax(logits[:, -width - 1 : -1], dim=-1)


def hf_logprobs(model, batch: Batch) -> torch.Tensor:
    """[B, R] log-probs of ``batch["responses"]`` under ``model`` (prompts left-padded)."""
    logps = hf_response_logps(model, batch)
    return logps.gather(-1, batch["responses"].cuda().unsqueeze(-1)).squeeze(-1).cpu()


def assert_close(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, what: str) -> tuple[float, float]:
    diff = (got.float() - want.float()).abs()[mask.bool()]
    mean, worst = diff.mean().item(), diff.max().item()
    print(f"{what}: mean |diff| {mean:.4g}, max {worst:.4g} over {diff.numel()} tokens")
    assert mean < MEAN_TOL and worst < MAX_TOL, f"{what}: mean {mean:.4g}, max {worst:.4g}"
    return mean, worst


def prompt_batch(tokenizer_dir: Path, texts: list[str] = PROMPTS, width: int = 16) -> Batch:
    from roll.models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    prompts = torch.full((len(texts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for row, text in enumerate(texts):
        ids = tok(text, add_special_tokens=False)["input_ids"][-width:]
        prompts[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    return Batch.from_dict(
        {"prompts": prompts, "prompt_mask": mask}, {"uid": [f"u{i}" for i in range(len(texts))]}
    )


def make_strategy(name: str, model_dir: Path, rank: int = 0, **cfg):
    """An initialised ``name`` strategy (``vllm`` or ``sglang``) as actor_infer DP rank ``rank`` of 2."""
    args = StrategyArgs(name, cfg)
    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=str(model_dir), dtype="bf16"), strategy_args=args
    )
    ctx = WorkerContext(
        role="actor_infer", rank=rank, world_size=2, local_rank=0, device=torch.device("cuda", 0), seed=100
    )
    strategy = load_strategy_class(name)(role, ctx)
    strategy.initialize()
    return strategy


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0] / 2**30


# ------------------------------------------------------------------ checks both engines pass
# Each takes an initialised strategy (``engine``) and the two saved models of ``save_tiny_model``.


def check_generate_n_samples_layout_and_logprobs_match_hf(engine, models) -> None:
    batch = prompt_batch(models[0])
    out = engine.generate(batch, SamplingParams(n=4, max_new_tokens=24, temperature=1.0, seed=3))
    assert out["responses"].shape == (len(PROMPTS) * 4, 24)
    assert torch.equal(out["prompts"], batch["prompts"].repeat_interleave(4, dim=0))
    lengths = out["response_mask"].sum(1)
    assert lengths.min() >= 1 and lengths.float().mean() > 4, lengths
    samples = out["responses"].view(len(PROMPTS), 4, -1)
    assert any(not torch.equal(samples[i, 0], samples[i, 1]) for i in range(len(PROMPTS)))
    assert_close(
        out["infer_logprobs"], hf_logprobs(hf_model(models[0]), out), out["response_mask"], "generate"
    )


def check_sampling_params_top_k_stop_ids_and_min_tokens(engine, models) -> None:
    batch = prompt_batch(models[0])
    greedy = engine.generate(batch, SamplingParams(n=1, max_new_tokens=16, temperature=0.0, logprobs=False))
    top1 = engine.generate(batch, SamplingParams(n=2, max_new_tokens=16, top_k=1, seed=5, logprobs=False))
    assert torch.equal(top1["responses"][::2], greedy["responses"])
    assert torch.equal(top1["responses"][1::2], greedy["responses"])
    stop = int(greedy["responses"][0, 2])
    stopped = engine.generate(
        batch, SamplingParams(n=1, max_new_tokens=16, temperature=0.0, stop_token_ids=[stop])
    )
    first = (greedy["responses"][0] == stop).nonzero()[0].item()
    assert stopped["response_mask"][0].sum().item() == first + 1
    longer = engine.generate(
        batch, SamplingParams(n=1, max_new_tokens=16, min_new_tokens=12, stop_token_ids=[stop], seed=1)
    )
    assert longer["response_mask"].sum(1).min().item() >= 12


def check_compute_log_probs_matches_hf(engine, models) -> None:
    out = engine.generate(prompt_batch(models[0]), SamplingParams(n=2, max_new_tokens=20, seed=11))
    scored = engine.compute_log_probs(out)["log_probs"]
    assert_close(scored, hf_logprobs(hf_model(models[0]), out), out["response_mask"], "prompt scoring")
    assert_close(scored, out["infer_logprobs"], out["response_mask"], "scoring vs sampling log-probs")


def check_generate_one_and_abort_from_another_thread(engine, models) -> None:
    prompt = prompt_batch(models[0], PROMPTS[:1])["prompts"][0]
    ids = [int(t) for t in prompt if t != 0]
    done = engine.generate_one(ids, SamplingParams(n=2, max_new_tokens=8, seed=1))
    assert len(done) == 2 and all(c.finish_reason in ("stop", "length") for c in done)
    result = {}
    long = SamplingParams(n=3, max_new_tokens=4000, ignore_eos=True)  # stopped at the context

    def run() -> None:
        try:
            result["out"] = engine.generate_one(ids, long, request_id="job")
        except Exception as exc:  # re-raised below, on the test's thread
            result["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 30
    while not engine.registry.in_flight() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.abort(["job"]), "nothing was in flight to abort"
    worker.join(timeout=60)
    assert not worker.is_alive()
    if "error" in result:
        raise result["error"]
    assert [c.finish_reason for c in result["out"]] == ["abort"] * 3


def check_load_weights_changes_scores_to_the_new_model(engine, models) -> None:
    out = engine.generate(prompt_batch(models[0]), SamplingParams(n=2, max_new_tokens=20, seed=2))
    new = hf_model(models[1])
    want = hf_logprobs(new, out)
    with pytest.raises(AssertionError):  # the old weights do not pass the tolerance
        assert_close(engine.compute_log_probs(out)["log_probs"], want, out["response_mask"], "old weights")
    engine.load_weights((name, t) for name, t in new.state_dict().items())
    assert_close(engine.compute_log_probs(out)["log_probs"], want, out["response_mask"], "after load_weights")
    old = hf_model(models[0])
    engine.load_weights((name, t) for name, t in old.state_dict().items())
    assert_close(
        engine.compute_log_probs(out)["log_probs"], hf_logprobs(old, out), out["response_mask"], "restored"
    )
