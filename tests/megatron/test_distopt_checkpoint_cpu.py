"""megatron_train checkpoints with the distributed optimizer over DP=2: resume exactly, reshard.

``save_checkpoint`` promises a checkpoint "sharded by global parameter, so it loads into any TP /
PP / VPP / DP layout". With ``use_distributed_optimizer`` over more than one data-parallel rank,
megatron-core 0.16.1's default optimizer sharding ("fully_sharded_model_space") is refused by its
own dist-checkpointing ("ShardedTensor.flattened_range is not supported"), so nothing was saved.

Two ranks (gloo, fp32, the CPU shims), a tiny 4-layer Qwen2 (weight decay on), batch 1 then batch 2:
1. DP=2 + distributed optimizer: step 1, ``save_checkpoint``, step 2 (the uninterrupted run).
2. A fresh strategy, same layout: ``load_checkpoint``, step 2 -> loss and every rank's parameters
   bit-identical to the uninterrupted run. Control: the same strategy given only the step-1
   weights (its Adam state is not step 1's) ends step 2 elsewhere, so the comparison sees the
   optimizer state; loading the checkpoint again over that state gives the exact result again.
   This also catches megatron-core 0.16.1 giving every parameter one shared Adam "step" tensor
   on load (torch Adam then counts it once per parameter).
3. TP=2, PP=2 and PP=2 x VPP=2 (so DP=1) on the same two ranks: ``load_checkpoint`` gives exactly
   the saved weights, and step 2 (one DP rank with all four micro-batches, split matmuls / stages)
   matches the uninterrupted run to rounding -- 100x closer than the control, so the Adam state was
   resharded, not reset. With four micro-batches the interleaved schedule reaches its steady state,
   where two stages exchange an activation and a gradient in one call (it trained on swapped
   tensors with megatron's batched point-to-point ops; ``batch_p2p_comm`` is off for PP=2 x VPP).
   PP=2 x VPP=2 also by a round trip (load there, save again, a fresh DP=2 load of that takes step 2
   bit-identically).
4. 1 and 2 without the distributed optimizer (the default), through the same save / load code.
5. A tiny Qwen3-MoE at EP=2 x DP=2 (dense + expert optimizers chained): 1 and 2; an EP=1 layout
   refuses that checkpoint with a clear error (megatron's optimizer split depends on EP > 1).
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from tiny_models import build_tiny_tokenizer  # noqa: E402
from two_rank_training import (
    megatron_rank,
    pg_batch,
    pg_loss,
    raw_params,
    run_two_ranks,
    save_tiny_qwen2,
    train_strategy,
)  # noqa: E402

from roll.core.batch import Batch  # noqa: E402
from roll.models.megatron.hf_io import export_hf_weights, unwrap  # noqa: E402

DP2 = {"use_distributed_optimizer": True}
PLAIN_DP2 = {"use_distributed_optimizer": False}  # the default; same code path, other optimizer
TP2 = {"use_distributed_optimizer": True, "tensor_model_parallel_size": 2}
PP2 = {"use_distributed_optimizer": True, "pipeline_model_parallel_size": 2}
VPP2 = {**PP2, "virtual_pipeline_model_parallel_size": 2}
EP2 = {"use_distributed_optimizer": True, "expert_model_parallel_size": 2}
EP1 = {"use_distributed_optimizer": True}


def _strategy(path: str, layout: dict):
    # weight decay: the zero-gradient step that allocates a fresh optimizer's state moves params
    return train_strategy(path, layout, weight_decay=0.1)


def _step(strategy, batch: Batch) -> float:
    """One optimizer step on this DP rank's rows, one row per micro-batch; the loss over all DP."""
    dp_rank, dp_size, _ = strategy.dp_layout()
    mine = batch.chunk(dp_size)[dp_rank]
    loss = torch.tensor(strategy.train_step(mine.split(1), pg_loss)["loss"], dtype=torch.float64)
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def _hf(strategy) -> dict[str, torch.Tensor]:
    """Full HF tensors on every rank (each DP replica gathers its own TP shards)."""
    chunks = [unwrap(c) for c in strategy.model]
    return {n: t.detach().clone() for n, t in export_hf_weights(chunks, every_replica=True)}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _unequal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(a.keys() ^ b.keys()) + [n for n in a.keys() & b.keys() if not torch.equal(a[n], b[n])]


