"""Context parallelism of the Gated DeltaNet layers (``gdn_context_parallel``) equals CP=1: fp32,
CPU, two gloo ranks (gloo has ``all_to_all_single``).

- the layer alone (megatron-core's module with roll's forward, built by hand at TP1): CP=2 on each
  rank's zig-zag share against CP=1 on the whole input, for padded rows (two rows, each cut in
  ``2 x CP`` chunks as megatron's ``bshd`` CP does) and a packed row (``cu_seqlens``, chunks per
  sequence): the outputs, the input gradients and the parameter gradients summed over the ranks;
- megatron_train on a tiny Qwen3-Next (two value heads per key head, MoE): CP=2 (packed rows: roll
  runs CP on packed rows only) against CP=1 on packed and on padded rows (DP=2, both ranks given
  the same rows): log-probs, and one step's reduced gradients;
- megatron_train on a tiny Qwen3.5 with images: CP=2 log-probs equal transformers', and one step's
  reduced gradients equal padded rows' at DP=2 (``vl_packed_checks``).
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

import compat  # noqa: E402
from test_packing_cpu import capture_grads, compare, loss_fn, ragged_batch  # noqa: E402
from test_qwen3_next_cpu import save_qwen3_next  # noqa: E402
from tiny_qwen3_5 import build_tiny_qwen3_5_dir  # noqa: E402
from two_rank_training import megatron_rank, pg_loss, run_two_ranks, train_strategy  # noqa: E402
from vl_cases import save_case  # noqa: E402

from roll.models.context_parallel import zigzag_indices  # noqa: E402

TOL = dict(atol=2e-5, rtol=2e-4)


# ------------------------------------------------------------------------------------ the layer
def _layer(tp_group, cp_group):
    """roll's Gated DeltaNet (2 key / 4 value heads of 8 / 12, hidden 32) with random weights,
    the same on every rank."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    from roll.models.megatron.gated_delta_net import linear_attention_layer

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    spec = linear_attention_layer(ModuleSpec(module=None, submodules=TransformerLayerSubmodules()))
    compat.seed(0)  # megatron's init forks the model-parallel RNG
    pgs = ProcessGroupCollection(tp=tp_group, cp=cp_group)
    layer = build_module(spec.submodules.self_attention, config=config, layer_number=1, pg_collection=pgs)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.normal_(1.0 if name.endswith("out_norm.weight") else 0.0, 0.3)
    return layer


