"""End to end on CPU with LoRA on a megatron_train actor (the rlvr_megatron_2gpus example shrunk as
in ``test_megatron_pipeline_cpu``: TP=2 + SP, megatron_infer rollouts, colocated, through Ray with
the test-only shims): megatron_infer receives merged weights that score like the trainer (the
model-update probe), and the final hf_model differs from the base model only in the weights of the
adapted fused layers -- ``q_proj`` alone adapts all of ``linear_qkv``, so q, k and v change."""

from __future__ import annotations

import math

import pytest
import torch
from test_megatron_pipeline_cpu import small_config
from transformers import AutoModelForCausalLM

from roll.configs.loader import load_config
from roll.pipeline.rlvr.pipeline import run_pipeline
from roll.utils.tracking import read_metrics


@pytest.mark.slow
def test_megatron_lora_pipeline_two_steps(tmp_path, shimmed_ray, example):
    lora = ["actor_train.model_args.lora_target=q_proj,down_proj", "actor_train.model_args.lora_rank=4"]
    config = load_config(
        small_config(tmp_path, example), [*lora, "actor_train.training_args.learning_rate=1e-2"]
    )
    run_dir = run_pipeline(config)

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and row["actor/grad_norm"] > 0
        assert row["model_update/probe_logprob_diff"] < 1e-4  # the engine scores like the trainer
    base = AutoModelForCausalLM.from_pretrained(example / "sft_model", dtype=torch.float32).state_dict()
    final = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model", dtype=torch.float32).state_dict()
    assert list(final) == list(base)
    changed = {name for name in base if not torch.equal(base[name], final[name])}
    layers = {int(name.split(".")[2]) for name in base if name.startswith("model.layers.")}
    targeted = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")
    assert changed == {f"model.layers.{i}.{p}.weight" for i in layers for p in targeted}
