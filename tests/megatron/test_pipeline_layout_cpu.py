"""``pipeline_model_parallel_layout`` (Megatron's layout string) on megatron_train / megatron_infer.

Two ranks (gloo, fp32, the CPU shims), a tiny untied 4-layer Qwen2. The reference is PP=1 (DP=2);
each layout runs at PP=2 (DP=1) on the same two ranks:

- ``E|tt|tt|L``: VPP 2 derived from the layout, an embedding-only first stage and a loss-only last;
- ``Ettt||t|L``: VPP 2 with three layers on one chunk and an empty middle stage;
- ``Et|tttL``: uneven, VPP 1.

For each: the HF weights come back bit for bit from the megatron chunks (load, then export through
the converter's tables), ``compute_log_probs`` equals the reference's, and one train step
(four one-row micro-batches, what the interleaved schedule needs) gives the reference's loss and
weights to rounding. megatron_infer at ``Et|tttL`` draws the reference's greedy tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

from two_rank_training import (  # noqa: E402
    full_hf_weights,
    megatron_rank,
    pg_batch,
    pg_loss,
    run_two_ranks,
    save_tiny_qwen2,
    train_strategy,
)

from roll.configs.pipeline_layout import PipelineLayout  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.models.megatron.hf_io import unwrap  # noqa: E402

BASE = {"sequence_packing": False}
PP1 = dict(BASE)
LAYOUTS = {
    "E|tt|tt|L": 2,  # layout -> the virtual pipeline size the strategy must build
    "Ettt||t|L": 2,
    "Et|tttL": None,
}


def _layout(text: str) -> dict:
    return {**BASE, "pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": text}


def _step(strategy, batch: Batch) -> float:
    """One optimizer step on this DP rank's rows, one row per micro-batch; the loss over all DP."""
    dp_rank, dp_size, _ = strategy.dp_layout()
    mine = batch.chunk(dp_size)[dp_rank]
    loss = torch.tensor(
        strategy.train_step(mine.split(1), pg_loss)["loss"], dtype=torch.float64, device=strategy.ctx.device
    )
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _run(path: str, layout: dict, batch: Batch, device: str) -> dict:
    strategy = train_strategy(path, layout, device=device)
    mine = [len(unwrap(chunk).decoder.layers) for chunk in strategy.model]
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    out = {
        "layers": per_rank,
        "chunks": len(strategy.model),
        "vpp": strategy.config.virtual_pipeline_model_parallel_size,
        "loaded": full_hf_weights(strategy),
        "log_probs": strategy.compute_log_probs(batch)["log_probs"].cpu(),
    }
    out["loss"] = _step(strategy, batch)
    out["trained"] = full_hf_weights(strategy)
    return out


def _greedy(path: str, layout: dict, batch: Batch, device: str) -> torch.Tensor:
    infer = train_strategy(path, layout, strategy="megatron_infer", device=device)
    prompts = batch.select(["prompts", "prompt_mask"])
    sampling = SamplingParams(n=1, max_new_tokens=6, temperature=0.0)
    return infer.generate(prompts, sampling)["responses"].cpu()


def check(path: str, device: str = "cpu") -> list[str]:
    """Every layout of ``LAYOUTS`` against PP=1 on this rank (CPU, or CUDA device ``rank``)."""
    bad: list[str] = []
    original = safetensors.torch.load_file(str(Path(path) / "model.safetensors"))
    batch = pg_batch(5, rows=4)
    ref = _run(path, PP1, batch, device)
    for text, vpp in LAYOUTS.items():
        got = _run(path, _layout(text), batch, device)
        if got["vpp"] != vpp or got["chunks"] != (vpp or 1):
            bad.append(f"{text}: VPP {got['vpp']} with {got['chunks']} chunks, want {vpp}")
        want_layers = PipelineLayout.parse(text).rank_layers(2)
        if got["layers"] != want_layers:
            bad.append(f"{text}: decoder layers per rank and chunk {got['layers']}, want {want_layers}")
        differ = [n for n in original if not torch.equal(got["loaded"].get(n, torch.empty(0)), original[n])]
        if differ or got["loaded"].keys() != original.keys():
            bad.append(
                f"{text}: HF weights do not round-trip: {differ or sorted(got['loaded'].keys() ^ original.keys())}"
            )
        diff = float((got["log_probs"] - ref["log_probs"]).abs().max())
        if diff > 1e-5:
            bad.append(f"{text}: log-probs differ from PP=1 by {diff:.2e}")
        if abs(got["loss"] - ref["loss"]) > 1e-5:
            bad.append(f"{text}: loss {got['loss']} != PP=1's {ref['loss']}")
        moved, diff = _max_diff(ref["trained"], ref["loaded"]), _max_diff(got["trained"], ref["trained"])
        if not diff < 1e-2 * moved:
            bad.append(
                f"{text}: weights after the step differ from PP=1's by {diff:.2e} (the step moved {moved:.2e})"
            )
        dist.barrier()
    want = _greedy(path, PP1, batch, device)
    got = _greedy(path, _layout("Et|tttL"), batch, device)
    if not torch.equal(got, want):
        bad.append(f"megatron_infer Et|tttL greedy tokens {got.tolist()} != PP=1's {want.tolist()}")
    return bad


def _worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        bad += check(path)


def test_layouts_match_pp1(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "model", layers=4)
    bad = run_two_ranks(_worker, (path, str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)
