"""End to end on CPU with LoRA on actor_train (fsdp2_train over 2 gloo ranks): the hf_infer engine
receives merged weights that score like the trainer (the model-update probe), and the final
hf_model differs from the base model only in the targeted weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from test_pipeline_e2e import config_dict, load, pipeline_dir  # noqa: E402

from roll.pipeline.rlvr.pipeline import run_pipeline  # noqa: E402
from roll.utils.tracking import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from pipeline_dir(tmp_path_factory, "e2e_lora")


def test_lora_run_updates_the_engine_with_merged_weights(setup):
    tmp, model = setup
    cfg = config_dict(tmp, model, tmp / "lora", max_steps=2, save_steps=2, eval_steps=0)
    cfg["actor_train"]["model_args"] |= {"lora_target": "q_proj,v_proj", "lora_rank": 4, "lora_alpha": 32}
    cfg["actor_train"]["training_args"]["learning_rate"] = 1.0e-2
    out = run_pipeline(load(tmp, "lora", cfg))

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows][-2:] == [1, 2]
    for row in rows[-2:]:
        assert row["model_update/probe_logprob_diff"] < 1e-4  # the engine scores like the trainer
    assert any(r["actor/grad_norm"] > 0 for r in rows[-2:])
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
    final = AutoModelForCausalLM.from_pretrained(out / "hf_model", dtype=torch.float32).state_dict()
    assert list(final) == list(base)
    changed = {name for name in base if not torch.equal(base[name], final[name])}
    assert changed == {
        f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "v_proj")
    }
