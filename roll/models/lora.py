"""LoRA adapters on a Hugging Face model: frozen base weights, a trainable low-rank update.

A target ``nn.Linear`` (weight W [out, in]) becomes a ``LoRALinear`` holding it as ``base`` with
A [rank, in] (kaiming-uniform, as peft) and B [out, rank] (zeros), so at initialisation the model
computes exactly what it computed before::

    y = base(x) + (dropout(x) @ A.T @ B.T) * alpha / rank

>>> wrapped = apply_lora(model, ["q_proj", "v_proj"], rank=8, alpha=16.0)   # names of the wrapped modules
>>> merged = dict(merged_stream(model.state_dict().items(), lora_scales(model)))  # HF names, W + alpha/rank * B @ A

Every parameter but the adapters (and ``keep_trainable`` prefixes, e.g. a critic's fresh value
head) is frozen. ``hf_name`` maps a wrapped model's state_dict name back to the original one
(``...q_proj.base.weight`` -> ``...q_proj.weight``), which is what weight exports send.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from roll.configs.errors import ConfigError
from roll.configs.role import LORA_ALL_LINEAR as ALL_LINEAR

BASE = "base"
ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus ``scale * B @ A``; ``generator`` draws A (the same on every rank)."""

    def __init__(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        weight = base.weight
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, dtype=weight.dtype, device=weight.device)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, dtype=weight.dtype, device=weight.device)
        )
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.dropout(x).to(self.lora_A.dtype) @ self.lora_A.T @ self.lora_B.T
        return self.base(x) + (update * self.scale).to(x.dtype)


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight + scale * lora_b @ lora_a`` in fp32, in ``weight``'s dtype; full (not sharded) tensors."""
    delta = lora_b.detach().float() @ lora_a.detach().float()
    return (weight.detach().float() + scale * delta).to(weight.dtype)


def describe_layout(layout: dict[str, Any] | None) -> str:
    """A checkpoint's LoRA layout ({"rank", "modules"}, None without LoRA) in a few words, for the
    error that refuses a resume with other lora_* keys (fsdp2 and megatron alike)."""
    if layout is None:
        return "off (every weight trained)"
    return f"rank {layout['rank']} on {len(layout['modules'])} modules"


def lora_candidates(model: nn.Module, layers: Iterable[nn.Module]) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules inside ``layers`` (the decoder layers), by their name in ``model``."""
    inside = {id(m) for layer in layers for m in layer.modules()}
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) in inside}


def match_targets(candidates: dict[str, nn.Linear], targets: list[str], path: str) -> list[str]:
    """Names of ``candidates`` that end with a target (``q_proj`` matches ``...self_attn.q_proj``);
    ``all-linear`` takes all. A target that matches nothing is a ConfigError on ``path`` listing
    the module names it could match."""
    if ALL_LINEAR in targets:
        return list(candidates)
    known = sorted({name.rsplit(".", 1)[-1] for name in candidates})
    chosen: set[str] = set()
    for target in targets:
        hits = {n for n in candidates if n == target or n.endswith(f".{target}")}
        if not hits:
            raise ConfigError(
                path,
                f"{target!r} matches no linear module of the decoder layers; it could be one of "
                f"{', '.join(known)} or {ALL_LINEAR}",
            )
        chosen |= hits
    return [name for name in candidates if name in chosen]  # model order


def apply_lora(
    model: nn.Module,
    targets: list[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    *,
    layers: Iterable[nn.Module] | None = None,
    seed: int = 0,
    keep_trainable: tuple[str, ...] = (),
    path: str = "model_args.lora_target",
) -> list[str]:
    """Wrap the matched linear modules of ``layers`` (default: every module) in ``LoRALinear`` and
    freeze every other parameter except names starting with ``keep_trainable``; returns the wrapped
    module names in model order. A is drawn from ``seed`` module by module, so every rank that
    applies the same targets to the same model gets the same adapters."""
    candidates = lora_candidates(model, layers if layers is not None else [model])
    chosen = match_targets(candidates, targets, path)
    for param in model.parameters():
        param.requires_grad_(False)
    for pname, param in model.named_parameters():
        if keep_trainable and pname.startswith(keep_trainable):
            param.requires_grad_(True)
    generator = torch.Generator().manual_seed(seed)
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(candidates[name], rank, alpha, dropout, generator))
    return chosen


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The ``LoRALinear`` modules of ``model`` by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def hf_name(name: str, wrapped: set[str]) -> str:
    """The original name of a wrapped model's state_dict entry: ``<module>.base.<tensor>`` of a
    wrapped ``<module>`` is ``<module>.<tensor>``; other names are unchanged."""
    module, _, tensor = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last == BASE and parent in wrapped:
        return f"{parent}.{tensor}"
    return name


def lora_scales(model: nn.Module) -> dict[str, float]:
    """alpha / rank of each ``LoRALinear`` by module name (what ``merged_stream`` needs)."""
    return {name: m.scale for name, m in lora_modules(model).items()}


def merged_stream(
    named: Iterable[tuple[str, torch.Tensor]], scales: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A wrapped model's full state_dict entries, in state_dict order, as the un-wrapped model's:
    original names, each LoRA target's weight merged (W + scale * B @ A), no adapter entries. A
    target's weight is held until its A and B have arrived (a module's own A, B come before its
    ``base`` in state_dict order, so normally nothing waits)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    wrapped = set(scales)
    for name, tensor in named:
        original = hf_name(name, wrapped)
        module, _, leaf = original.rpartition(".")
        if module not in scales or leaf not in (*ADAPTER_NAMES, "weight"):
            yield original, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) == 3:
            del pending[module]
            yield f"{module}.weight", merge(parts["weight"], parts["lora_A"], parts["lora_B"], scales[module])
    if pending:
        raise ValueError(
            f"merged_stream: incomplete LoRA modules {sorted(pending)[:3]} (weight, lora_A, lora_B)"
        )
