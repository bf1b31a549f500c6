"""LoRA on megatron_train (``roll.models.megatron.lora``) over two real ranks, against transformers.

A tiny untied Qwen2 (2 layers), adapters on every linear module (``all-linear``, rank 4, alpha 8),
fp32, lr 1e-2. For each layout -- TP1 (x DP2), TP2, TP2 + sequence parallelism, PP2:

(a) at start (B = 0) the LoRA model's log-probs equal the base model's, bit for bit;
(b) after two steps the merged HF weights (``export_hf_weights``: W + alpha/r B A on each TP shard,
    then the gather) give the LoRA forward's log-probs, loaded into a plain megatron_train model
    and into transformers (max |diff| < 1e-5 / 1e-4), and training moved them (> 1e-3);
(c) only the adapters require grad, are in DDP's buffers and change; every base weight is
    bit-identical after the steps; their count per rank is the memory planner's;
and across layouts: the first step's gradient norm agrees (TP / SP reductions of the adapters'
gradients are complete), as do the merged weights after two steps.

MoE (Qwen3-MoE, EP2 x DP2): ``all-linear`` adapts the attention only and the merged weights give
the LoRA forward; gate/up/down targets on a model without dense MLP layers are a ConfigError.
Dropout: in training the adapter's input is dropped (two calls differ), in eval it is not.
Checkpoints (TP2): a resume takes step 2 bit-identically; TP1 x DP2 and PP2 load the TP2 adapters
(the same merged weights); the checkpoint holds adapters only; another LoRA layout, or none, is one
CheckpointError naming ``common.pt`` and both layouts.

CPU: gloo with the test-only shims (``compat``, ``cuda_on_cpu``); ``test_lora_layouts_gpu`` runs
the layout checks over NCCL on 2 GPUs (or ``torchrun --nproc_per_node 2`` this file).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

import compat  # noqa: E402
from gloo_ranks import process_group, spawn_ranks  # noqa: E402
from two_rank_training import megatron_rank, pg_batch, pg_loss, run_two_ranks, save_tiny_qwen2  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.errors import CheckpointError  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402
from roll.models.logprobs import response_log_probs  # noqa: E402
from roll.models.megatron.hf_io import export_hf_weights, unwrap  # noqa: E402
from roll.models.megatron.lora import is_adapter  # noqa: E402
from roll.planner.model_shape import shape_from_config  # noqa: E402

LORA = {"lora_target": ["all-linear"], "lora_rank": 4, "lora_alpha": 8.0}
LAYOUTS = {
    "TP1": {"use_distributed_optimizer": True},
    "TP2": {"tensor_model_parallel_size": 2},
    "TP2+SP": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "PP2": {"pipeline_model_parallel_size": 2},
}
# Checkpoints reshard between layouts of the distributed optimizer (as megatron_train's own tests).
CKPT_TP2 = {"use_distributed_optimizer": True, "tensor_model_parallel_size": 2}
# fp32 bounds on CPU; on GPU (TF32 off) other kernels run for the merged and the LoRA forward, and
# reductions are not ordered, so the GPU bounds are those of test_megatron_gpu (1e-4).
CUDA = torch.cuda.is_available()
MERGED_MAX_DIFF = 1e-4 if CUDA else 1e-5  # merged weights in megatron vs the LoRA forward
HF_MAX_DIFF = 1e-4  # merged weights in transformers vs the LoRA forward
INIT_MAX_DIFF = 1e-6 if CUDA else 0.0  # the LoRA model at B = 0 vs the base model
ACROSS_LAYOUTS = 1e-4 if CUDA else 1e-6  # merged weights after two steps; grad norm (x10, relative)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _strategy(path: str, layout: dict, **model_args):
    from roll.distributed.strategy.registry import load_strategy_class

    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=path, dtype="fp32", **model_args),
        training_args=TrainingArgs(learning_rate=1e-2, max_grad_norm=1.0),
        strategy_args=StrategyArgs("megatron_train", dict(layout)),
        infer_batch_size=2,
    )
    rank = dist.get_rank()
    ctx = WorkerContext("actor_train", rank, dist.get_world_size(), rank, _device(), seed=7)
    strategy = load_strategy_class("megatron_train")(role, ctx)
    strategy.initialize()
    compat.seed(7)
    return strategy


def _step(strategy, batch: Batch) -> dict[str, float]:
    """One step on this DP rank's rows (one per micro-batch); the loss averaged over DP."""
    dp_rank, dp_size, _ = strategy.dp_layout()
    metrics = strategy.train_step(batch.chunk(dp_size)[dp_rank].split(1), pg_loss)
    loss = torch.tensor(metrics["loss"], dtype=torch.float64, device=_device())
    dist.all_reduce(loss)
    return {"loss": float(loss) / dist.get_world_size(), "grad_norm": metrics["grad_norm"]}


