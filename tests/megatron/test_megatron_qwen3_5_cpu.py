"""Qwen3.5 and Qwen3.5-MoE on the Megatron strategies, two gloo ranks on CPU (fp32), tiny random
models (tests/tiny_qwen3_5.py) with ``mtp.*`` tensors as the published checkpoints have them.

- log-probs of image rows and a text row equal transformers' ``Qwen3_5(Moe)ForConditionalGeneration``
  (its 3-D interleaved rope positions) within 1e-4, on megatron_train with DP=2, TP=2 + SP, PP=2
  (and EP=2 for the MoE model), and on megatron_infer (a reference) with TP=2;
- HF -> megatron -> HF: the export (the model update's names) is the checkpoint's tensors bit for
  bit without ``mtp.*``; an HF checkpoint saved from megatron loads in transformers and equals them;
- a train step has a finite loss and moves the vision tower and the language model.

Fast tests beside it: the interleaved rope axes against transformers', the ``gdn_in_split`` layout
round trip, and config.json values roll does not run refused by key.
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

from tiny_qwen3_5 import build_tiny_qwen3_5_dir  # noqa: E402
from two_rank_training import (  # noqa: E402
    megatron_rank,
    pg_loss,
    raw_params,
    run_two_ranks,
    train_strategy,
)
from vl_cases import save_case  # noqa: E402
from vl_checks import SCORING, check_log_probs, check_saved, export_and_save  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402

MOE_SCORING = {"ep2": ("megatron_train", {"expert_model_parallel_size": 2})}


def check_round_trip(path: str, scratch: Path) -> list[str]:
    from safetensors.torch import load_file

    stored = {
        n: t for n, t in load_file(Path(path) / "model.safetensors").items() if not n.startswith("mtp.")
    }
    bad, out = export_and_save(path, scratch, stored)
    if dist.get_rank() == 0:
        from transformers import AutoModelForImageTextToText

        state = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).state_dict()
        saved = load_file(out / "model.safetensors") if (out / "model.safetensors").exists() else {}
        bad += check_saved(stored, saved)
        if not torch.equal(state["lm_head.weight"], stored["lm_head.weight"]):
            bad.append("saved: transformers loads another lm_head")
    return bad


def check_train_step(path: str, scratch: Path) -> list[str]:
    strategy = train_strategy(path, {"tensor_model_parallel_size": 2, "sequence_parallel": True})
    batch = torch.load(scratch / "batch.pt", weights_only=False)
    before = raw_params(strategy)
    metrics = strategy.train_step(batch.split(2), pg_loss)
    after = raw_params(strategy)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    bad = []
    if not (torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0):
        bad.append(f"train step: metrics {metrics}")
    vision = {n for n in before if n.startswith("visual.")}
    if not vision <= moved:
        bad.append(f"train step: tower weights without an update: {sorted(vision - moved)[:3]}")
    if not any(".self_attention.in_proj." in n for n in moved) or not moved - vision:
        bad.append("train step: the language model (Gated DeltaNet in_proj) did not change")
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str, moe: bool) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        for name, (strategy_name, layout) in (SCORING | (MOE_SCORING if moe else {})).items():
            bad += check_log_probs(path, Path(scratch), name, strategy_name, layout)
            dist.barrier()
        bad += check_round_trip(path, Path(scratch))
        dist.barrier()
        bad += check_train_step(path, Path(scratch))


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_megatron_qwen3_5_scores_round_trips_and_trains(tmp_path: Path, moe: bool) -> None:
    model = build_tiny_qwen3_5_dir(tmp_path / "model", moe=moe, mtp=True)
    save_case(model, tmp_path)
    bad = run_two_ranks(_worker, (str(model), str(tmp_path), moe), tmp_path)
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------ fast
def test_interleaved_rotary_angles_equal_transformers_on_part_of_each_head() -> None:
    """Qwen3.5's rope: interleaved axes ([3, 3, 2] frequencies) rotating the first half of each head
    (``partial_rotary_factor``); roll's angles equal transformers' cos/sin."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    from roll.models.megatron.interleaved_mrope import InterleavedMRoPE

    text = _text_config()
    hf = Qwen3_5MoeTextRotaryEmbedding(text)
    positions = torch.randint(0, 50, (3, 2, 9))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)  # [b, s, rotary dim]
    emb = InterleavedMRoPE(hf.inv_freq)(positions, text.rope_parameters["mrope_section"])  # [s, b, 1, d]
    assert emb.shape[-1] == cos.shape[-1] == 16  # half of head_dim 32
    assert torch.allclose(emb[:, :, 0].transpose(0, 1).cos(), cos, atol=1e-6)
    assert torch.allclose(emb[:, :, 0].transpose(0, 1).sin(), sin, atol=1e-6)