def _uninterrupted(path: str, ckpt: str, batches: list[Batch], layout: dict) -> dict:
    strategy = _strategy(path, layout)
    _step(strategy, batches[0])
    saved = {"hf": _hf(strategy), "raw": raw_params(strategy)}
    strategy.save_checkpoint(ckpt)
    loss = _step(strategy, batches[1])
    return {"saved": saved, "loss2": loss, "raw2": raw_params(strategy), "hf2": _hf(strategy)}


def _resume_same_layout(
    path: str, ckpt: str, batches: list[Batch], ref: dict, layout: dict, bad: list[str]
) -> float:
    """Fresh strategy of the saved layout: load, step 2 == uninterrupted; the control's distance."""
    strategy = _strategy(path, layout)
    strategy.load_checkpoint(ckpt)
    if strategy.step_count != 1:
        bad.append(f"step_count after load: {strategy.step_count}")
    bad += [f"loaded weight: {n}" for n in _unequal(raw_params(strategy), ref["saved"]["raw"])]
    loss = _step(strategy, batches[1])
    if loss != ref["loss2"]:
        bad.append(f"resumed loss {loss!r} != uninterrupted {ref['loss2']!r}")
    bad += [f"resumed step 2: {n}" for n in _unequal(raw_params(strategy), ref["raw2"])]
    # Control: the step-1 weights alone, with this strategy's (two-step) Adam state.
    strategy.load_weights(iter(ref["saved"]["hf"].items()))
    strategy.finish_model_update(1)
    _step(strategy, batches[1])
    control = _max_diff(raw_params(strategy), ref["raw2"])
    # Loading over an existing optimizer state replaces it.
    strategy.load_checkpoint(ckpt)
    _step(strategy, batches[1])
    bad += [f"reloaded step 2: {n}" for n in _unequal(raw_params(strategy), ref["raw2"])]
    return control


def _resume_resharded(
    path: str, ckpt: str, batches: list[Batch], ref: dict, layout: dict, bad: list[str]
) -> float:
    """Another layout (DP=1): exactly the saved weights after load; returns step 2's distance to
    the uninterrupted run. Each rank checks the HF tensors it exports (TP rank 0 of each stage);
    together they must cover the model."""
    name = ", ".join(f"{k}={v}" for k, v in layout.items() if k.endswith("_size"))
    strategy = _strategy(path, layout)
    strategy.load_checkpoint(ckpt)
    if strategy.dp_layout()[1] != 1 or strategy.step_count != 1:
        bad.append(f"{name}: DP={strategy.dp_layout()[1]}, step_count={strategy.step_count} after load")
    loaded = _hf(strategy)
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(loaded))
    if set().union(*names) != ref["saved"]["hf"].keys():
        bad.append(f"{name}: the ranks exported {sorted(set().union(*names))}")
    bad += [f"{name} loaded weight: {n}" for n in loaded if not torch.equal(loaded[n], ref["saved"]["hf"][n])]
    loss = _step(strategy, batches[1])
    if abs(loss - ref["loss2"]) > 1e-5:
        bad.append(f"{name} resumed loss {loss!r} vs uninterrupted {ref['loss2']!r}")
    stepped = _hf(strategy)
    distance = torch.tensor(_max_diff(stepped, {n: ref["hf2"][n] for n in stepped}) if stepped else 0.0)
    dist.all_reduce(distance, op=dist.ReduceOp.MAX)
    return float(distance)


def _round_trip(path: str, ckpt: str, batches: list[Batch], ref: dict, layout: dict, bad: list[str]) -> None:
    """Load into ``layout``, check the weights, save from there; a fresh DP=2 strategy loading that
    second checkpoint must then take step 2 bit-identically to the uninterrupted run, so nothing
    of the optimizer state was lost or changed on the way through ``layout`` (no training in it)."""
    name = ", ".join(f"{k}={v}" for k, v in layout.items() if k.endswith("_size"))
    strategy = _strategy(path, layout)
    strategy.load_checkpoint(ckpt)
    loaded = _hf(strategy)
    bad += [f"{name} loaded weight: {n}" for n in loaded if not torch.equal(loaded[n], ref["saved"]["hf"][n])]
    again = ckpt + "_again"
    strategy.save_checkpoint(again)
    strategy = _strategy(path, DP2)
    strategy.load_checkpoint(again)
    loss = _step(strategy, batches[1])
    if loss != ref["loss2"]:
        bad.append(f"via {name}: resumed loss {loss!r} != uninterrupted {ref['loss2']!r}")
    bad += [f"via {name}: resumed step 2: {n}" for n in _unequal(raw_params(strategy), ref["raw2"])]