def _params(strategy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in unwrap(strategy.model[0]).named_parameters()}


def _merged(strategy) -> dict[str, torch.Tensor]:
    """The full merged HF tensors on every rank (each pipeline stage exports its own)."""
    chunks = [unwrap(c) for c in strategy.model]
    local = {n: t.detach().cpu().clone() for n, t in export_hf_weights(chunks, every_replica=True)}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {n: t for part in parts for n, t in part.items()}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _hf_log_probs(path: str, merged: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(merged, strict=True)
    with torch.no_grad():
        return response_log_probs(model.eval(), batch, 1.0)["log_probs"]


def layout_checks(name: str, path: str, results: dict) -> list[str]:
    """(a), (b), (c) in one layout; ``results[name]`` gets the first grad norm and merged weights."""
    bad: list[str] = []
    batch = pg_batch(0)
    tp = LAYOUTS[name].get("tensor_model_parallel_size", 1)
    pp = LAYOUTS[name].get("pipeline_model_parallel_size", 1)
    base = _strategy(path, LAYOUTS[name])
    base_logp = base.compute_log_probs(batch)["log_probs"]
    model = _strategy(path, LAYOUTS[name], **LORA)
    if _max_diff(model.compute_log_probs(batch)["log_probs"], base_logp) > INIT_MAX_DIFF:
        bad.append(f"{name}: at B = 0 the LoRA log-probs differ from the base model's")
    before = _params(model)
    trained = {n for n, p in unwrap(model.model[0]).named_parameters() if p.requires_grad}
    adapters = {n for n in before if is_adapter(n)}
    if trained != adapters or len(adapters) != 2 * 4 * 2 // pp:  # A, B x 4 modules x 2 layers
        bad.append(f"{name}: trainable {sorted(trained ^ adapters)[:4]}, {len(adapters)} adapters")
    shape = shape_from_config(json.loads(Path(path, "config.json").read_text()))
    planned = shape.megatron_lora_params(LORA["lora_target"], LORA["lora_rank"], tp) // pp
    if sum(before[n].numel() for n in adapters) != planned:
        bad.append(
            f"{name}: {sum(before[n].numel() for n in adapters)} adapter parameters, planner {planned}"
        )
    buffered = {id(p) for buffer in model.model[0].buffers for p in buffer.params}
    named = {id(p): n for n, p in unwrap(model.model[0]).named_parameters()}
    if {named[i] for i in buffered} != adapters:
        bad.append(f"{name}: DDP buffers hold {sorted(named[i] for i in buffered)[:4]}")
    first = _step(model, batch)
    _step(model, pg_batch(1))
    after = _params(model)
    bad += [
        f"{name}: frozen {n} changed"
        for n in before
        if n not in adapters and not torch.equal(before[n], after[n])
    ]
    bad += [f"{name}: adapter {n} did not move" for n in adapters if torch.equal(before[n], after[n])]
    lora_logp = model.compute_log_probs(batch)["log_probs"]
    merged = _merged(model)
    base.load_weights(iter(merged.items()))
    base.finish_model_update(1)
    diffs = {
        "megatron": _max_diff(base.compute_log_probs(batch)["log_probs"], lora_logp),
        "transformers": _max_diff(_hf_log_probs(path, merged, batch), lora_logp),
        "moved": _max_diff(lora_logp, base_logp),
    }
    if not diffs["megatron"] < MERGED_MAX_DIFF or not diffs["transformers"] < HF_MAX_DIFF:
        bad.append(f"{name}: merged weights vs the LoRA forward: {diffs}")
    if not diffs["moved"] > 1e-3:
        bad.append(f"{name}: training moved the log-probs by {diffs['moved']:.2e} only (vacuous)")
    results[name] = {"grad_norm": first["grad_norm"], "merged": merged, **diffs}
    return bad


def cross_layout_checks(results: dict) -> list[str]:
    bad = []
    ref = results["TP1"]
    for name in ("TP2", "TP2+SP", "PP2"):
        got = results[name]
        if abs(got["grad_norm"] - ref["grad_norm"]) > 10 * ACROSS_LAYOUTS * ref["grad_norm"]:
            bad.append(f"{name}: first grad norm {got['grad_norm']!r} vs TP1 {ref['grad_norm']!r}")
        worst = max(_max_diff(got["merged"][n], ref["merged"][n]) for n in ref["merged"])
        if not worst < ACROSS_LAYOUTS:
            bad.append(f"{name}: merged weights after two steps {worst:.2e} from TP1's")
    return bad


def dropout_checks(path: str) -> list[str]:
    """The adapter's input is dropped in training, not in eval (TP2: one column-, one row-parallel)."""
    model = _strategy(path, LAYOUTS["TP2"], lora_dropout=0.5, **LORA)
    attention = unwrap(model.model[0]).decoder.layers[0].self_attention
    bad = []
    for module in (attention.linear_qkv, attention.linear_proj):
        with torch.no_grad():
            module.lora_B.fill_(1.0)
        x = torch.randn(6, 1, module.lora_A.shape[1], device=_device())
        module.train()
        train = [module._lora_update(x) for _ in range(2)]
        module.eval()
        evals = [module._lora_update(x) for _ in range(2)]
        if torch.equal(train[0], train[1]) or not torch.equal(evals[0], evals[1]):
            bad.append(f"{type(module).__name__}: dropout in training / not in eval does not hold")
    return bad


def checkpoint_checks(path: str, scratch: str) -> list[str]:
    from megatron.core import dist_checkpointing

    bad: list[str] = []
    ckpt = str(Path(scratch, "lora_ckpt"))
    first = _strategy(path, CKPT_TP2, **LORA)
    _step(first, pg_batch(0))
    saved = _merged(first)
    first.save_checkpoint(ckpt)
    loss2 = _step(first, pg_batch(1))["loss"]
    ref = _params(first)
    resumed = _strategy(path, CKPT_TP2, **LORA)
    resumed.load_checkpoint(ckpt)
    if _step(resumed, pg_batch(1))["loss"] != loss2 or resumed.step_count != 2:
        bad.append("resumed step 2 differs from the uninterrupted run (loss or step count)")
    now = _params(resumed)
    bad += [f"resumed step 2: {n}" for n in ref if not torch.equal(ref[n], now[n])]
    for name, layout in (
        ("TP1 x DP2", LAYOUTS["TP1"]),
        ("PP2", {**CKPT_TP2, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}),
    ):
        other = _strategy(path, layout, **LORA)
        other.load_checkpoint(ckpt)
        loaded = _merged(other)
        worst = max(_max_diff(t, saved[n]) for n, t in loaded.items())
        if loaded.keys() != saved.keys() or not worst < 1e-6:
            bad.append(f"{name} loaded the TP2 adapters {worst:.2e} away from the saved merged weights")
    keys = dist_checkpointing.load_tensors_metadata(os.path.join(ckpt, "megatron"))
    if not keys or not all("lora_" in k for k in keys):
        bad.append(f"checkpoint tensors that are no adapter: {[k for k in keys if 'lora_' not in k][:4]}")
    for model_args, words in (
        (
            {"lora_target": ["q_proj"], "lora_rank": 4},
            "but actor_train.model_args asks for rank 4 on 2 modules",
        ),
        ({}, "asks for off (every weight trained)"),
    ):
        try:
            _strategy(path, CKPT_TP2, **model_args).load_checkpoint(ckpt)
            bad.append(f"{model_args}: loaded a checkpoint of another LoRA layout")
        except CheckpointError as err:
            if "common.pt: saved with LoRA rank 4 on 8 modules" not in str(err) or words not in str(err):
                bad.append(f"{model_args}: {err}")
    return bad


def moe_checks(path: str) -> list[str]:
    """Qwen3-MoE at EP2 x DP2: ``all-linear`` adapts the attention only (expert MLPs carry none);
    after a step the merged weights give the LoRA forward; MLP targets alone are a ConfigError."""
    from roll.configs.errors import ConfigError

    bad: list[str] = []
    batch = pg_batch(0)
    layout = {"use_distributed_optimizer": True, "expert_model_parallel_size": 2}
    base = _strategy(path, layout)
    model = _strategy(path, layout, **LORA)
    adapted = {n.rsplit(".", 1)[0] for n, _ in unwrap(model.model[0]).named_parameters() if is_adapter(n)}
    expected = {
        f"decoder.layers.{i}.self_attention.{m}" for i in (0, 1) for m in ("linear_qkv", "linear_proj")
    }
    if adapted != expected:
        bad.append(f"MoE: adapted {sorted(adapted)}")
    _step(model, batch)
    lora_logp = model.compute_log_probs(batch)["log_probs"]
    base.load_weights(iter(_merged(model).items()))
    base.finish_model_update(1)
    diff = _max_diff(base.compute_log_probs(batch)["log_probs"], lora_logp)
    if not diff < MERGED_MAX_DIFF:
        bad.append(f"MoE: merged weights vs the LoRA forward {diff:.2e}")
    try:
        _strategy(path, layout, lora_target=["gate_proj"], lora_rank=4)
        bad.append("MoE: gate_proj on a model without dense MLPs was accepted")
    except ConfigError as err:
        if "every layer of this model is MoE" not in str(err):
            bad.append(f"MoE: gate_proj: {err}")
    return bad


def run_layouts(path: str) -> list[str]:
    results: dict = {}
    bad = []
    for name in LAYOUTS:
        bad += layout_checks(name, path, results)
    return bad + cross_layout_checks(results) + dropout_checks(path)


def _worker(rank: int, world_size: int, port: int, which: str, path: str, scratch: str) -> None:
    with megatron_rank(rank, world_size, port, scratch, timeout=datetime.timedelta(seconds=120)) as bad:
        checks = {"layouts": run_layouts, "moe": moe_checks}
        bad += checks[which](path) if which in checks else checkpoint_checks(path, scratch)


def test_lora_layouts_cpu(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "model", layers=2)
    bad = run_two_ranks(_worker, ("layouts", path, str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)


def test_lora_checkpoint_cpu(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "model", layers=2)
    bad = run_two_ranks(_worker, ("checkpoint", path, str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)


def test_lora_moe_cpu(tmp_path: Path) -> None:
    from tiny_models import build_tiny_tokenizer

    from roll.models.random_checkpoint import write_random_checkpoint

    build_tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    path = write_random_checkpoint(
        "tiny-qwen3-moe", tmp_path / "model", tokenizer_dir=tmp_path / "tokenizer", dtype=torch.float32
    )
    bad = run_two_ranks(_worker, ("moe", str(path), str(tmp_path)), tmp_path)
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------ GPU (NCCL)
def _gpu_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    with process_group(rank, world, port, init=False):
        _init_nccl(rank, world)
        bad = run_layouts(path)
        Path(out, f"rank{rank}.txt").write_text("\n".join(bad))


def _init_nccl(rank: int, world: int) -> None:
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    compat.apply()


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_lora_layouts_gpu(tmp_path: Path) -> None:
    path = save_tiny_qwen2(tmp_path / "model", layers=2)
    spawn_ranks(_gpu_worker, 2, path, str(tmp_path))
    bad = [line for r in (0, 1) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()]
    assert not bad, "\n".join(bad)


if __name__ == "__main__":  # torchrun --nproc_per_node 2 tests/megatron/test_megatron_lora.py
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init_nccl(rank, world)
    model_dir = Path(os.environ.get("SCRATCH", "/tmp/megatron_lora_gpu"), "model")
    if rank == 0:
        save_tiny_qwen2(model_dir, layers=2)
    dist.barrier()
    failures = run_layouts(str(model_dir))
    print(f"rank {rank}: " + ("\n".join(failures) if failures else "ALL CHECKS PASSED"))
    dist.destroy_process_group()
