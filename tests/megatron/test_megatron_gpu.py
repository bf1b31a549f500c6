"""megatron_train / megatron_infer end to end over real process groups, against transformers.

One run over 2 ranks goes through these layouts (each re-creates megatron's parallel groups):

========  =====================================================================================
layout    checks
========  =====================================================================================
TP2       log-probs == HF (fp32 max |diff| < 1e-4; bf16 mean |diff| < 2e-2 on GPU); one train step's
          loss and grad norm == HF autograd's; a second step after save -> offload -> reload
PP2       same, and a resume from TP2's checkpoint: its next step equals TP2's second step
TP2+SP    same (sequence-parallel norms, our TorchNorm)
VPP2      PP2 x 2 virtual stages (4 layers)
EP2       Qwen3-MoE, 2 expert-parallel ranks (DP=2: each rank trains on half the rows)
infer     megatron_infer: greedy KV-cached generation == HF greedy (TP2, PP2); infer_logprobs ==
          compute_log_probs; load_weights(another checkpoint) == that checkpoint's log-probs
========  =====================================================================================

On CPU the same run goes over gloo with test-only patches (``compat``, ``cuda_on_cpu``) and fp32
only; on a machine with 2 GPUs over NCCL (fp32 with TF32 off, plus bf16). Run on GPUs directly with

    torchrun --nproc_per_node 2 tests/megatron/test_megatron_gpu.py [out.json]

which prints the table of numbers and writes them as JSON.
"""

from __future__ import annotations

import gc
import json
import math
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
from cuda_on_cpu import cuda_hidden, cuda_on_cpu  # noqa: E402
from gloo_ranks import process_group, spawn_ranks  # noqa: E402
from tiny_models import build_tiny_tokenizer  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402
from roll.models.logprobs import response_log_probs  # noqa: E402

FP32_MAX_DIFF = 1e-4
BF16_MEAN_DIFF = 2e-2
TRAIN_RTOL = 1e-4


# ------------------------------------------------------------------------------------- models
def _dense_config(small: bool) -> transformers.PretrainedConfig:
    hidden, heads = (256, 8) if small else (32, 4)
    return transformers.Qwen2Config(
        vocab_size=1000 if small else 272,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
    )


def _moe_config(small: bool) -> transformers.PretrainedConfig:
    return transformers.Qwen3MoeConfig(
        vocab_size=1000 if small else 272,
        hidden_size=128 if small else 32,
        intermediate_size=128,
        moe_intermediate_size=64 if small else 16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32 if small else 8,
        num_experts=8 if small else 4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
    )


def _save_model(config, path: Path, seed: int, std: float = 0.1) -> str:
    """Random weights N(0, std) (norms 1 + N(0, std)). std 0.1 gives peaked distributions that make
    the fp32 checks sharp; bf16 is checked on std 0.02 (HF's own init scale), where bf16 rounding
    of the logits stays at realistic levels (with std 0.1 even HF's bf16 differs from its fp32 by
    ~3e-2 mean)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, std)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def make_checkpoints(root: Path, small: bool) -> dict[str, str]:
    return {
        "dense": _save_model(_dense_config(small), root / "dense", 0),
        "dense_b": _save_model(_dense_config(small), root / "dense_b", 1),
        "moe": _save_model(_moe_config(small), root / "moe", 2),
        "dense_bf16": _save_model(_dense_config(small), root / "dense_bf16", 3, std=0.02),
        "moe_bf16": _save_model(_moe_config(small), root / "moe_bf16", 4, std=0.02),
    }


# -------------------------------------------------------------------------------------- data
def make_batch(rows: int = 4, temperature: float = 1.0) -> Batch:
    """Left-padded prompts and right-padded responses of different lengths (tokens < 259)."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.zeros(rows, 12, dtype=torch.long)
    mask = torch.zeros(rows, 12, dtype=torch.long)
    responses = []
    for i in range(rows):
        length = 12 - 3 * (i % 3)
        prompts[i, 12 - length :] = torch.randint(3, 259, (length,), generator=gen)
        mask[i, 12 - length :] = 1
        responses.append(torch.randint(3, 259, (10 - 2 * (i % 4),), generator=gen).tolist())
    batch = Batch.from_dict({"prompts": prompts, "prompt_mask": mask})
    out = build_generation_batch(batch, responses, None, 1, 0, 10, temperature=temperature)
    out.tensors["advantages"] = torch.randn(rows, 10, generator=gen)
    return out


