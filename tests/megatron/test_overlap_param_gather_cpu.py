"""megatron_train with ``overlap_param_gather``: what is read right after a step is the new model.

With ``use_distributed_optimizer`` + ``overlap_param_gather`` megatron-core's optimizer step
updates only this DP rank's shard of the parameters and leaves the all-gather of the other shards
to the next forward's pre-hooks. ``iter_hf_weights`` (the model update), ``save_hf_checkpoint`` and
``save_checkpoint`` read the parameters directly, so they must finish that gather first.

Two ranks (DP=2, gloo, fp32, the CPU shims) train the same tiny model twice, once with
``overlap_param_gather`` off (the optimizer step gathers) and once on, and compare after step 1:
what ``iter_hf_weights`` yields and every rank's raw parameters; then a forward (the pre-hooks
after the exported gather must neither hang nor change anything) and step 2 (its export and its
HF checkpoint, read back here). Everything must be bit-identical. ``save_checkpoint`` is left out:
with the distributed optimizer over DP=2 its default sharding type ("fully_sharded_model_space")
is refused by megatron-core 0.16.1's dist-checkpointing ("ShardedTensor.flattened_range is not
supported") whatever ``overlap_param_gather`` is.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent.parent.parent))

pytest.importorskip("megatron.core")

import compat  # noqa: E402
from cuda_on_cpu import cuda_on_cpu  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tiny_models import build_tiny_tokenizer  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs  # noqa: E402
from roll.distributed.scheduler.batch import Batch  # noqa: E402
from roll.distributed.strategy.base import WorkerContext  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402
from roll.models.megatron.hf_io import unwrap  # noqa: E402


def _save_model(path: Path) -> str:
    config = transformers.Qwen2Config(
        vocab_size=272,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


def _batch(rows: int = 4) -> Batch:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 259, (rows, 6), generator=gen)
    batch = Batch.from_dict({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)})
    responses = [torch.randint(3, 259, (8 - i % 3,), generator=gen).tolist() for i in range(rows)]
    out = build_generation_batch(batch, responses, None, 1, 0, 8, temperature=1.0)
    out.tensors["advantages"] = torch.randn(rows, 8, generator=gen)
    return out


def _loss_fn(outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    mask = batch["response_mask"].float()
    return -(outputs["log_probs"] * batch["advantages"] * mask).sum() / mask.sum(), {}


def _strategy(path: str, overlap: bool):
    from roll.distributed.strategy.registry import load_strategy_class

    layout = {"use_distributed_optimizer": True, "overlap_param_gather": overlap}
    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=path, dtype="fp32"),
        training_args=TrainingArgs(learning_rate=1e-2, max_grad_norm=1.0),
        strategy_args=StrategyArgs("megatron_train", layout),
        infer_batch_size=2,
    )
    rank = dist.get_rank()
    ctx = WorkerContext("actor", rank, dist.get_world_size(), rank, torch.device("cpu"), seed=7)
    strategy = load_strategy_class("megatron_train")(role, ctx)
    strategy.initialize()
    compat.seed(7)
    return strategy


def _export(strategy) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in strategy.iter_hf_weights()}


def _raw(strategy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in unwrap(strategy.model[0]).named_parameters()}


def _run(path: str, overlap: bool, scratch: Path) -> dict:
    strategy = _strategy(path, overlap)
    mine = _batch().chunk(2)[dist.get_rank()]
    strategy.train_step(mine.split(1), _loss_fn)
    out = {"export1": _export(strategy), "raw1": _raw(strategy)}
    out["logp"] = strategy.compute_log_probs(mine)["log_probs"]
    strategy.train_step(mine.split(1), _loss_fn)
    out["export2"] = _export(strategy)
    strategy.save_hf_checkpoint(str(scratch / f"hf_{overlap}"))
    out["raw2"] = _raw(strategy)
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


def _worker(rank: int, port: int, path: str, scratch: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    compat.apply()
    try:
        with cuda_on_cpu():
            base = _run(path, False, Path(scratch))
            got = _run(path, True, Path(scratch))
        bad = _differences(base, got)
        assert base["export1"] or rank != 0, "DP rank 0 exported nothing"
        changed = any(not torch.equal(base["raw1"][n], p) for n, p in base["raw2"].items())
        assert changed, "step 2 changed nothing: the comparison would be vacuous"
        Path(scratch, f"rank{rank}.txt").write_text("\n".join(bad))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU + gloo variant (the shims)")
def test_overlap_param_gather_reads_gathered_params(tmp_path: Path) -> None:
    path = _save_model(tmp_path / "model")
    mp.spawn(_worker, args=(_free_port(), path, str(tmp_path)), nprocs=2, join=True)
    bad = [
        f"rank {r}: {line}" for r in (0, 1) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()
    ]
    assert not bad, "overlap_param_gather=True differs from False:\n" + "\n".join(bad)
    hf = [load_file(tmp_path / f"hf_{overlap}" / "model.safetensors") for overlap in (False, True)]
    assert hf[0].keys() == hf[1].keys()
    assert [n for n in hf[0] if not torch.equal(hf[0][n], hf[1][n])] == []
