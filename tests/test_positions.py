"""``roll.models.positions``: the one place position ids are computed, equal to what each caller
computed by hand before it (left-padded rows, trailing padding, packed rows, empty segments)."""

from __future__ import annotations

import pytest
import torch

from roll.core.batch import Batch
from roll.models.packing import pack_rows
from roll.models.positions import cu_seqlens_from, make_position_ids, packed_positions


def ragged_masks(rows: int, prompt: int, response: int, seed: int) -> torch.Tensor:
    """[rows, prompt + response] long masks: left-padded prompts, right-padded responses."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, prompt + response, dtype=torch.long)
    for row in range(rows):
        p = int(torch.randint(0, prompt + 1, (1,), generator=gen))
        r = int(torch.randint(0, response + 1, (1,), generator=gen))
        mask[row, prompt - p : prompt + r] = 1
    return mask


def test_make_position_ids_left_padding_and_trailing_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert make_position_ids(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("seed", range(4))
def test_make_position_ids_equals_the_hand_built_formulas(seed):
    """generation.py (``mask.long()``), chat_data.py (``dim=1``) and probe.py (``-1``) wrote it out."""
    mask = ragged_masks(6, 5, 4, seed)
    got = make_position_ids(mask)
    assert got.dtype == torch.long
    assert torch.equal(got, (mask.long().cumsum(-1) - 1).clamp(min=0))
    assert torch.equal(got, (mask.cumsum(dim=1) - 1).clamp(min=0))
    assert torch.equal(make_position_ids(mask.bool()), got)  # a bool mask counts the same


def test_packed_positions_restart_in_each_segment():
    cu = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    assert packed_positions(cu, 6).tolist() == [0, 1, 0, 1, 2, 0]
    assert packed_positions(torch.tensor([0, 2, 2, 5]), 5).tolist() == [0, 1, 0, 1, 2]  # empty segment


@pytest.mark.parametrize("seed", range(4))
def test_packed_positions_equal_the_hand_built_formulas(seed):
    """packing.py built them as one arange per segment, and each token's place in its run from
    its row's start (``arange - (cumsum(lengths) - lengths)[rows]``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (7,), generator=gen)
    total = int(lengths.sum())
    cu = cu_seqlens_from(lengths)
    assert torch.equal(cu, torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]))
    rows = torch.arange(len(lengths)).repeat_interleave(lengths)
    assert torch.equal(
        packed_positions(cu, total), torch.arange(total) - (torch.cumsum(lengths, 0) - lengths)[rows]
    )
    sizes = lengths[lengths > 0]
    by_segment = torch.cat([torch.arange(int(n)) for n in sizes])
    assert torch.equal(packed_positions(cu_seqlens_from(sizes).to(torch.int32), total), by_segment)


@pytest.mark.parametrize("segment_multiple", [1, 4])
def test_pack_rows_positions_restart_per_segment_and_keep_the_tokens(segment_multiple):
    mask = ragged_masks(5, 6, 5, seed=3)
    mask[2] = 0  # a row with no tokens at all
    ids = torch.arange(1, mask.numel() + 1).view(mask.shape) * mask
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, 6:]})
    row = pack_rows(batch, multiple=8, segment_multiple=segment_multiple)
    sizes = (row.cu_seqlens[1:] - row.cu_seqlens[:-1]).long()
    by_segment = torch.cat([torch.arange(int(n)) for n in sizes])
    assert torch.equal(row.position_ids[0], by_segment)
    assert row.input_ids[0][row.input_ids[0] > 0].tolist() == ids[mask.bool()].tolist()  # in row order
