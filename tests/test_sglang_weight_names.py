"""roll's weight names as SGLang's loaders take them (``sglang_weight_names``), and every weight
update through ``SGLangEngineCalls`` carrying them, on CPU with a fake engine."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from roll.distributed.strategy.sglang_engine_calls import SGLangEngineCalls
from roll.distributed.strategy.sglang_weight_names import sglang_weight_names

sys.path.insert(0, str(Path(__file__).parent))
from tiny_vl import build_tiny_vl_dir  # noqa: E402


def test_qwen2_5_vl_names_are_the_checkpoint_layout_sglang_loads(tmp_path):
    """Every tensor of a Qwen2.5-VL as roll sends it (transformers 5's module names) renamed lands
    on a name of the saved checkpoint, the layout SGLang's Qwen2.5-VL loader matches (lm_head is
    tied in the tiny model, so not saved)."""
    from transformers import AutoModelForImageTextToText

    model_dir = build_tiny_vl_dir(tmp_path / "vl")
    saved = set()
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            saved |= set(handle.keys())
    ours = list(AutoModelForImageTextToText.from_pretrained(model_dir).state_dict())
    assert any(n.startswith("model.language_model.") for n in ours) and any(
        n.startswith("model.visual.") for n in ours
    )
    rename = sglang_weight_names("qwen2_5_vl")
    assert {rename(n) for n in ours} == saved | {"lm_head.weight"}
    assert rename("model.visual.blocks.0.mlp.gate_proj.weight") == "visual.blocks.0.mlp.gate_proj.weight"
    assert rename("model.language_model.norm.weight") == "model.norm.weight"


def test_other_models_keep_roll_names():
    for model_type in (None, "qwen2", "qwen3_vl", "qwen3_vl_moe"):
        rename = sglang_weight_names(model_type)
        assert rename("model.language_model.norm.weight") == "model.language_model.norm.weight"
        assert rename("model.visual.merger.mlp.0.weight") == "model.visual.merger.mlp.0.weight"


class RecordingEngine:
    """The two weight-update calls of ``sglang.Engine``, recording the names they get."""

    def __init__(self) -> None:
        self.names: list[list[str]] = []

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        self.names.append([name for name, _ in named_tensors])
        return True, ""

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, flush_cache, load_format):
        self.names.append(list(names))
        return True, ""


def test_engine_calls_rename_every_update():
    engine = RecordingEngine()
    calls = SGLangEngineCalls(engine, sglang_weight_names("qwen2_5_vl"))
    calls.update_weights_from_tensor(
        [("model.visual.blocks.0.attn.qkv.weight", torch.zeros(2)), ("lm_head.weight", torch.zeros(2))]
    )
    tensor = SimpleNamespace(
        name="model.language_model.layers.0.mlp.up_proj.weight", dtype=torch.bfloat16, shape=(2, 2)
    )
    calls.update_weights_from_distributed(SimpleNamespace(tensors=[tensor], index=0), "g0")
    assert engine.names == [
        ["visual.blocks.0.attn.qkv.weight", "lm_head.weight"],
        ["model.layers.0.mlp.up_proj.weight"],
    ]
    plain = RecordingEngine()
    SGLangEngineCalls(plain).update_weights_from_tensor(
        [("model.language_model.norm.weight", torch.zeros(1))]
    )
    assert plain.names == [["model.language_model.norm.weight"]]
