"""What the two-rank megatron_train CPU tests share: a tiny untied Qwen2 checkpoint, a fixed
policy-gradient batch and loss, a strategy built for a layout, and a two-process gloo run whose
ranks report problems as lines of text (empty = none).

>>> def worker(rank: int, world_size: int, port: int, path: str, scratch: str) -> None:
...     with megatron_rank(rank, world_size, port, scratch) as bad:
...         bad += my_checks(path)                                    # lines of text, [] = fine
>>> path = save_tiny_qwen2(tmp_path / "model", layers=4)
>>> bad = run_two_ranks(worker, (path, str(tmp_path)), tmp_path)   # worker(rank, 2, port, *args)
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

import compat  # noqa: E402
from cuda_on_cpu import cuda_hidden, cuda_on_cpu  # noqa: E402
from gloo_ranks import process_group, spawn_ranks  # noqa: E402
from tiny_models import build_tiny_tokenizer  # noqa: E402

from roll.configs.role import ModelArgs, RoleConfig, StrategyArgs, TrainingArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.worker_context import WorkerContext  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402
from roll.models.megatron.hf_io import export_hf_weights, unwrap  # noqa: E402


def save_tiny_qwen2(path: Path, layers: int) -> str:
    """An untied fp32 Qwen2 (hidden 32, vocab 272) with spread-out weights, plus a tokenizer."""
    config = transformers.Qwen2Config(
        vocab_size=272,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
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


def pg_batch(seed: int, rows: int = 4) -> Batch:
    """``rows`` random prompts and responses (8 columns, ragged) with random advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 259, (rows, 6), generator=gen)
    batch = Batch.from_dict({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)})
    responses = [torch.randint(3, 259, (8 - i % 3,), generator=gen).tolist() for i in range(rows)]
    out = build_generation_batch(batch, responses, None, 1, 0, 8, temperature=1.0)
    out.tensors["advantages"] = torch.randn(rows, 8, generator=gen)
    return out


def pg_loss(outputs: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    mask = batch["response_mask"].float()
    return -(outputs["log_probs"] * batch["advantages"] * mask).sum() / mask.sum(), {}


def hf_log_probs_and_grad_norm(path: str, batch: Batch) -> tuple[torch.Tensor, float]:
    """transformers' response log-probs of ``batch`` and its gradient norm of ``pg_loss`` averaged
    over one-row micro-batches (what megatron_train's step computes from ``batch.split(1)``)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask).logits
    width = batch["responses"].shape[1]
    logps = torch.log_softmax(logits[:, -width - 1 : -1], dim=-1)
    logps = logps.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    rmask = batch["response_mask"].float()
    loss = (-(logps * batch["advantages"] * rmask).sum(1) / rmask.sum(1)).mean()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return logps.detach(), float(norm)


def full_hf_weights(strategy) -> dict[str, torch.Tensor]:
    """Every HF tensor of a megatron strategy's model, gathered on every rank, on CPU."""
    mine = {n: t.detach().to("cpu", copy=True) for n, t in export_hf_weights(strategy.model)}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {n: t for part in parts for n, t in part.items()}


def train_strategy(
    path: str,
    layout: dict,
    weight_decay: float = 0.0,
    strategy: str = "megatron_train",
    device: str = "cpu",
    **model_args,
):
    """megatron_train (fp32, lr 1e-2, clip 1.0; or ``strategy``, e.g. megatron_infer) on this
    process's rank of the default group, on CPU or (``device="cuda"``) CUDA device ``rank``;
    ``model_args``: more ``ModelArgs`` fields."""
    from roll.distributed.strategy.registry import load_strategy_class

    role = RoleConfig(
        model_args=ModelArgs(model_name_or_path=path, dtype="fp32", **model_args),
        training_args=TrainingArgs(learning_rate=1e-2, max_grad_norm=1.0, weight_decay=weight_decay),
        strategy_args=StrategyArgs(strategy, dict(layout)),
        infer_batch_size=2,
    )
    rank = dist.get_rank()
    where = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    ctx = WorkerContext("actor", rank, dist.get_world_size(), rank, where, seed=7)
    strategy = load_strategy_class(strategy)(role, ctx)
    strategy.initialize()
    compat.seed(7)
    return strategy


def raw_params(strategy) -> dict[str, torch.Tensor]:
    """This rank's megatron parameters of the first chunk, copied."""
    return {n: p.detach().clone() for n, p in unwrap(strategy.model[0]).named_parameters()}


def run_two_ranks(worker: Callable, args: tuple, scratch: Path) -> list[str]:
    """Spawn ``worker(rank, 2, port, *args)`` on two CPU processes (``gloo_ranks.spawn_ranks``; CUDA
    hidden from them, so GPU machines run these tests too); each writes its problems, one per line,
    to ``scratch/rank{r}.txt``. Returns them prefixed with the rank."""
    with cuda_hidden():
        spawn_ranks(worker, 2, *args)
    return [
        f"rank {r}: {line}" for r in (0, 1) for line in (scratch / f"rank{r}.txt").read_text().splitlines()
    ]


@contextlib.contextmanager
def megatron_rank(
    rank: int, world_size: int, port: int, scratch: str, timeout: datetime.timedelta | None = None
) -> Iterator[list[str]]:
    """One rank of a megatron CPU test: warnings off, the default group (``gloo_ranks.process_group``),
    megatron-core's CPU shims (``compat.apply``, ``cuda_on_cpu``) and a list the block appends its
    problems to, written to ``scratch/rank{rank}.txt`` (what ``run_two_ranks`` reads) once it ends."""
    warnings.filterwarnings("ignore")
    with process_group(rank, world_size, port, timeout=timeout):
        compat.apply()
        problems: list[str] = []
        with cuda_on_cpu():
            yield problems
        Path(scratch, f"rank{rank}.txt").write_text("\n".join(problems))
