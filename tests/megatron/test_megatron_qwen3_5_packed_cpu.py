"""Qwen3.5 on the Megatron strategies with packed rows and mixed text / image ranks: two gloo ranks on
CPU (fp32), the tiny dense Qwen3.5 of tests/tiny_qwen3_5.py (Gated DeltaNet and gated attention
layers, partial interleaved mrope), image rows and a text row.

- log-probs on packed rows (DP=2: each sequence's 3-D positions from the packed row, the Gated
  DeltaNet layers restarting per sequence) equal transformers';
- one train step's reduced gradients on packed rows equal padded rows' (DP=2), the tower's nonzero;
- a text-only rank and an image rank train with ``overlap_grad_reduce`` bit for bit as without it
  (the text rank runs the tower on a dummy image times 0);
- context parallelism: TP x CP must divide the Gated DeltaNet key heads, by key, before launch
  (CP itself: test_gated_delta_net_cp_cpu.py).

Qwen3.5-MoE runs the same forward (only its MLPs differ; test_megatron_qwen3_5_cpu.py covers them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from tiny_qwen3_5 import build_tiny_qwen3_5_dir, tiny_qwen3_5_config  # noqa: E402
from tiny_vl import build_tiny_vl_tokenizer  # noqa: E402
from two_rank_training import megatron_rank, run_two_ranks  # noqa: E402
from vl_cases import save_case  # noqa: E402
from vl_packed_checks import check_gradients, check_log_probs, check_mixed_ranks  # noqa: E402

from roll.configs.errors import ConfigError  # noqa: E402
from roll.configs.strategy_configs import MegatronConfig  # noqa: E402
from roll.models.megatron.families import padded_rows_only  # noqa: E402
from roll.models.megatron.model_fit import check_model_fits  # noqa: E402


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        bad += check_log_probs(path, Path(scratch), "packed dp2", {"sequence_packing": True})
        dist.barrier()
        bad += check_gradients(path, Path(scratch), {})
        dist.barrier()
        bad += check_mixed_ranks(path, Path(scratch), rank)


def test_megatron_qwen3_5_packed_rows_and_mixed_ranks(tmp_path: Path) -> None:
    model = build_tiny_qwen3_5_dir(tmp_path / "model", moe=False)
    save_case(model, tmp_path)
    bad = run_two_ranks(_worker, (str(model), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_packs_and_splits_its_linear_heads_over_context_parallel_ranks(moe: bool) -> None:
    """CP runs on packed rows (test_gated_delta_net_cp_cpu.py); TP x CP must divide the 2 key heads."""
    config = tiny_qwen3_5_config(build_tiny_vl_tokenizer(), moe)
    assert not padded_rows_only(config)
    check_model_fits(config, MegatronConfig(context_parallel_size=2), "x.strategy_config")
    with pytest.raises(ConfigError, match=r"x.strategy_config.context_parallel_size: 4: TP x CP"):
        check_model_fits(config, MegatronConfig(context_parallel_size=4), "x.strategy_config")