def loss_fn(outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient loss with an entropy bonus (exercises both outputs' gradients)."""
    mask = batch["response_mask"].float()
    pg = -(outputs["log_probs"] * batch["advantages"] * mask).sum() / mask.sum()
    entropy = (outputs["entropy"] * mask).sum() / mask.sum()
    return pg - 0.01 * entropy, {"entropy": float(entropy)}


def hf_reference(path: str, batch: Batch, micro_batches: int, device) -> dict[str, float]:
    """HF fp32: log-probs, and loss / grad norm of one step over ``micro_batches`` micro-batches."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    batch = batch.to(device)
    losses = []
    for micro in batch.split(math.ceil(len(batch) / micro_batches)):
        loss, _ = loss_fn(response_log_probs(model, micro, 1.0), micro)
        (loss / micro_batches).backward()
        losses.append(float(loss))
    grad_norm = math.sqrt(
        sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    )
    with torch.no_grad():
        out = response_log_probs(model, batch, batch.meta.get("temperature", 1.0))
    return {"loss": sum(losses) / len(losses), "grad_norm": grad_norm, "log_probs": out["log_probs"].cpu()}


# ---------------------------------------------------------------------------------- strategies
def _role(path: str, layout: dict, dtype: str, name: str) -> RoleConfig:
    return RoleConfig(
        model_args=ModelArgs(model_name_or_path=path, dtype=dtype),
        training_args=TrainingArgs(learning_rate=1e-3, max_grad_norm=1.0),
        strategy_args=StrategyArgs(name, dict(layout)),
        infer_batch_size=2,
    )


def _strategy(name: str, path: str, layout: dict, dtype: str = "fp32"):
    from roll.distributed.strategy.registry import load_strategy_class

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    ctx = WorkerContext("actor", dist.get_rank(), dist.get_world_size(), dist.get_rank(), device, seed=7)
    strategy = load_strategy_class(name)(_role(path, layout, dtype, name), ctx)
    strategy.initialize()
    if device.type == "cpu":
        compat.seed(7)
    return strategy


def _free(strategy) -> None:
    del strategy
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _my_rows(batch: Batch, strategy) -> Batch:
    dp_rank, dp_size, _ = strategy.dp_layout()
    return batch.chunk(dp_size)[dp_rank]


def _mean_over_dp(value: float, strategy) -> float:
    from megatron.core import parallel_state as ps

    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t) / ps.get_data_parallel_world_size()


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


# ------------------------------------------------------------------------------------- the run
LAYOUTS = {
    "TP2": ("dense", {"tensor_model_parallel_size": 2}),
    "PP2": ("dense", {"pipeline_model_parallel_size": 2}),
    "TP2+SP": ("dense", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "VPP2": ("dense", {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "EP2": ("moe", {"expert_model_parallel_size": 2, "moe_grouped_gemm": True}),
}


def run_layout(name: str, ckpts: dict[str, str], scratch: Path, results: dict) -> None:
    print(f"[rank {dist.get_rank()}] layout {name}", file=sys.stderr, flush=True)
    family, layout = LAYOUTS[name]
    path = ckpts[family]
    batch = make_batch()
    strategy = _strategy("megatron_train", path, layout)
    dp_size = strategy.dp_layout()[1]
    ref = hf_reference(path, batch, micro_batches=2 * dp_size, device=_device())
    row = results.setdefault(name, {})
    logp = strategy.compute_log_probs(_my_rows(batch, strategy))["log_probs"]
    row["fp32_max_diff"] = float(
        (logp - _my_rows(Batch.from_dict({"x": ref["log_probs"]}), strategy)["x"]).abs().max()
    )
    mine = _my_rows(batch, strategy)
    metrics = strategy.train_step(mine.split(math.ceil(len(mine) / 2)), loss_fn)
    row.update(loss=_mean_over_dp(metrics["loss"], strategy), hf_loss=ref["loss"])
    row.update(grad_norm=metrics["grad_norm"], hf_grad_norm=ref["grad_norm"])
    if name == "TP2":
        _checkpoint_then_step(strategy, batch, scratch, row)
    if name == "PP2":
        strategy.load_checkpoint(str(scratch / "ckpt_tp2"))
        second = strategy.train_step(batch.split(2), loss_fn)
        row.update(resumed_loss=second["loss"], resumed_grad_norm=second["grad_norm"])
    _free(strategy)
    if torch.cuda.is_available():
        _check_bf16(ckpts[f"{family}_bf16"], layout, batch, row)


def _check_bf16(path: str, layout: dict, batch: Batch, row: dict) -> None:
    """megatron_infer in bf16 against HF fp32 (and, for scale, HF bf16 against HF fp32)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(_device())
    with torch.no_grad():
        expected = response_log_probs(hf, batch.to(_device()), 1.0)["log_probs"].cpu()
        hf_bf16 = response_log_probs(hf.to(torch.bfloat16), batch.to(_device()), 1.0)["log_probs"].cpu()
    del hf
    mask = batch["response_mask"].bool()
    row["hf_bf16_mean_diff"] = float((hf_bf16 - expected).abs()[mask].mean())
    infer = _strategy("megatron_infer", path, layout, dtype="bf16")
    mine = _my_rows(batch, infer)
    logp = infer.compute_log_probs(mine)["log_probs"]
    expected = _my_rows(Batch.from_dict({"x": expected}), infer)["x"]
    row["bf16_mean_diff"] = float((logp - expected).abs()[mine["response_mask"].bool()].mean())
    _free(infer)


def _checkpoint_then_step(strategy, batch: Batch, scratch: Path, row: dict) -> None:
    """Save after step 1, offload everything (measure), reload, then step 2 (the PP2 resume target)."""
    strategy.save_checkpoint(str(scratch / "ckpt_tp2"))
    strategy.config.offload_params = True
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        row["state_mib"] = _state_bytes(strategy) / 2**20
        strategy.offload_states()
        row["offload_freed_mib"] = (before - torch.cuda.memory_allocated()) / 2**20
        row["resident_after_offload_mib"] = torch.cuda.memory_allocated() / 2**20
    else:
        strategy.offload_states()  # same storage-freeing code path on CPU
    strategy.reload_states()
    second = strategy.train_step(batch.split(2), loss_fn)
    row.update(second_loss=second["loss"], second_grad_norm=second["grad_norm"])


def _state_bytes(strategy) -> int:
    """Bytes of params + grad buffers + optimizer tensors the offloader manages."""
    off = strategy.offloader
    tensors = off._param_tensors() + off._grad_tensors() + off._optimizer_tensors()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def run_infer(ckpts: dict[str, str], results: dict) -> None:
    """Greedy generation == HF greedy; infer_logprobs == compute_log_probs; load_weights."""
    device = _device()
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpts["dense"], dtype=torch.float32).to(device)
    prompts = make_batch(rows=3).select(["prompts", "prompt_mask"])
    expected = hf.generate(
        input_ids=prompts["prompts"].to(device),
        attention_mask=prompts["prompt_mask"].to(device),
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=1,
    )[:, 12:].cpu()
    other = hf_reference(ckpts["dense_b"], make_batch(), 1, device)["log_probs"]
    for name in ("TP2", "PP2"):
        infer = _strategy("megatron_infer", ckpts["dense"], LAYOUTS[name][1])
        out = infer.generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=0.0))
        got = out["responses"][::2, :8]
        width = expected.shape[1]
        row = results.setdefault(f"infer {name}", {})
        row["greedy_equal"] = bool(torch.equal(got[:, :width], expected) or _same_until_eos(got, expected))
        rescored = infer.compute_log_probs(out)["log_probs"]
        row["infer_logprob_max_diff"] = float((rescored - out["infer_logprobs"]).abs().max())
        if name == "TP2":
            import safetensors.torch

            tensors = safetensors.torch.load_file(str(Path(ckpts["dense_b"]) / "model.safetensors"))
            infer.load_weights(iter(tensors.items()))
            logp = infer.compute_log_probs(make_batch())["log_probs"]
            row["load_weights_max_diff"] = float((logp - other).abs().max())
        _free(infer)


