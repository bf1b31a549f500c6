"""Experts stored stacked (Qwen3-VL-MoE): roll's per-expert names read from either stacked layout
(released: transposed; transformers 5's save: the modules' layout), TP slices included; the
stacker rebuilds the released layout from pieces arriving in any order; transformers' model of a
Qwen3-VL-MoE sends and receives its stacks as the per-expert names (CheckpointNames)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))

from roll.models.megatron.stacked_experts import Stack, StackedNames, Stacker  # noqa: E402

E, H, I = 3, 8, 6  # noqa: E741
NAMES = StackedNames(
    (Stack("gate_up_proj", ("gate_proj", "up_proj")), Stack("down_proj", ("down_proj",), out_is_hidden=True)),
    E,
    hidden=H,
    intermediate=I,
)
BLOCK = "model.language_model.layers.0.mlp.experts"


def experts() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    out = {}
    for e in range(E):
        out[f"{BLOCK}.{e}.gate_proj.weight"] = torch.randn(I, H)
        out[f"{BLOCK}.{e}.up_proj.weight"] = torch.randn(I, H)
        out[f"{BLOCK}.{e}.down_proj.weight"] = torch.randn(H, I)
    return out


@pytest.mark.parametrize("transposed", [True, False])
def test_each_expert_and_tp_slice_reads_from_either_layout(tmp_path: Path, transposed: bool) -> None:
    pieces = experts()
    stacked = dict(Stacker(NAMES).add(pieces.items()))
    assert stacked[f"{BLOCK}.gate_up_proj"].shape == (E, H, 2 * I)  # released: transposed
    assert stacked[f"{BLOCK}.down_proj"].shape == (E, I, H)
    if not transposed:  # transformers 5 saves its modules' layout
        stacked = {n: t.transpose(1, 2).contiguous() for n, t in stacked.items()}
    save_file(stacked, tmp_path / "s.safetensors")
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        for name, want in pieces.items():
            slot = NAMES.slot(name)
            sliced = f.get_slice(slot.stored)
            shape = list(sliced.get_shape())
            assert slot.transposed(shape) is transposed and slot.shape() == list(want.shape)
            assert torch.equal(slot.read(sliced, shape, None, 0, 0), want)
            assert torch.equal(slot.read(sliced, shape, 0, 2, 4), want[2:4])
            assert torch.equal(slot.read(sliced, shape, 1, 3, 6), want[:, 3:6])
    assert sorted(NAMES.expand(f"{BLOCK}.gate_up_proj")) == sorted(n for n in pieces if "down" not in n)


def test_stacker_waits_for_every_expert_and_names_a_missing_one() -> None:
    pieces = list(experts().items())
    stacker = Stacker(NAMES)
    assert [n for n, _ in stacker.add(pieces[:-1])] == [f"{BLOCK}.gate_up_proj"]
    with pytest.raises(RuntimeError, match="down_proj: only 2 of its pieces"):
        stacker.check_done()
    done = dict(stacker.add(pieces[-1:]))
    assert list(done) == [f"{BLOCK}.down_proj"]
    stacker.check_done()


def test_transformers_qwen3_vl_moe_sends_and_receives_per_expert_names() -> None:
    from tiny_qwen3_vl import tiny_qwen3_vl_moe_config
    from tiny_vl import build_tiny_vl_tokenizer
    from transformers import AutoModelForImageTextToText

    from roll.models.checkpoint_names import CheckpointNames

    model = AutoModelForImageTextToText.from_config(tiny_qwen3_vl_moe_config(build_tiny_vl_tokenizer()))
    names = CheckpointNames.of(model)
    state = model.state_dict()
    sent = dict(names.to_checkpoint(state.items()))
    fused = state["model.language_model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    gate = sent["model.language_model.layers.1.mlp.experts.2.gate_proj.weight"]
    assert torch.equal(gate, fused[2, : fused.shape[1] // 2])
    down = sent["model.language_model.layers.1.mlp.experts.3.down_proj.weight"]
    assert torch.equal(down, state["model.language_model.layers.1.mlp.experts.down_proj"][3])
    view = names.module_view(state, "model.language_model.layers.1.mlp.experts.2.up_proj.weight")
    assert torch.equal(view, fused[2, fused.shape[1] // 2 :])
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in sent)
