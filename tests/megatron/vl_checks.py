"""Checks the Megatron vision-language CPU tests run inside a two-rank gloo worker
(``two_rank_training.megatron_rank``) on the files ``vl_cases.save_case`` writes (``batch.pt``, and
transformers' log-probs of it, ``want.pt``); each returns what is wrong, as lines.

>>> bad += check_log_probs(path, scratch, "tp2_sp", "megatron_train", {"tensor_model_parallel_size": 2})
>>> bad += check_export(stored, full_hf_weights(strategy))   # the HF export, bit for bit
>>> bad += check_saved(stored, saved)                         # a saved HF checkpoint, bit for bit
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from two_rank_training import full_hf_weights, train_strategy

# name -> (strategy, parallel layout): the scoring cases every VL model runs on two ranks
SCORING = {
    "dp2": ("megatron_train", {}),
    "tp2_sp": ("megatron_train", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2": ("megatron_train", {"pipeline_model_parallel_size": 2}),
    "infer_tp2": ("megatron_infer", {"tensor_model_parallel_size": 2}),
}


def check_log_probs(
    path: str, scratch: Path, name: str, strategy_name: str, layout: dict, config: dict | None = None
) -> list[str]:
    """The batch's log-probs on ``strategy_name`` with the parallel ``layout`` (and strategy
    ``config`` values set after it is built) equal transformers' within 1e-4."""
    strategy = train_strategy(path, layout, strategy=strategy_name)
    for key, value in (config or {}).items():
        setattr(strategy.config, key, value)
    batch, want = torch.load(scratch / "batch.pt", weights_only=False), torch.load(scratch / "want.pt")
    got = strategy.compute_log_probs(batch)["log_probs"]
    diff = float((got - want).abs().max())
    return [f"{name}: log-probs differ from transformers' by {diff:.2e}"] if diff > 1e-4 else []


def check_export(stored: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> list[str]:
    """The export has the checkpoint's names and tensors, bit for bit."""
    bad = (
        [f"export: names differ: {sorted(set(stored) ^ set(exported))[:4]}"]
        if set(stored) != set(exported)
        else []
    )
    bad += [
        f"export: {n} differs"
        for n in stored.keys() & exported.keys()
        if not torch.equal(stored[n], exported[n])
    ]
    return bad


def export_and_save(
    path: str, scratch: Path, stored: dict[str, torch.Tensor], layout: dict | None = None
) -> tuple[list[str], Path]:
    """megatron_train of ``path`` (``layout``; default TP 2 + SP): ``check_export`` of its HF export
    against ``stored``, then its HF checkpoint saved to ``scratch / "saved"`` (all ranks past the
    save on return). Returns (what is wrong, the saved folder)."""
    strategy = train_strategy(
        path, {"tensor_model_parallel_size": 2, "sequence_parallel": True} if layout is None else layout
    )
    bad = check_export(stored, full_hf_weights(strategy))
    out = scratch / "saved"
    strategy.save_hf_checkpoint(str(out))
    dist.barrier()
    return bad, out


def check_saved(stored: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> list[str]:
    """A saved checkpoint holds each of the checkpoint's tensors, bit for bit."""
    bad = [f"saved: {n} differs" for n, t in stored.items() if n in saved and not torch.equal(saved[n], t)]
    return bad + [f"saved: {n} missing" for n in stored if n not in saved]
