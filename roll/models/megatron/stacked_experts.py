"""Checkpoints that store a MoE layer's experts stacked and transposed (Qwen3-VL-MoE).

roll's weight tables name each expert's tensor as Qwen3-MoE's checkpoints do
(``<block>.experts.<e>.gate_proj.weight`` [I, H]); that is also what a model update sends (vLLM's
loaders take these names for the stacked models too). Some checkpoints instead hold one tensor per
layer and linear, every expert stacked on dim 0 and each expert's matrix transposed, several parts
concatenated along the output dim (transformers 5 writes them untransposed, [E, 2I, H] and
[E, H, I], and reads both; so does roll's loader, telling them apart by shape)::

    <block>.experts.gate_up_proj   [E, H, 2I] = stack over e of [gate_e; up_e].T
    <block>.experts.down_proj      [E, I, H]  = stack over e of down_e.T

A family lists its stacks (``Stack``); this module turns one naming into the other. Loading
(``StackedNames.slot``) reads one expert's part, or one TP slice of it, straight from the stacked
tensor (safetensors slices: no rank reads the whole stack); writing (``Stacker``) collects the
per-expert tensors of a stack, from any number of exporting ranks' parts, and yields the stacked
tensor once every expert of it is there.

>>> names = StackedNames((Stack("gate_up_proj", ("gate_proj", "up_proj")),), 128, hidden=2048, intermediate=768)
>>> names.slot("model.layers.0.mlp.experts.5.up_proj.weight")
Slot(stored='model.layers.0.mlp.experts.gate_up_proj', expert=5, part=1, parts=2, out=768, inner=2048)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

_EXPERT = re.compile(r"^(?P<block>.*\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")
_STORED = re.compile(r"^(?P<block>.*\.experts)\.(?P<stored>\w+)$")


@dataclass(frozen=True)
class Stack:
    """Checkpoint tensor ``<block>.experts.<stored>`` [E, in, k * out]: the per-expert tensors
    ``<block>.experts.<e>.<part>.weight`` [out, in] of the k ``parts``, concatenated in this order
    along ``out``, transposed, stacked over the experts. ``out_is_hidden``: ``out`` is the model's
    hidden size and ``in`` the expert's intermediate size (down_proj), else the other way round."""

    stored: str
    parts: tuple[str, ...]
    out_is_hidden: bool = False


@dataclass(frozen=True)
class Slot:
    """Where one per-expert tensor [out, inner] sits: part ``part`` of ``parts`` of expert
    ``expert`` of the stacked tensor ``stored``."""

    stored: str
    expert: int
    part: int
    parts: int
    out: int
    inner: int

    def shape(self) -> list[int]:
        return [self.out, self.inner]

    def transposed(self, stored_shape: list[int]) -> bool:
        """Whether the stack holds the experts transposed ([E, inner, k * out], as released) or as
        transformers 5 saves it, in its modules' layout ([E, k * out, inner]); both read as
        transposed when they coincide (vLLM's loader always transposes). ValueError for neither."""
        experts, k = stored_shape[0], self.parts
        if list(stored_shape) == [experts, self.inner, k * self.out]:
            return True
        if list(stored_shape) == [experts, k * self.out, self.inner]:
            return False
        raise ValueError(
            f"has shape {list(stored_shape)}; expected [E, {self.inner}, {k * self.out}] (stacked experts, "
            f"transposed) or [E, {k * self.out}, {self.inner}]"
        )

    def read(
        self, stored: object, stored_shape: list[int], dim: int | None, start: int, stop: int
    ) -> torch.Tensor:
        """The per-expert tensor (``dim`` None) or its rows (0) / columns (1) [start, stop), read
        from ``stored`` (a safetensors slice of the stacked tensor) without reading the rest."""
        first = self.part * self.out
        rows = (first + start, first + stop) if dim == 0 else (first, first + self.out)
        cols = (start, stop) if dim == 1 else (0, self.inner)
        e = slice(self.expert, self.expert + 1)
        if self.transposed(stored_shape):
            return stored[e, cols[0] : cols[1], rows[0] : rows[1]][0].transpose(0, 1).contiguous()
        return stored[e, rows[0] : rows[1], cols[0] : cols[1]][0]


@dataclass(frozen=True)
class StackedNames:
    """The stacks of one model (``stacks``) over its ``num_experts`` experts, whose linears map
    ``hidden`` to ``intermediate`` and back."""

    stacks: tuple[Stack, ...]
    num_experts: int
    hidden: int
    intermediate: int

    def slot(self, name: str) -> Slot | None:
        """The stacked tensor holding per-expert ``name``; None for a name no stack holds."""
        match = _EXPERT.match(name)
        if match is None:
            return None
        for stack in self.stacks:
            if match["part"] in stack.parts:
                out, inner = (self.hidden, self.intermediate)[:: 1 if stack.out_is_hidden else -1]
                return Slot(
                    f"{match['block']}.{stack.stored}",
                    int(match["expert"]),
                    stack.parts.index(match["part"]),
                    len(stack.parts),
                    out,
                    inner,
                )
        return None

    def stored_name(self, name: str) -> str:
        """``name``'s stacked tensor's name, or ``name`` itself when no stack holds it."""
        slot = self.slot(name)
        return name if slot is None else slot.stored

    def expand(self, stored: str) -> list[str]:
        """The per-expert names a stacked checkpoint tensor holds; [stored] for any other tensor."""
        match = _STORED.match(stored)
        stack = next((s for s in self.stacks if match is not None and s.stored == match["stored"]), None)
        if stack is None:
            return [stored]
        return [
            f"{match['block']}.{e}.{part}.weight" for e in range(self.num_experts) for part in stack.parts
        ]


@dataclass
class Stacker:
    """Collects per-expert tensors and yields each stacked tensor once all its pieces arrived."""

    names: StackedNames
    _pending: dict[str, dict[tuple[int, int], torch.Tensor]] = field(default_factory=dict)

    def add(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``named`` with the stacks' pieces taken out, and every stack they complete, stacked."""
        for name, tensor in named:
            slot = self.names.slot(name)
            if slot is None:
                yield name, tensor
                continue
            pieces = self._pending.setdefault(slot.stored, {})
            pieces[(slot.expert, slot.part)] = tensor
            if len(pieces) == self.names.num_experts * slot.parts:
                del self._pending[slot.stored]
                yield slot.stored, _stack(pieces, self.names.num_experts, slot.parts)

    def check_done(self) -> None:
        """RuntimeError when some stack still misses pieces (an expert no part held)."""
        if self._pending:
            name, pieces = next(iter(self._pending.items()))
            raise RuntimeError(
                f"stacked expert tensor {name}: only {len(pieces)} of its pieces were exported"
            )


def _stack(pieces: dict[tuple[int, int], torch.Tensor], experts: int, parts: int) -> torch.Tensor:
    """[E, in, parts * out] from the pieces [out, in] keyed (expert, part)."""
    return torch.stack(
        [torch.cat([pieces[(e, p)] for p in range(parts)], dim=0).transpose(0, 1) for e in range(experts)]
    ).contiguous()