def test_gdn_in_split_round_trips_over_tp() -> None:
    from roll.models.megatron import weight_mapping as wm

    heads = wm.HeadLayout(32, 2, wm.LinearHeads(2, 4, 8, 12))
    qkv, z, b, a = torch.randn(2 * 16 + 48, 5), torch.randn(48, 5), torch.randn(4, 5), torch.randn(4, 5)
    for tp in (1, 2):
        shards = []
        for rank in range(tp):
            pieces = []
            for tensor in (qkv, z, b, a):
                for start, stop in wm.read_ranges(wm.GDN_IN_SPLIT, tensor.shape[0], tp, rank, 0, heads):
                    pieces.append(tensor[start:stop])
            shards.append(wm.fuse(wm.GDN_IN_SPLIT, pieces, heads))
        per_shard = [wm.unfuse(wm.GDN_IN_SPLIT, s, heads) for s in shards]
        pieces = [torch.cat([p[i] for p in per_shard]) for i in range(6)]
        back = wm.join(wm.GDN_IN_SPLIT, pieces)
        assert all(torch.equal(x, y) for x, y in zip(back, (qkv, z, b, a))), tp
    # rank 0 of 2 holds the first key head's q and k and value heads 0-1 (v, z, beta, alpha)
    whole = wm.fuse(wm.GDN_IN_SPLIT, [qkv[:8], qkv[16:24], qkv[32:56], z[:24], b[:2], a[:2]], heads)
    assert torch.equal(shards[0], whole)


def _text_config(**overrides):
    from transformers import Qwen3_5MoeTextConfig

    shape = dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                         "mrope_section": [3, 3, 2]},
    )  # fmt: skip
    return Qwen3_5MoeTextConfig(**{**shape, **overrides})


def test_bad_config_values_are_refused_by_key() -> None:
    from roll.models.megatron import families, qwen3_5

    kwargs = families.transformer_kwargs(_text_config())
    assert kwargs["mrope_section"] == [3, 3, 2] and kwargs["moe_router_pre_softmax"] is False
    assert kwargs["moe_layer_freq"] == [1, 1, 1, 1] and kwargs["moe_shared_expert_gate"]
    assert kwargs["linear_attention_freq"] == [1, 1, 1, 0]  # every 4th layer full by default
    rope = families.rope_kwargs(_text_config())
    assert rope == {"position_embedding_type": "mrope", "rotary_base": 1e4, "rotary_percent": 0.5}
    bad_rope = {
        "rope_type": "default",
        "rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "mrope_section": [4, 4, 4],
    }
    for config, key in (
        (_text_config(rope_parameters=bad_rope), "mrope_section"),
        (_text_config(linear_num_value_heads=3), "linear_num_value_heads"),
        (_text_config(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
    ):
        with pytest.raises(ConfigError, match=key):
            families.transformer_kwargs(config)
    assert qwen3_5.mrope_section(_text_config(rope_parameters={"rope_theta": 1e4})) == [11, 11, 10]


def test_rolls_vision_model_prefix_freezes_the_tower() -> None:
    """ROLL's qwen3.5 files freeze ``vision_model`` (mcore_adapter's name of the tower)."""
    from roll.models.megatron.qwen2_5_vl import freeze_vision_tower

    chunk = torch.nn.Module()
    chunk.pre_process, chunk.visual, chunk.decoder = True, torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert freeze_vision_tower([chunk], ["vision_model"], "actor_train.model_args.freeze_module_prefix") == 2
    assert not chunk.visual.weight.requires_grad and chunk.decoder.weight.requires_grad
    with pytest.raises(ConfigError, match="vision_model"):
        freeze_vision_tower([chunk], ["decoder"], "actor_train.model_args.freeze_module_prefix")