def _run(layer, x: torch.Tensor, cu_seqlens: torch.Tensor | None, weights: torch.Tensor):
    """(output, input grad, parameter grads) of ``sum(layer(x) * weights)``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    params = None
    if cu_seqlens is not None:
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    out, _ = layer(x, None, packed_seq_params=params)
    (out * weights).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def check_layer() -> list[str]:
    rank, world = dist.get_rank(), dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(2)]
    layer = _layer(singles[rank], world)
    whole = _layer(singles[rank], singles[rank])
    whole.load_state_dict(layer.state_dict())
    gen = torch.Generator().manual_seed(1)
    bad = []
    for name, total, rows, cu in (
        ("padded", 24, 2, None),
        ("packed", 44, 1, torch.tensor([0, 8, 12, 40, 44], dtype=torch.int32)),
    ):
        x = torch.randn(total, rows, 32, generator=gen)
        weights = torch.randn(total, rows, 32, generator=gen)
        ref_out, ref_dx, ref_grads = _run(whole, x, cu, weights)
        local = zigzag_indices(cu if cu is not None else torch.tensor([0, total]), 2, rank)
        out, dx, grads = _run(layer, x[local], cu, weights[local])
        if not torch.allclose(out, ref_out[local], **TOL):
            bad.append(f"{name} CP2 layer output differs by {float((out - ref_out[local]).abs().max()):.3g}")
        if not torch.allclose(dx, ref_dx[local], **TOL):
            bad.append(
                f"{name} CP2 layer input grad differs by {float((dx - ref_dx[local]).abs().max()):.3g}"
            )
        for grad in grads.values():
            dist.all_reduce(grad)
        bad += compare(f"{name} CP2 layer parameter grad", ref_grads, grads)
    return bad


def _layer_worker(rank: int, world_size: int, port: int, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        bad += check_layer()


def test_gated_delta_net_layer_cp2_matches_cp1(tmp_path: Path) -> None:
    bad = run_two_ranks(_layer_worker, (str(tmp_path),), tmp_path)
    assert not bad, "CP=2 differs from CP=1:\n" + "\n".join(bad)


# ------------------------------------------------------------------------------ megatron_train
def _logp_and_grads(strategy, batch, packed: bool, loss) -> tuple[torch.Tensor, dict]:
    """(log-probs, one step's reduced gradients of ``loss`` over two-row micro-batches)."""
    strategy.config.sequence_packing = packed
    logp = strategy.compute_log_probs(batch)["log_probs"]
    box = capture_grads(strategy)
    strategy.train_step(batch.split(2), loss)
    return logp, box["grads"]


def _differences(name: str, want: tuple, got: tuple) -> list[str]:
    diff = float((want[0] - got[0]).abs().max())
    bad = [f"{name}: log-probs differ by {diff:.3g}"] if not torch.allclose(want[0], got[0], **TOL) else []
    return bad + compare(f"{name}: gradient", want[1], got[1])


def check_qwen3_next(path: str) -> list[str]:
    """CP=2 (packed) against CP=1 (DP=2) on packed and on padded rows."""
    batch, loss = ragged_batch(3), loss_fn("token-mean")
    one = train_strategy(path, {})
    padded, packed = (_logp_and_grads(one, batch, p, loss) for p in (False, True))
    cp2 = _logp_and_grads(train_strategy(path, {"context_parallel_size": 2}), batch, True, loss)
    silent = [n for n, g in cp2[1].items() if "self_attention" in n and not float(g.abs().sum()) > 0]
    bad = [f"qwen3_next CP2: no gradient for {silent[:3]}"] if silent else []
    return (
        bad
        + _differences("qwen3_next CP2 vs CP1 padded", padded, cp2)
        + _differences("qwen3_next CP2 vs CP1 packed", packed, cp2)
    )


def check_qwen3_5(path: str, scratch: Path) -> list[str]:
    """Image rows and a text row: CP=2 log-probs equal transformers', its gradients padded DP=2's."""
    batch, want = torch.load(scratch / "batch.pt", weights_only=False), torch.load(scratch / "want.pt")
    padded = _logp_and_grads(train_strategy(path, {}), batch, False, pg_loss)
    cp2 = _logp_and_grads(train_strategy(path, {"context_parallel_size": 2}), batch, True, pg_loss)
    diff = float((cp2[0] - want).abs().max())
    bad = [f"qwen3_5 CP2: log-probs differ from transformers' by {diff:.2e}"] if diff > 1e-4 else []
    return bad + _differences("qwen3_5 CP2 vs CP1 padded", padded, cp2)


def _strategy_worker(
    rank: int, world_size: int, port: int, next_path: str, vl_path: str, scratch: str
) -> None:
    with megatron_rank(rank, world_size, port, scratch) as bad:
        bad += check_qwen3_next(next_path)
        dist.barrier()
        bad += check_qwen3_5(vl_path, Path(scratch))


def test_gated_delta_net_models_cp2_match_cp1(tmp_path: Path) -> None:
    next_path = save_qwen3_next(tmp_path / "qwen3_next")
    vl_path = build_tiny_qwen3_5_dir(tmp_path / "qwen3_5", moe=False)
    save_case(vl_path, tmp_path)
    bad = run_two_ranks(_strategy_worker, (str(next_path), str(vl_path), str(tmp_path)), tmp_path)
    assert not bad, "CP=2 differs from CP=1:\n" + "\n".join(bad)