def _same_until_eos(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """HF pads after EOS with pad; ours cuts there: compare up to and including each row's EOS."""
    for a, b in zip(got.tolist(), expected.tolist()):
        n = b.index(1) + 1 if 1 in b else len(b)
        if a[:n] != b[:n]:
            return False
    return True


def run_all(scratch: Path, small: bool) -> dict:
    ckpts = make_checkpoints(scratch / "hf", small) if dist.get_rank() == 0 else None
    box = [ckpts]
    dist.broadcast_object_list(box, src=0)
    results: dict = {}
    for name in LAYOUTS:
        with cuda_on_cpu():
            run_layout(name, box[0], scratch, results)
    with cuda_on_cpu():
        run_infer(box[0], results)
    return results


INFER_ROWS = ("infer TP2", "infer PP2")


def expected_keys(name: str, cuda: bool) -> list[str]:
    """What a row of ``run_all`` must hold (bf16 and offload numbers only where CUDA ran)."""
    if name.startswith("infer"):
        return ["greedy_equal", "infer_logprob_max_diff"] + (
            ["load_weights_max_diff"] if name == "infer TP2" else []
        )
    keys = ["fp32_max_diff", "loss", "hf_loss", "grad_norm", "hf_grad_norm"] + (
        ["bf16_mean_diff"] if cuda else []
    )
    if name == "TP2":
        keys += ["second_loss", "second_grad_norm"] + (["state_mib", "offload_freed_mib"] if cuda else [])
    if name == "PP2":
        keys += ["resumed_loss", "resumed_grad_norm"]
    return keys


def check(results: dict, cuda: bool) -> list[str]:
    """Every failed expectation, as a line; a missing row or value is one (``cuda``: whether the run
    that wrote ``results`` ran on GPUs)."""
    bad = [f"{name}: no result" for name in (*LAYOUTS, *INFER_ROWS) if name not in results]
    for name, row in results.items():
        missing = [key for key in expected_keys(name, cuda) if key not in row]
        if missing:
            bad.append(f"{name}: no {', '.join(missing)}")
            continue
        if name.startswith("infer"):
            if not row["greedy_equal"]:
                bad.append(f"{name}: greedy generation differs from HF")
            if not row["infer_logprob_max_diff"] < FP32_MAX_DIFF:
                bad.append(f"{name}: infer_logprobs vs compute_log_probs {row['infer_logprob_max_diff']:.2e}")
            if name == "infer TP2" and not row["load_weights_max_diff"] < FP32_MAX_DIFF:
                bad.append(f"{name}: load_weights {row['load_weights_max_diff']:.2e}")
            continue
        limits = [("fp32_max_diff", FP32_MAX_DIFF)] + ([("bf16_mean_diff", BF16_MEAN_DIFF)] if cuda else [])
        bad += [f"{name}: {key} {row[key]:.3e} >= {limit}" for key, limit in limits if not row[key] < limit]
        for key in ("loss", "grad_norm"):
            if not math.isclose(row[key], row[f"hf_{key}"], rel_tol=TRAIN_RTOL, abs_tol=1e-6):
                bad.append(f"{name}: {key} {row[key]:.8f} != HF {row[f'hf_{key}']:.8f}")
        if name == "TP2" and cuda and not row["offload_freed_mib"] > 0.95 * row["state_mib"]:
            bad.append(f"{name}: offload freed {row['offload_freed_mib']:.1f} of {row['state_mib']:.1f} MiB")
    tp2, pp2 = results.get("TP2", {}), results.get("PP2", {})
    for key in ("loss", "grad_norm"):
        resumed, second = pp2.get("resumed_" + key), tp2.get("second_" + key)
        if (
            resumed is not None
            and second is not None
            and not math.isclose(resumed, second, rel_tol=TRAIN_RTOL)
        ):
            bad.append(f"TP2 -> PP2 resume: {key} {resumed:.8f} != {second:.8f}")
    return bad


def table(results: dict) -> str:
    keys = sorted({k for row in results.values() for k in row})
    lines = ["layout | " + " | ".join(keys)]
    for name, row in results.items():
        cells = [f"{row[k]:.3e}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k in keys]
        lines.append(f"{name} | " + " | ".join(cells))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ drivers
def _init(rank: int, world: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        compat.apply()


def _worker(rank: int, world: int, port: int, scratch: str, out: str) -> None:
    with process_group(rank, world, port, init=False):  # _init joins (nccl or gloo) as torchrun does
        _init(rank, world)
        results = run_all(Path(scratch), small=torch.cuda.is_available())
        if rank == 0:
            Path(out).write_text(json.dumps(results, indent=1))


def _spawn(tmp_path: Path) -> dict:
    out = tmp_path / "results.json"
    spawn_ranks(_worker, 2, str(tmp_path), str(out))
    return json.loads(out.read_text())


def test_layouts_cpu(tmp_path: Path) -> None:
    with cuda_hidden():  # ranks on CPU + gloo, also on GPU machines
        results = _spawn(tmp_path)
    assert not check(results, cuda=False), "\n".join(check(results, cuda=False)) + "\n" + table(results)


def passing_results(cuda: bool) -> dict:
    """A ``run_all`` result that meets every expectation."""
    values = {"greedy_equal": True, "hf_loss": 1.0, "loss": 1.0, "hf_grad_norm": 2.0, "grad_norm": 2.0}
    values |= {"second_loss": 0.9, "second_grad_norm": 1.9, "resumed_loss": 0.9, "resumed_grad_norm": 1.9}
    values |= {"state_mib": 100.0, "offload_freed_mib": 99.0}
    return {
        name: {k: values.get(k, 0.0) for k in expected_keys(name, cuda)} for name in (*LAYOUTS, *INFER_ROWS)
    }


@pytest.mark.parametrize("cuda", [False, True])
def test_check_fails_on_a_missing_result(cuda: bool) -> None:
    assert check(passing_results(cuda), cuda) == []
    no_row = passing_results(cuda)
    del no_row["PP2"]
    assert check(no_row, cuda) == ["PP2: no result"]
    no_value = passing_results(cuda)
    del no_value["TP2"]["fp32_max_diff"]
    assert check(no_value, cuda) == ["TP2: no fp32_max_diff"]
    if cuda:
        del no_value["EP2"]["bf16_mean_diff"]
        assert check(no_value, cuda) == ["TP2: no fp32_max_diff", "EP2: no bf16_mean_diff"]
    bad = passing_results(cuda)
    bad["infer TP2"]["load_weights_max_diff"] = 1.0
    assert check(bad, cuda) == ["infer TP2: load_weights 1.00e+00"]


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_layouts_gpu(tmp_path: Path) -> None:
    results = _spawn(tmp_path)
    assert not check(results, cuda=True), "\n".join(check(results, cuda=True)) + "\n" + table(results)


if __name__ == "__main__":  # torchrun --nproc_per_node 2 tests/megatron/test_megatron_gpu.py [out.json]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _init(rank, world)
    scratch = Path(os.environ.get("SCRATCH", "/tmp/megatron_gpu_suite"))
    results = run_all(scratch, small=torch.cuda.is_available())
    if rank == 0:
        print(table(results))
        failures = check(results, cuda=torch.cuda.is_available())
        print("FAILURES:\n" + "\n".join(failures) if failures else "ALL CHECKS PASSED")
        if len(sys.argv) > 1:
            Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
