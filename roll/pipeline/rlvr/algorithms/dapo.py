"""DAPO's sample-level tools (Yu et al. 2025): which prompt groups carry a learning signal, the
soft overlong penalty, and which responses were truncated.

    keep = informative_groups(scores, group_ids)          # rows of groups whose scores differ
    scores = scores + overlong_penalty(lengths, 32, 8)    # 0 up to 24 tokens, -1 at 32
"""

from __future__ import annotations

import torch


def informative_groups(scores: torch.Tensor, group_ids: list[str]) -> tuple[list[int], list[int]]:
    """``(kept_rows, dropped_rows)``: a group is dropped when all its scores are equal (GRPO gives
    it zero advantage, so it only dilutes the batch). Rows keep their order."""
    by_group: dict[str, list[int]] = {}
    for row, gid in enumerate(group_ids):
        by_group.setdefault(gid, []).append(row)
    kept: list[int] = []
    dropped: list[int] = []
    for rows in by_group.values():
        values = scores[torch.as_tensor(rows)]
        (kept if bool((values != values[0]).any()) else dropped).extend(rows)
    return sorted(kept), sorted(dropped)


def overlong_penalty(
    lengths: torch.Tensor, response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment per response of ``lengths`` tokens::

        0                                          if L <= response_length - buffer_length
        (response_length - buffer_length - L) / buffer_length * penalty_factor   inside the band
        -penalty_factor                            if L >= response_length

    ``buffer_length`` 0 gives zeros (no shaping)."""
    if buffer_length <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    start = response_length - buffer_length
    excess = (lengths.float() - start).clamp(min=0.0, max=float(buffer_length))
    return -excess / buffer_length * penalty_factor


def truncated_rows(
    responses: torch.Tensor, response_mask: torch.Tensor, eos_token_ids: list[int]
) -> torch.Tensor:
    """Bool ``[B]``: the response filled every one of its positions and its last token is not an
    end-of-sequence token (the engine cut it at ``response_length``)."""
    lengths = response_mask.sum(-1).long()
    full = lengths >= response_mask.shape[-1]
    last = responses.gather(-1, (lengths - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ended = torch.isin(last, torch.as_tensor(eos_token_ids, dtype=last.dtype))
    return full & ~ended
