"""What the Megatron vision-language GPU tests share: megatron's log-probs of a saved batch on one
CUDA device (megatron_infer) or on two (any strategy / layout cases, NCCL), the bounds against
transformers on the same device (fp32 with TF32 off: max |diff| < 1e-4; bf16: mean |diff| < 2e-2 over
the response tokens, the text models' GPU bound), and the check of a train step's metrics.

>>> bad = one_device_mismatches(model, batch, tmp_path)            # megatron_infer fp32 / bf16
>>> spawn_ranks(two_device_worker, 2, str(model), "batch.pt", CASES, train_step)
>>> bad = log_prob_mismatches(model, batch, tmp_path, {c: f"two_{c}_{{dtype}}.pt" for c in CASES})
>>> bad += train_step_mismatches(torch.load(tmp_path / "two_train_cp2.pt"), ("tower_grad",))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from gloo_ranks import process_group, spawn_ranks
from vl_cases import hf_log_probs

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs
from roll.core.batch import Batch
from roll.core.worker_context import WorkerContext

# transformers' response log-probs of a batch: (model, batch, dtype, device) -> [B, R] on CPU
Reference = Callable[[Path, Batch, torch.dtype, str], torch.Tensor]

FP32_MAX_DIFF = 1e-4
BF16_MEAN_DIFF = 2e-2


def tf32_off() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def strategy(path: str, dtype: str, name: str, layout: dict, rank: int, world_size: int, **model_args):
    """The initialized strategy ``name`` (``layout``: its strategy_config; ``model_args``: more
    ``ModelArgs`` fields) of rank ``rank`` on CUDA device ``rank``."""
    from roll.distributed.strategy.registry import load_strategy_class

    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=path, dtype=dtype, **model_args),
        training_args=TrainingArgs(learning_rate=1e-5, max_grad_norm=1.0),
        strategy_args=StrategyArgs(name, dict(layout)),
        infer_batch_size=2,
    )
    ctx = WorkerContext("actor", rank, world_size, rank, torch.device("cuda", rank), seed=7)
    built = load_strategy_class(name)(role, ctx)
    built.initialize()
    return built


def _megatron_log_probs(path: str, dtype: str) -> torch.Tensor:
    from roll.distributed.strategy.registry import load_strategy_class

    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=path, dtype=dtype),
        strategy_args=StrategyArgs("megatron_infer", {}),
        infer_batch_size=2,
    )
    ctx = WorkerContext("reference", 0, 1, 0, torch.device("cuda", 0), seed=7)
    built = load_strategy_class("megatron_infer")(role, ctx)
    built.initialize()
    return built.compute_log_probs(torch.load(Path(path).parent / "batch.pt", weights_only=False))[
        "log_probs"
    ]


def one_device_worker(rank: int, world_size: int, port: int, path: str) -> None:
    """megatron_infer's log-probs of ``batch.pt`` beside the model, fp32 and bf16, saved as
    ``megatron_{dtype}.pt`` there."""
    warnings.filterwarnings("ignore")
    torch.cuda.set_device(0)
    tf32_off()
    with process_group(rank, world_size, port, backend="nccl"):
        for dtype in ("fp32", "bf16"):
            got = _megatron_log_probs(path, dtype)
            torch.save(got, Path(path).parent / f"megatron_{dtype}.pt")
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        dist.barrier()


def one_device_mismatches(
    model: Path, batch: Batch, scratch: Path, reference: Reference = hf_log_probs
) -> list[str]:
    """Saves ``batch`` beside ``model`` (``scratch``), scores it on megatron_infer on one device and
    returns where it is off transformers' bounds (``reference``: see ``log_prob_mismatches``)."""
    torch.save(batch, scratch / "batch.pt")
    spawn_ranks(one_device_worker, 1, str(model))
    return log_prob_mismatches(model, batch, scratch, {"": "megatron_{dtype}.pt"}, reference)


def two_device_worker(
    rank: int,
    world_size: int,
    port: int,
    path: str,
    batch_file: str,
    cases: dict[str, tuple[str, dict]],
    train_step: Callable[[str, int, int], dict],
) -> None:
    """Each case's (name -> (strategy, strategy_config)) log-probs of ``batch_file`` beside the model,
    fp32 and bf16, saved by rank 0 as ``two_{case}_{dtype}.pt``; then ``train_step``'s metrics as
    ``two_train_cp2.pt``."""
    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    tf32_off()
    batch = torch.load(Path(path).parent / batch_file, weights_only=False)
    with process_group(rank, world_size, port, backend="nccl"):
        for dtype in ("fp32", "bf16"):
            for case, (name, layout) in cases.items():
                got = strategy(path, dtype, name, layout, rank, world_size).compute_log_probs(batch)
                if rank == 0:
                    torch.save(got["log_probs"], Path(path).parent / f"two_{case}_{dtype}.pt")
                ps.destroy_model_parallel()
                dist.barrier()
        metrics = train_step(path, rank, world_size)
        if rank == 0:
            torch.save(metrics, Path(path).parent / "two_train_cp2.pt")
        dist.barrier()


def log_prob_mismatches(
    model: Path, batch: Batch, scratch: Path, files: dict[str, str], reference: Reference = hf_log_probs
) -> list[str]:
    """Each ``files`` entry (label -> file name under ``scratch`` with ``{dtype}``) against
    transformers' log-probs on CUDA (``reference(model, batch, dtype, "cuda")``, by default
    ``vl_cases.hf_log_probs``): fp32 max |diff| and bf16 mean |diff| over the response tokens."""
    mask = batch["response_mask"].bool()
    bad = []
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        want = reference(model, batch, torch_dtype, "cuda")
        for label, pattern in files.items():
            diff = (torch.load(scratch / pattern.format(dtype=dtype)) - want).abs()[mask]
            tag = f"{label} {dtype}" if label else dtype
            print(f"{tag}: max |diff| {float(diff.max()):.3e}, mean {float(diff.mean()):.3e}")
            if dtype == "fp32" and float(diff.max()) > FP32_MAX_DIFF:
                bad.append(f"{tag} max |diff| {float(diff.max()):.3e} > {FP32_MAX_DIFF}")
            if dtype == "bf16" and float(diff.mean()) > BF16_MEAN_DIFF:
                bad.append(f"{tag} mean |diff| {float(diff.mean()):.3e} > {BF16_MEAN_DIFF}")
    return bad


def train_step_mismatches(metrics: dict, grads: tuple[str, ...]) -> list[str]:
    """A train step at CP 2 has a finite loss, a gradient norm above 0 and each ``grads`` sum above 0."""
    print(f"train step at CP 2 (bf16): {metrics}")
    if not (
        torch.isfinite(torch.tensor(metrics["loss"]))
        and metrics["grad_norm"] > 0
        and all(metrics[g] > 0 for g in grads)
    ):
        return [f"train step at CP 2: {metrics}"]
    return []
