"""Qwen2.5-VL on the Megatron strategies with packed rows, context parallelism and videos: two gloo
ranks on CPU (fp32), the tiny model (tests/tiny_vl.py), a batch of Video-R1 video rows, image rows
and a text row (``vl_cases.vl_video_batch``).

- log-probs equal transformers' (its 3-D rope positions of images and videos): padded rows (DP=2),
  packed rows (DP=2; TP=2 + SP; PP=2), context parallelism 2 (rows, and a token budget), and a
  megatron_infer reference at CP=2; on four ranks (marked slow) TP=2 + SP x CP=2, ROLL's video
  file's layout;
- one train step's reduced gradients (the vision tower's included) on packed rows at CP=2 equal the
  padded path's at DP=2 (both ranks given the same rows), and a real step at CP=2 (full recompute,
  distributed optimizer, as ROLL's video file) moves the tower and the language model.
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
pytest.importorskip("av")  # PyAV decodes the videos (the [vision] extra)

import vl_checks  # noqa: E402
from cuda_on_cpu import cuda_hidden  # noqa: E402
from gloo_ranks import spawn_ranks  # noqa: E402
from test_packing_cpu import capture_grads, compare  # noqa: E402
from two_rank_training import megatron_rank, pg_loss, raw_params, run_two_ranks, train_strategy  # noqa: E402
from vl_cases import save_case, save_tiny_vl, vl_video_batch  # noqa: E402

CP2 = {"context_parallel_size": 2}
# name -> (strategy, layout, config set before scoring)
SCORING = {
    "padded dp2": ("megatron_train", {}, {"sequence_packing": False}),
    "packed dp2": ("megatron_train", {}, {"sequence_packing": True}),
    "packed tp2_sp": (
        "megatron_train",
        {"tensor_model_parallel_size": 2, "sequence_parallel": True},
        {"sequence_packing": True},
    ),
    "packed pp2": ("megatron_train", {"pipeline_model_parallel_size": 2}, {"sequence_packing": True}),
    "cp2": ("megatron_train", CP2, {}),
    "cp2 budget": ("megatron_train", CP2, {"infer_max_tokens_per_microbatch": 1400}),
    "infer cp2": ("megatron_infer", CP2, {}),
    # four ranks (the slow test): ROLL's video file's layout, TP 2 + SP x CP 2
    "tp2_sp cp2": ("megatron_train", {**CP2, "tensor_model_parallel_size": 2, "sequence_parallel": True}, {}),
}


def check_log_probs(path: str, scratch: Path, name: str) -> list[str]:
    """The ``SCORING`` case ``name``: log-probs equal transformers' within 1e-4."""
    return vl_checks.check_log_probs(path, scratch, name, *SCORING[name])


def step_grads(path: str, layout: dict, batch, **config) -> dict[str, torch.Tensor]:
    strategy = train_strategy(path, layout)
    for key, value in config.items():
        setattr(strategy.config, key, value)
    box = capture_grads(strategy)
    strategy.train_step(batch.split(3), pg_loss)
    return box["grads"]


def check_gradients(path: str, scratch: Path) -> list[str]:
    """CP=2 on packed rows against DP=2 on padded rows (each DP rank given the whole batch)."""
    batch = torch.load(scratch / "batch.pt", weights_only=False)
    padded = step_grads(path, {}, batch, sequence_packing=False)
    packed = step_grads(path, CP2, batch)
    bad = compare("CP2 packed vs padded gradient", padded, packed)
    tower = [n for n in padded if n.startswith("visual.")]
    if not tower or not all(float(padded[n].abs().sum()) > 0 for n in tower[:4]):
        bad.append(f"the vision tower got no gradient: {tower[:3]}")
    return bad


# ROLL's video file's trainer options (at TP 1 here): full recompute, the distributed optimizer.
VIDEO_FILE_OPTIONS = {
    **CP2,
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
    "use_distributed_optimizer": True,
    "overlap_grad_reduce": True,
}


def check_train_step(path: str, scratch: Path) -> list[str]:
    strategy = train_strategy(path, VIDEO_FILE_OPTIONS)
    batch = torch.load(scratch / "batch.pt", weights_only=False)
    before = raw_params(strategy)
    metrics = strategy.train_step(batch.split(3), pg_loss)
    after = raw_params(strategy)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    bad = [] if metrics["grad_norm"] > 0 else [f"CP2 train step: metrics {metrics}"]
    if not any(n.startswith("visual.") for n in moved):
        bad.append("CP2 train step: the vision tower did not change")
    if not any(not n.startswith("visual.") for n in moved):
        bad.append("CP2 train step: the language model did not change")
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        for name in SCORING:
            if name == "tp2_sp cp2":
                continue
            bad += check_log_probs(path, Path(scratch), name)
            dist.barrier()
        bad += check_gradients(path, Path(scratch))
        dist.barrier()
        bad += check_train_step(path, Path(scratch))


def _four_rank_worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        bad += check_log_probs(path, Path(scratch), "tp2_sp cp2")


def _save_case(tmp_path: Path) -> Path:
    model = save_tiny_vl(tmp_path / "model")
    save_case(model, tmp_path, vl_video_batch)
    return model


@pytest.mark.slow  # four processes on two cores
def test_megatron_qwen2_5_vl_video_rows_at_tp2_sp_by_cp2(tmp_path: Path) -> None:
    """ROLL's video file's trainer layout, TP 2 + SP x CP 2, on four gloo ranks."""
    model = _save_case(tmp_path)
    with cuda_hidden():
        spawn_ranks(_four_rank_worker, 4, str(model), str(tmp_path))
    bad = [f"rank {r}: {x}" for r in range(4) for x in (tmp_path / f"rank{r}.txt").read_text().splitlines()]
    assert not bad, "\n".join(bad)


def test_megatron_qwen2_5_vl_packed_context_parallel_and_videos(tmp_path: Path) -> None:
    model = _save_case(tmp_path)
    bad = run_two_ranks(_worker, (str(model), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)
