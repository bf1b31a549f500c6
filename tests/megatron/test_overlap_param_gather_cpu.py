"""megatron_train with ``overlap_param_gather``: what is read right after a step is the new model.

With ``use_distributed_optimizer`` + ``overlap_param_gather`` megatron-core's optimizer step
updates only this DP rank's shard of the parameters and leaves the all-gather of the other shards
to the next forward's pre-hooks. ``iter_hf_weights`` (the model update), ``save_hf_checkpoint`` and
``save_checkpoint`` read the parameters directly, so they must finish that gather first.

Two ranks (DP=2, gloo, fp32, the CPU shims) train the same tiny model twice, once with
``overlap_param_gather`` off (the optimizer step gathers) and once on, and compare after step 1:
what ``iter_hf_weights`` yields and every rank's raw parameters; then a forward (the pre-hooks
after the exported gather must neither hang nor change anything) and step 2 (its export and its
HF checkpoint, read back here). Everything must be bit-identical. ``save_checkpoint`` (which
finishes the same gather) is exercised with the distributed optimizer over DP=2 in
``test_distopt_checkpoint_cpu.py``.
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

from safetensors.torch import load_file  # noqa: E402
from two_rank_training import (
    megatron_rank,
    pg_batch,
    pg_loss,
    raw_params,
    run_two_ranks,
    save_tiny_qwen2,
    train_strategy,
)  # noqa: E402


def _strategy(path: str, overlap: bool):
    return train_strategy(path, {"use_distributed_optimizer": True, "overlap_param_gather": overlap})


def _export(strategy) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in strategy.iter_hf_weights()}


def _run(path: str, overlap: bool, scratch: Path) -> dict:
    strategy = _strategy(path, overlap)
    mine = pg_batch(0).chunk(2)[dist.get_rank()]
    strategy.train_step(mine.split(1), pg_loss)
    out = {"export1": _export(strategy), "raw1": raw_params(strategy)}
    out["logp"] = strategy.compute_log_probs(mine)["log_probs"]
    strategy.train_step(mine.split(1), pg_loss)
    out["export2"] = _export(strategy)
    strategy.save_hf_checkpoint(str(scratch / f"hf_{overlap}"))
    out["raw2"] = raw_params(strategy)
    return out


def _differences(base: dict, got: dict) -> list[str]:
    bad = []
    for key in ("export1", "raw1", "export2", "raw2"):
        if base[key].keys() != got[key].keys():
            bad.append(f"{key}: names differ")
        bad += [
            f"{key}: {n}" for n in base[key] if n in got[key] and not torch.equal(base[key][n], got[key][n])
        ]
    if not torch.equal(base["logp"], got["logp"]):
        bad.append("log-probs after the export")
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        base = _run(path, False, Path(scratch))
        got = _run(path, True, Path(scratch))
        bad += _differences(base, got)
        assert base["export1"] or rank != 0, "DP rank 0 exported nothing"
        changed = any(not torch.equal(base["raw1"][n], p) for n, p in base["raw2"].items())
        assert changed, "step 2 changed nothing: the comparison would be vacuous"


def test_overlap_param_gather_reads_gathered_params(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "model", layers=2)
    bad = run_two_ranks(_worker, (path, str(tmp_path)), tmp_path)
    assert not bad, "overlap_param_gather=True differs from False:\n" + "\n".join(bad)
    hf = [load_file(tmp_path / f"hf_{overlap}" / "model.safetensors") for overlap in (False, True)]
    assert hf[0].keys() == hf[1].keys()
    assert [n for n in hf[0] if not torch.equal(hf[0][n], hf[1][n])] == []
