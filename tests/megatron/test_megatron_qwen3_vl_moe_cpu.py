"""Qwen3-VL-MoE on the Megatron strategies, two gloo ranks on CPU (fp32): the tiny Qwen3-VL of
tests/tiny_qwen3_vl.py with 4 experts (top 2) in every decoder layer, its checkpoint in the released
layout (each layer's experts stacked and transposed: ``mlp.experts.gate_up_proj`` [E, H, 2I],
``down_proj`` [E, I, H]).

- log-probs of image rows equal transformers' Qwen3VLMoeForConditionalGeneration's with EP=2 (each
  rank reads its experts' slices of the stacks), TP=2 + SP (expert-TP 2) and on megatron_infer;
- the weights round-trip bit for bit: the export (the model update's wire) names each expert
  (``experts.<e>.gate_proj.weight``, what vLLM's loader also takes) and equals the stacks' slices; a
  checkpoint saved with EP=2 holds the stacks over all experts in the released layout, equal to the
  original file, and loads in transformers; ``convert`` hf-to-mcore (EP=2) and back gives the file;
- a train step moves the experts, the router and the tower (EP=2, TP=2 + SP).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from test_megatron_vl_cpu import SCORING, TRAINING, check_log_probs, check_train_step  # noqa: E402
from tiny_qwen3_vl import build_tiny_qwen3_vl_dir, released_layout  # noqa: E402
from two_rank_training import megatron_rank, run_two_ranks  # noqa: E402
from vl_cases import save_case  # noqa: E402
from vl_checks import export_and_save  # noqa: E402

STACKS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
SCORING["ep2"] = ("megatron_train", {"expert_model_parallel_size": 2})
TRAINING["ep2"] = {"expert_model_parallel_size": 2}


def per_expert(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stacks of a released-layout checkpoint as each expert's tensors (the wire's names)."""
    out = {}
    for name, tensor in stored.items():
        block, _, stack = name.rpartition(".")
        if stack not in STACKS:
            out[name] = tensor
            continue
        for e in range(tensor.shape[0]):
            for part, piece in zip(STACKS[stack], tensor[e].transpose(0, 1).chunk(len(STACKS[stack]))):
                out[f"{block}.{e}.{part}.weight"] = piece
    return out


def check_round_trip(path: str, scratch: Path) -> list[str]:
    from safetensors.torch import load_file

    from roll.models.megatron import convert

    stored = load_file(Path(path) / "model.safetensors")
    bad, out = export_and_save(path, scratch, per_expert(stored), {"expert_model_parallel_size": 2})
    mcore, back = scratch / "mcore", scratch / "back"
    convert.write_mcore(path, mcore, convert.layout_config(1, 1, 2))
    convert.read_mcore(mcore, back, max_shard_size=20_000)  # several parts, each stack whole in one
    if dist.get_rank() != 0:
        return bad
    from transformers import AutoModelForImageTextToText

    for tag, directory in (("saved", out), ("converted", back)):
        written = {}
        for file in directory.glob("*.safetensors"):
            written.update(load_file(file))
        if set(written) != set(stored):
            bad.append(f"{tag}: names differ: {sorted(set(written) ^ set(stored))[:4]}")
        bad += [
            f"{tag}: {n} differs"
            for n, t in stored.items()
            if n in written and not torch.equal(written[n], t)
        ]
    original = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).state_dict()
    state = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).state_dict()
    bad += [
        f"saved, in transformers: {n} differs" for n, t in original.items() if not torch.equal(state[n], t)
    ]
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        for name in ("ep2", "tp2_sp", "infer_tp2"):
            bad += check_log_probs(path, Path(scratch), name)
            dist.barrier()
        bad += check_round_trip(path, Path(scratch))
        dist.barrier()
        for layout in ("ep2", "tp2_sp"):
            bad += check_train_step(path, Path(scratch), False, layout)
            dist.barrier()


def test_megatron_qwen3_vl_moe_scores_round_trips_and_trains(tmp_path: Path) -> None:
    model = released_layout(build_tiny_qwen3_vl_dir(tmp_path / "model", std=0.1, moe=True))
    save_case(model, tmp_path)
    bad = run_two_ranks(_worker, (str(model), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)
