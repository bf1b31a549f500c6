"""Megatron's pipeline layout string (``strategy_config.pipeline_model_parallel_layout``), parsed
without megatron-core so configs load and ``--dry_run`` plans where it is not installed.

The grammar is megatron-core 0.16.1's (``PipelineParallelLayerLayout.parse_str_to_list``): one
character per layer (``E`` the embedding, ``t`` a decoder layer, ``L`` the loss / output head,
``m`` a multi-token-prediction layer), ``|`` between pipeline stages, ``(...)*n`` and ``x*n``
repeat, commas are cosmetic. Stage ``s`` runs on PP rank ``s % PP`` as its virtual stage
``s // PP``, so the stage count / PP is the virtual pipeline size.

>>> layout = PipelineLayout.parse("E|(tt|)*2,L")
>>> layout.stages
('E', 'tt', 'tt', 'L')
>>> layout.rank_layers(2)                      # decoder layers per PP rank, per virtual stage
[[0, 2], [2, 0]]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LAYER_CHARS = {"E": "embedding", "t": "decoder layer", "L": "loss", "m": "multi-token prediction"}
# (...)*n first, then x*n (megatron's order); no nesting.
_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))
# A layout longer than this once unrolled is a typo (the largest models have a few hundred layers).
MAX_CHARS = 100_000


@dataclass(frozen=True)
class PipelineLayout:
    """The layers of each pipeline stage, in stage order (each a string of layer characters)."""

    stages: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> PipelineLayout:
        """Parse and check a layout string; ValueError saying what is wrong with it."""
        unrolled = text.replace(",", "")
        for pattern in _REPEATS:
            unrolled = pattern.sub(lambda m: _repeat(m[1], int(m[2])), unrolled)
        stages = tuple(unrolled.split("|"))
        bad = sorted({c for stage in stages for c in stage} - set(LAYER_CHARS))
        if bad:
            known = ", ".join(f"{c} ({what})" for c, what in LAYER_CHARS.items())
            raise ValueError(
                f"unknown layer character(s) {bad} in {text!r}; known: {known}, '|' between stages"
            )
        layout = cls(stages)
        layout._check_ends(text)
        return layout

    def _check_ends(self, text: str) -> None:
        """E opens the first stage and L closes the last: megatron builds the embedding on the first
        stage and the head on the last whatever the string says (its own check lets an empty stage
        come before E or after L)."""
        flat = "".join(self.stages)
        if flat.count("E") != 1 or not self.stages[0].startswith("E"):
            raise ValueError(f"{text!r} must open its first stage with the one embedding E")
        if flat.count("L") != 1 or not self.stages[-1].endswith("L"):
            raise ValueError(f"{text!r} must close its last stage with the one loss L")

    @property
    def decoder_layers(self) -> int:
        return sum(stage.count("t") for stage in self.stages)

    @property
    def mtp_layers(self) -> int:
        return sum(stage.count("m") for stage in self.stages)

    def virtual_size(self, pp: int) -> int:
        """Virtual stages per PP rank; ValueError if the stages do not split over ``pp`` ranks."""
        if len(self.stages) % pp:
            raise ValueError(
                f"its {len(self.stages)} stages are not a multiple of pipeline_model_parallel_size {pp}"
            )
        return len(self.stages) // pp

    def rank_layers(self, pp: int) -> list[list[int]]:
        """Decoder layers of each PP rank's virtual stages: ``[pp_rank][vp_stage]``."""
        vpp = self.virtual_size(pp)
        return [[self.stages[v * pp + p].count("t") for v in range(vpp)] for p in range(pp)]


def _repeat(unit: str, count: int) -> str:
    if len(unit) * count > MAX_CHARS:
        raise ValueError(f"({unit})*{count} unrolls past {MAX_CHARS} characters")
    return unit * count
