"""End to end on CPU: a tiny Qwen3-Next (Gated DeltaNet + gated attention + MoE with a gated shared
expert) through the RLVR loop for 2 steps, the way ROLL's qwen3-next files run it: megatron_train
(TP=2 + SP) trains and megatron_infer scores the reference, while transformers' model (hf_infer,
standing in for vLLM, which megatron_infer cannot replace for this family) rolls out and receives
the trainer's weights after each step, all colocated on 2 CPU slots through Ray with the Megatron
CPU shims.

What it guards: the model update's names and shapes for every Qwen3-Next tensor reach an HF-named
engine (the probe compares the engine's log-probs with the trainer's after each update), and the
loop trains it (finite losses, both steps logged, the final export).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from conftest import check_two_steps, shrunk_example, write_config
from tiny_models import tiny_qwen3_next_config

from roll.configs.loader import load_config
from roll.pipeline.rlvr.pipeline import run_pipeline

pytest.importorskip("megatron.core")


def tiny_qwen3_next(path: Path, tokenizer_dir: Path) -> Path:
    """A random tiny Qwen3-Next with the default example's tokenizer (layers: linear, full,
    linear with a dense MLP, full)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_qwen3_next_config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
def test_qwen3_next_rlvr_two_steps(tmp_path, shimmed_ray, example):
    model = tiny_qwen3_next(tmp_path / "qwen3_next", example / "sft_model")
    raw = shrunk_example("rlvr_megatron_2gpus", tmp_path, example, model, 4, 2, eval_steps=0, save_steps=0)
    raw.pop("validation")
    raw["response_length"] = 16
    raw["actor_infer"]["strategy_args"] = {"strategy_name": "hf_infer"}
    run_dir = run_pipeline(load_config(write_config(raw, tmp_path / "qwen3_next_cpu.yaml")))

    check_two_steps(run_dir)
    exported = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf_model", dtype=torch.float32)
    assert type(exported).__name__ == "Qwen3NextForCausalLM"
