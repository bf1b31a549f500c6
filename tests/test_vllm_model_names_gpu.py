"""A model update's names reach vLLM's loaders for MoE and hybrid models (CUDA, vLLM).

roll's wire carries checkpoint names (``roll.models.checkpoint_names``: per-expert for MoE, what
Megatron's weight tables export and what fsdp2_train / hf_infer send). vLLM's ``load_weights``
skips a name it does not know without a word, so the check is on scores: vLLM starts on tiny model
A, loads tiny model B's weights as roll sends them, and must then score B's tokens as transformers
does (and, before the load, must not: the check can fail).

- Qwen3-MoE: stacked experts in transformers, per-expert names on the wire;
- Qwen3-Next: Gated DeltaNet (fused ``in_proj_qkvz`` / ``in_proj_ba``, ``conv1d``, ``A_log``,
  ``dt_bias``), output-gated attention, zero-centred norms, MoE with a gated shared expert.

Tolerance: tests/engine_gpu.py's bf16 bounds, except that with MoE layers a few tokens may differ by
more than its per-token maximum: a router whose top-k scores tie within bf16 rounding picks other
experts in the engine than in transformers (seen on an H200: Qwen3-MoE after the load, mean 0.018,
max 0.918 over 244 tokens; before it, mean 1.455). Here at most 5% of tokens may pass the maximum,
and the mean must stay under 0.05 (the unloaded model is two orders of magnitude away). Run:
``pytest -m gpu tests/test_vllm_model_names_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from engine_gpu import MAX_TOL, PROMPTS, hf_logprobs, make_strategy, prompt_batch  # noqa: E402

from roll.core.sampling import SamplingParams  # noqa: E402
from roll.models.checkpoint_names import CheckpointNames  # noqa: E402

SHAPES = {
    "qwen3_moe": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "qwen3_next": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
}


def _save(model_type: str, path: Path, seed: int, tokenizer) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **SHAPES[model_type],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger matrices than the default init, so log-probs spread out
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def assert_close_routed(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, what: str) -> None:
    diff = (got.float() - want.float()).abs()[mask.bool()]
    mean, over = diff.mean().item(), (diff > MAX_TOL).float().mean().item()
    print(
        f"{what}: mean |diff| {mean:.4g}, max {diff.max().item():.4g}, {over:.1%} of {diff.numel()} over {MAX_TOL}"
    )
    assert mean < 0.05 and over <= 0.05, f"{what}: mean {mean:.4g}, {over:.1%} of the tokens over {MAX_TOL}"


@pytest.fixture(scope="module")
def tokenizer():
    from roll.models.tiny import build_tokenizer

    return build_tokenizer(PROMPTS * 20 + [str(i) for i in range(1000)])


# 1 x H200, 2026-11-28: after the load, Qwen3-Next in vLLM (Gated DeltaNet, triton prefill) scored
# the sampled tokens at mean |diff| 0.099 from transformers' torch layers, 11.2% of them over 0.25
# (before the load: ~1.4, so the names load); whether the kernels or a tensor's layout is off is
# not known yet. Strict: a fix shows.
QWEN3_NEXT_GAP = pytest.mark.xfail(strict=True, reason="Qwen3-Next vLLM parity gap, see above")


@pytest.mark.parametrize(
    "model_type", [pytest.param(t, marks=QWEN3_NEXT_GAP) if t == "qwen3_next" else t for t in sorted(SHAPES)]
)
def test_checkpoint_names_load_into_vllm(model_type, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    a = _save(model_type, tmp_path / "a", 0, tokenizer)
    b = _save(model_type, tmp_path / "b", 1, tokenizer)
    engine = make_strategy("vllm", a, gpu_memory_utilization=0.25, enforce_eager=True, sleep_level=0)
    try:
        out = engine.generate(prompt_batch(a), SamplingParams(n=2, max_new_tokens=16, seed=4))
        new = AutoModelForCausalLM.from_pretrained(b, dtype=torch.bfloat16).cuda().eval()
        want = hf_logprobs(new, out)
        mask = out["response_mask"]
        with pytest.raises(AssertionError):  # model A's weights do not score like B
            assert_close_routed(
                engine.compute_log_probs(out)["log_probs"], want, mask, f"{model_type} before"
            )
        names = CheckpointNames.of(new)
        sent = list(names.to_checkpoint(new.state_dict().items()))
        assert any(".mlp.experts.0.gate_proj.weight" in name for name, _ in sent)  # one name per expert
        engine.load_weights(iter(sent))
        assert_close_routed(
            engine.compute_log_probs(out)["log_probs"], want, mask, f"{model_type} after the load"
        )
    finally:
        del engine.llm
        torch.cuda.empty_cache()
