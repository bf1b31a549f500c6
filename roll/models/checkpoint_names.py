"""Hugging Face module names <-> checkpoint names: what a model update and an export carry.

transformers 5 stacks a MoE layer's experts into fused module parameters
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) and converts when it
loads or saves a checkpoint (``transformers.conversion_mapping``). Checkpoints, vLLM's and SGLang's
loaders and roll's Megatron weight tables name each expert (``mlp.experts.3.gate_proj.weight``;
Mixtral's ``block_sparse_moe.experts.3.w1.weight``). roll's wire is the checkpoint's names, so a
sender holding transformers modules (fsdp2_train, hf_infer) translates on the way out, and a
receiver holding them loads each expert's tensor into its slice of the stack::

    names = CheckpointNames.of(model)               # read from transformers' mapping for the model
    for name, tensor in names.to_checkpoint(model.state_dict().items()): ...   # per-expert views
    view = names.module_view(targets, "model.layers.0.mlp.experts.3.up_proj.weight")   # or None

Dense models have no conversion: both directions pass names through. Qwen3-VL-MoE's checkpoints
hold the stacks themselves, transposed (transformers converts with ``Transpose`` only); roll's wire
still names each expert, as for Qwen3-MoE (vLLM's Qwen3-VL-MoE loader takes both), so its module
stack maps onto the per-expert names of ``_TRANSPOSED_PARTS``. A conversion other than stacked
experts and plain renames is refused when the mapping is read (``ValueError`` naming it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from roll.models.vision import is_vision_config

_EXPERT = re.compile(r"^(?P<layer>.*\.experts)\.(?P<index>\d+)\.(?P<part>\w+)\.weight$")
_SOURCE = re.compile(r"^(?P<prefix>.*)experts\.\*\.(?P<part>\w+)\.weight$")
_TARGET = re.compile(r"^(?P<prefix>.*)experts\.(?P<param>\w+)$")
_PLAIN = re.compile(r"^[\w.]+$")
# A module stack that the checkpoint stores transposed (``Transpose(1, 2)``): its parts along dim 1,
# as the wire names them (Qwen3-VL-MoE's [E, 2I, H] gate_up_proj: each expert's gate rows, then up).
_TRANSPOSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class ExpertStack:
    """Module parameter ``<layer>.experts.<param>`` [E, k * rows, cols]: the checkpoint's
    ``<layer>.experts.<e>.<part>.weight`` [rows, cols] of every expert e, the k ``parts``
    concatenated in this order along dim 1."""

    param: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointNames:
    """How one model's module names map onto its checkpoint's names."""

    stacks: tuple[ExpertStack, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()  # (checkpoint substring, module substring)

    @classmethod
    def of(cls, model: Any) -> CheckpointNames:
        """The mapping transformers applies to ``model`` when it loads or saves a checkpoint."""
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
        except ImportError:  # a transformers without conversions names modules as checkpoints do
            return cls()
        if not isinstance(model, PreTrainedModel):  # a value head's wrapper: never sent or exported
            return cls()
        stacks, renames = [], []
        vision = is_vision_config(model.config)
        for transform in get_model_conversion_mapping(model, add_legacy=False):
            ops = [type(op).__name__ for op in getattr(transform, "operations", [])]
            if not ops:
                renames += _renames(transform, vision)
            else:
                stacks.append(_stack(transform, ops))
        return cls(tuple(stacks), tuple(renames))

    def to_checkpoint(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Module-named tensors as the checkpoint names them: a stack becomes one view per expert
        and part (no copies), renamed parts take the checkpoint's names."""
        by_param = {stack.param: stack for stack in self.stacks}
        for name, tensor in named:
            layer, _, param = name.rpartition(".experts.")
            stack = by_param.get(param) if layer else None
            if stack is None:
                yield self._checkpoint_name(name), tensor
                continue
            for index in range(tensor.shape[0]):
                pieces = tensor[index].chunk(len(stack.parts), dim=0)
                for part, piece in zip(stack.parts, pieces):
                    yield self._checkpoint_name(f"{layer}.experts.{index}.{part}.weight"), piece

    def module_view(self, targets: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
        """The tensor (a view into a module parameter of ``targets``) that the checkpoint's
        ``name`` loads into; None when ``name`` is neither a module name nor an expert's part."""
        name = self._module_name(name)
        if name in targets:
            return targets[name]
        match = _EXPERT.match(name)
        if match is None:
            return None
        for stack in self.stacks:
            if match["part"] in stack.parts:
                fused = targets.get(f"{match['layer']}.{stack.param}")
                index = int(match["index"])
                if fused is None or index >= fused.shape[0]:
                    return None
                return fused[index].chunk(len(stack.parts), dim=0)[stack.parts.index(match["part"])]
        return None

    def _checkpoint_name(self, name: str) -> str:
        for checkpoint, module in self.renames:
            name = name.replace(module, checkpoint)
        return name

    def _module_name(self, name: str) -> str:
        for checkpoint, module in self.renames:
            name = name.replace(checkpoint, module)
        return name


def _renames(transform: Any, vision: bool = False) -> list[tuple[str, str]]:
    """Plain substring renames. A vision-language model's renames of a name's start (``^visual``
    -> ``model.visual``: the old checkpoint layout) give []: transformers applies them when it
    loads and reverses them when it saves, and roll's wire keeps the module names, which vLLM's
    loader of such a model maps itself (Qwen2.5-VL's ``hf_to_vllm_mapper`` takes
    ``model.language_model.``, ``model.visual.`` and ``lm_head.``)."""
    if vision and transform.source_patterns and all(p.startswith("^") for p in transform.source_patterns):
        return []
    pairs = list(zip(transform.source_patterns, transform.target_patterns))
    if len(transform.source_patterns) != len(transform.target_patterns) or not all(
        _PLAIN.match(a) and _PLAIN.match(b) for a, b in pairs
    ):
        raise ValueError(f"transformers renames {pairs}: roll's model update translates only plain renames")
    return pairs


def _stack(transform: Any, ops: list[str]) -> ExpertStack:
    """A converter that stacks experts (MergeModulelist on dim 0), concatenating several parts of
    each on dim 1 (Concatenate) when it has several sources."""
    if ops == ["Transpose"]:
        return _transposed_stack(transform)
    sources = [_SOURCE.match(p) for p in transform.source_patterns]
    target = _TARGET.match(transform.target_patterns[0]) if len(transform.target_patterns) == 1 else None
    dims = [getattr(op, "dim", None) for op in transform.operations]
    expected = (
        (["MergeModulelist"], [0]) if len(sources) == 1 else (["MergeModulelist", "Concatenate"], [0, 1])
    )
    if target is None or not all(sources) or (ops, dims) != expected:
        raise ValueError(
            f"transformers converts {transform.source_patterns} -> {transform.target_patterns} with {ops}: "
            "roll's model update translates only stacked experts"
        )
    return ExpertStack(target["param"], tuple(s["part"] for s in sources))


def _transposed_stack(transform: Any) -> ExpertStack:
    """A stack the checkpoint stores transposed under the module's own name (Qwen3-VL-MoE's
    ``mlp.experts.gate_up_proj``): on the wire, each expert's parts of ``_TRANSPOSED_PARTS``."""
    (source,), (target,) = transform.source_patterns, transform.target_patterns
    match = _TARGET.match(target)
    dims = [(getattr(op, "dim0", None), getattr(op, "dim1", None)) for op in transform.operations]
    if source != target or match is None or match["param"] not in _TRANSPOSED_PARTS or dims != [(1, 2)]:
        raise ValueError(
            f"transformers transposes {transform.source_patterns} -> {transform.target_patterns}: roll's "
            f"model update translates only stacked experts (transposed: {sorted(_TRANSPOSED_PARTS)})"
        )
    return ExpertStack(match["param"], _TRANSPOSED_PARTS[match["param"]])
