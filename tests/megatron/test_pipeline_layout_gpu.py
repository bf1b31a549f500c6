"""``pipeline_model_parallel_layout`` on two CUDA devices (NCCL, fp32 with TF32 off): the checks of
test_pipeline_layout_cpu.py (``E|tt|tt|L`` and ``Ettt||t|L`` at VPP 2 derived from the layout,
``Et|tttL`` uneven) against PP=1 on the same two devices: HF weights round-trip bit for bit, log-probs
and one train step's loss and weights equal PP=1's, megatron_infer's greedy tokens at ``Et|tttL``.

    pytest -m "gpu and multigpu" tests/megatron/test_pipeline_layout_gpu.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from gloo_ranks import process_group, spawn_ranks  # noqa: E402
from test_pipeline_layout_cpu import check  # noqa: E402
from two_rank_training import save_tiny_qwen2  # noqa: E402
from vl_gpu_checks import tf32_off  # noqa: E402


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    tf32_off()
    with process_group(rank, world_size, port, backend="nccl"):
        Path(scratch, f"rank{rank}.txt").write_text("\n".join(check(path, device="cuda")))


@pytest.mark.gpu
@pytest.mark.multigpu
def test_layouts_match_pp1_on_two_devices(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    path = save_tiny_qwen2(tmp_path / "model", layers=4)
    spawn_ranks(_worker, 2, path, str(tmp_path))
    bad = [
        f"rank {r}: {line}" for r in (0, 1) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()
    ]
    assert not bad, "\n".join(bad)
