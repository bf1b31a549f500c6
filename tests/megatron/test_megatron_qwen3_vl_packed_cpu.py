"""Qwen3-VL and Qwen3-VL-MoE on the Megatron strategies with packed rows, context parallelism and
mixed text / image ranks: two gloo ranks on CPU (fp32), the tiny models of tests/tiny_qwen3_vl.py
(deepstack after decoder layers 0 and 1, interleaved mrope), image rows and a text row.

- log-probs equal transformers' on packed rows (DP=2, dense) and at context parallelism 2 (each CP
  rank's zig-zag share of the packed row: its rope frequencies, image and deepstack features;
  megatron_train for the dense model, megatron_infer, as ROLL's ppu file's reference, for MoE);
- one train step's reduced gradients at CP=2 on packed rows equal padded DP=2's (both ranks given
  the same rows), every tower weight's (the deepstack mergers') nonzero;
- a text-only rank and an image rank train with ``overlap_grad_reduce`` bit for bit as without it:
  the text rank runs the tower (deepstack mergers included) on a dummy image times 0.
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

from tiny_qwen3_vl import build_tiny_qwen3_vl_dir, released_layout  # noqa: E402
from two_rank_training import megatron_rank, run_two_ranks  # noqa: E402
from vl_cases import save_case  # noqa: E402
from vl_packed_checks import check_gradients, check_log_probs, check_mixed_ranks  # noqa: E402

CP2 = {"context_parallel_size": 2}
DENSE_SCORING = {
    "packed dp2": ("megatron_train", {"sequence_packing": True}),
    "cp2": ("megatron_train", CP2),
}


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str, moe: bool) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        # MoE: ROLL's qwen3-vl-30BA3B ppu file's reference, megatron_infer at CP 2
        cases = {"infer cp2": ("megatron_infer", CP2)} if moe else DENSE_SCORING
        for name, (strategy, layout) in cases.items():
            bad += check_log_probs(path, Path(scratch), name, layout, strategy)
            dist.barrier()
        bad += check_gradients(path, Path(scratch), CP2)
        dist.barrier()
        bad += check_mixed_ranks(path, Path(scratch), rank)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_vl", "qwen3_vl_moe"])
def test_megatron_qwen3_vl_packed_context_parallel_and_mixed_ranks(tmp_path: Path, moe: bool) -> None:
    model = build_tiny_qwen3_vl_dir(tmp_path / "model", std=0.1, moe=moe)
    if moe:
        released_layout(model)
    save_case(model, tmp_path)
    bad = run_two_ranks(_worker, (str(model), str(tmp_path), moe), tmp_path)
    assert not bad, "\n".join(bad)
