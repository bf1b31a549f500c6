"""Qwen3-VL on the Megatron strategies, two gloo ranks on CPU (fp32), tiny model (tests/tiny_qwen3_vl.py:
4 decoder layers, deepstack after the first 2, interleaved mrope).

- log-probs of image rows (and a text row) equal transformers' Qwen3VLForConditionalGeneration's, on
  megatron_train with DP=2, TP=2 + SP and PP=2, and on megatron_infer (a reference) with TP=2;
- the weights round-trip: the HF export is the checkpoint's tensors, bit for bit, and an HF
  checkpoint saved from megatron loads in transformers with the same tensors;
- a train step reaches the vision tower (its deepstack mergers included) and the language model, on
  TP=2 + SP, on PP=2, and with ``recompute_granularity: full`` (the deepstack features ride with the
  recomputed layers' inputs); ``freeze_module_prefix: model.visual`` keeps the tower as it was;
- the interleaved rotary angles equal transformers' Qwen3-VL text rotary embedding's;
- a pipeline layout that would put a deepstack layer off the first stage is a ConfigError
  (context parallelism is not: test_megatron_qwen3_vl_packed_cpu.py runs it).
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
from tiny_qwen3_vl import build_tiny_qwen3_vl_dir, tiny_qwen3_vl_config  # noqa: E402
from tiny_vl import build_tiny_vl_tokenizer  # noqa: E402
from two_rank_training import megatron_rank, run_two_ranks  # noqa: E402
from vl_cases import save_case  # noqa: E402
from vl_checks import check_saved, export_and_save  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.strategy_configs import MegatronConfig  # noqa: E402
from roll.models.megatron.model_fit import check_model_fits  # noqa: E402

TRAINING["recompute_full"] = {"recompute_granularity": "full", "tensor_model_parallel_size": 2}


def check_round_trip(path: str, scratch: Path) -> list[str]:
    from safetensors.torch import load_file

    stored = load_file(Path(path) / "model.safetensors")  # transformers 5's module names already
    bad, out = export_and_save(path, scratch, stored)
    if dist.get_rank() == 0:
        from transformers import AutoModelForImageTextToText

        state = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).state_dict()
        bad += check_saved(stored, state)
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        for name in SCORING:
            bad += check_log_probs(path, Path(scratch), name)
            dist.barrier()
        bad += check_round_trip(path, Path(scratch))
        dist.barrier()
        for freeze, layout in (
            (False, "tp2_sp"),
            (True, "tp2_sp"),
            (False, "pp2"),
            (False, "recompute_full"),
        ):
            bad += check_train_step(path, Path(scratch), freeze, layout)
            dist.barrier()


def test_megatron_qwen3_vl_scores_round_trips_and_trains(tmp_path: Path) -> None:
    model = build_tiny_qwen3_vl_dir(tmp_path / "model", std=0.1)
    save_case(model, tmp_path)
    bad = run_two_ranks(_worker, (str(model), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)


def test_interleaved_rotary_angles_equal_transformers() -> None:
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from roll.models.megatron.interleaved_mrope import InterleavedMRoPE

    text = tiny_qwen3_vl_config(build_tiny_vl_tokenizer()).text_config
    hf = Qwen3VLTextRotaryEmbedding(text)
    positions = torch.randint(0, 50, (3, 2, 9))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)  # [b, s, d]
    emb = InterleavedMRoPE(hf.inv_freq)(positions, text.rope_parameters["mrope_section"])  # [s, b, 1, d]
    assert torch.allclose(emb[:, :, 0].transpose(0, 1).cos(), cos, atol=1e-6)
    assert torch.allclose(emb[:, :, 0].transpose(0, 1).sin(), sin, atol=1e-6)
    sectioned = positions[0, ..., None].float() * hf.inv_freq  # the T axis only: must differ
    assert not torch.allclose(emb[:, :, 0, :16].transpose(0, 1), sectioned)


def test_layouts_putting_deepstack_off_the_first_stage_are_refused() -> None:
    config = tiny_qwen3_vl_config(build_tiny_vl_tokenizer())
    with pytest.raises(ConfigError) as err:
        check_model_fits(
            config,
            MegatronConfig(pipeline_model_parallel_size=4),
            "actor_train.strategy_args.strategy_config",
        )
    assert "actor_train.strategy_args.strategy_config.pipeline_model_parallel_size" in str(err.value)
    check_model_fits(config, MegatronConfig(pipeline_model_parallel_size=2), "x")  # 2 layers there: fine
    check_model_fits(config, MegatronConfig(context_parallel_size=2), "x")  # packed rows split per CP rank