def _dense_checks(path: str, scratch: str) -> list[str]:
    batches, bad = [pg_batch(0), pg_batch(1)], []
    ckpt = str(Path(scratch, "distopt"))
    ref = _uninterrupted(path, ckpt, batches, DP2)
    control = _resume_same_layout(path, ckpt, batches, ref, DP2, bad)
    layouts = (("TP=2", TP2), ("PP=2", PP2), ("PP=2 x VPP=2", VPP2))
    resharded = {n: _resume_resharded(path, ckpt, batches, ref, lay, bad) for n, lay in layouts}
    _round_trip(path, ckpt, batches, ref, VPP2, bad)
    plain, plain_bad = str(Path(scratch, "plain")), []
    plain_ref = _uninterrupted(path, plain, batches, PLAIN_DP2)
    plain_control = _resume_same_layout(path, plain, batches, plain_ref, PLAIN_DP2, plain_bad)
    bad += [f"no distributed optimizer: {line}" for line in plain_bad]
    if _max_diff(ref["raw2"], ref["saved"]["raw"]) == 0:
        bad.append("step 2 changed nothing: the comparisons would be vacuous")
    for name, distance in (("", control), ("no distributed optimizer: ", plain_control)):
        if not distance > 1e-4:
            bad.append(f"{name}control (weights only) is {distance:.2e} from the resumed run: too close")
    for name, distance in resharded.items():
        if not distance < control / 100:
            bad.append(f"{name} step 2 is {distance:.2e} from the uninterrupted run (control: {control:.2e})")
    return bad


def _moe_checks(path: str, scratch: str) -> list[str]:
    """EP=2 x DP=2: experts get their own distributed optimizer (a ChainedOptimizer of two, the
    expert one over an expert-DP group of 1). Resume exactly; an EP=1 layout (one optimizer)
    refuses the checkpoint with a clear error instead of failing inside megatron."""
    batches, bad = [pg_batch(0), pg_batch(1)], []
    ckpt = str(Path(scratch, "moe"))
    ref = _uninterrupted(path, ckpt, batches, EP2)
    control = _resume_same_layout(path, ckpt, batches, ref, EP2, bad)
    if not control > 1e-4:
        bad.append(f"control (weights only) is {control:.2e} from the resumed run: too close")
    try:
        _strategy(path, EP1).load_checkpoint(ckpt)
        bad.append("an EP=1 layout loaded the EP=2 checkpoint")
    except ValueError as err:
        if "holds 2 optimizer(s)" not in str(err):
            bad.append(f"EP=1 load: {err}")
    return bad


CHECKS = {"dense": _dense_checks, "moe": _moe_checks}


def _worker(rank: int, world_size: int, port: int, checks: str, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch, timeout=datetime.timedelta(seconds=120)) as bad:
        bad += CHECKS[checks](path, scratch)


def _run(checks: str, path: str, scratch: Path) -> None:
    bad = run_two_ranks(_worker, (checks, path, str(scratch)), scratch)
    assert not bad, "\n".join(bad)


def test_distributed_optimizer_checkpoint_resumes_and_reshards(tmp_path: Path) -> None:
    _run("dense", save_tiny_qwen2(tmp_path / "model", layers=4), tmp_path)


def test_moe_checkpoint_resumes_with_expert_optimizer(tmp_path: Path) -> None:
    from roll.models.random_checkpoint import write_random_checkpoint

    build_tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    path = write_random_checkpoint(
        "tiny-qwen3-moe", tmp_path / "model", tokenizer_dir=tmp_path / "tokenizer", dtype=torch.float32
    )
    _run("moe", str(path), tmp_path)
