"""A vision-language model on packed (``thd``) rows, context parallelism included: its 3-D rope
positions and its vision features, placed at the columns of this rank's tokens.

``forward.py`` packs a vision micro-batch as any other (``roll.models.packing``: each row's real
tokens one segment of ``cu_seqlens``) and hands the model the whole packed row as
``packed_input_ids`` [1, T]: under context parallelism the model's ``input_ids`` are only this CP
rank's zig-zag share (``roll.models.context_parallel``), and neither the rope positions nor the
place of an image's features can be told from a share. From the whole row a model computes:

- ``packed_mrope_positions``: each sequence's positions as a row of its own starting at column 0
  (what the padded path computes), put at its packed columns: [3, 1, T] over the WHOLE row.
  megatron-core's ``MultimodalRotaryEmbedding`` turns them into the frequencies of every packed
  column, and its ``thd`` RoPE (``rope_utils._apply_rotary_pos_emb_thd``: frequencies that cover
  the row are taken per column, "exact mapping") picks the columns of this CP rank's chunks.
  ``keep_whole_row`` stops the rotary module from cutting them itself first (its own CP split is
  the ``bshd`` one, two chunks of the whole row, not of each sequence). Qwen3-VL's and Qwen3.5's
  ``interleaved_mrope.InterleavedMRoPE`` never cuts: it returns the whole row's [T, 1, 1, d] too.
- ``local_columns``: the packed columns of this rank's tokens (None without CP);
- ``with_vision_features``: the word embeddings of this rank's tokens with the vision tokens'
  replaced by the tower's features (each CP rank runs the tower on the micro-batch's images and
  keeps the features of its own tokens; backward reaches the tower from every rank's share);
  ``placed_features``: features at this rank's vision tokens, zero elsewhere (Qwen3-VL's deepstack).

The padded path uses the last two as well, with the rows themselves and no local columns;
``vision_inputs`` picks the rows, local columns and positions of either path for a forward.

>>> positions = packed_mrope_positions(packed_input_ids, cu_seqlens, lambda rows: my_rope_index(rows))
>>> local = local_columns(cu_seqlens)
>>> embeddings = with_vision_features(words, packed_input_ids, [(image_token_id, features)], local, sp)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from roll.models.context_parallel import zigzag_indices
from roll.models.packing import segment_ids
from roll.models.positions import packed_positions


def packed_mrope_positions(
    packed_ids: torch.Tensor, cu_seqlens: torch.Tensor, row_positions: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """[3, 1, T] rope positions of a packed row ``packed_ids`` [1, T]: ``row_positions`` gets the
    segments as rows [segments, longest] starting at column 0 (zeros after each) and returns their
    [3, segments, longest] positions (e.g. Qwen2.5-VL's ``get_rope_index``, which reads the images'
    grids in row order: the packed row keeps the rows' order)."""
    total = packed_ids.shape[1]
    segment = segment_ids(cu_seqlens.long())
    within = packed_positions(cu_seqlens, total)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    rows = packed_ids.new_zeros(int(segment.max()) + 1, longest)
    rows[segment, within] = packed_ids[0]
    return row_positions(rows)[:, segment, within].unsqueeze(1)


def text_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[3, 1, T]: a packed row without vision tokens counts up on all three axes per sequence."""
    return packed_positions(cu_seqlens, total).view(1, 1, -1).expand(3, 1, -1)


def local_columns(cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """The packed columns this context-parallel rank holds (its zig-zag chunks of each sequence, as
    ``forward.py`` cut its ``input_ids``); None without context parallelism."""
    from megatron.core import parallel_state as ps

    cp_size = ps.get_context_parallel_world_size()
    if cp_size == 1:
        return None
    local = zigzag_indices(cu_seqlens.cpu(), cp_size, ps.get_context_parallel_rank())
    return local.to(cu_seqlens.device)


def keep_whole_row(rotary: Any) -> None:
    """Let megatron-core's ``MultimodalRotaryEmbedding`` return the frequencies of every column it
    is given: with no CP group of its own it never cuts them into CP chunks (the ``thd`` RoPE picks
    each rank's columns, see the module docstring). roll runs context parallelism on packed rows
    only, so no other input reaches it under CP."""
    rotary.cp_group = None


def vision_inputs(
    input_ids: torch.Tensor,
    packed: Any,
    packed_input_ids: torch.Tensor | None,
    row_positions: Callable[[torch.Tensor], torch.Tensor],
    cp_size: int,
    model_name: str,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(rows, local, position_ids) of a vision-language model's forward: the token ids its vision
    features are placed by (``input_ids`` on padded rows, the whole packed row on packed ones), the
    columns of ``rows`` this rank's tokens are (``local_columns``) and the rows' 3-D rope positions.
    ``packed``: the forward's ``packed_seq_params`` (None: padded rows); ``packed_input_ids``: the
    whole packed row (None: a packed micro-batch without vision inputs); ``row_positions``: the
    model's rope positions of rows starting at column 0; ``cp_size``: the context-parallel size."""
    if packed is None:
        if cp_size > 1:
            raise ValueError(f"context parallelism runs {model_name} on packed rows only")
        return input_ids, None, row_positions(input_ids)
    if packed_input_ids is None:  # no vision inputs in this micro-batch
        return input_ids, None, text_positions(packed.cu_seqlens_q, int(packed.cu_seqlens_q[-1]))
    positions = packed_mrope_positions(packed_input_ids, packed.cu_seqlens_q, row_positions)
    return packed_input_ids, local_columns(packed.cu_seqlens_q), positions


def placed_features(
    rows: torch.Tensor,
    parts: Sequence[tuple[int, torch.Tensor]],
    local: torch.Tensor | None,
    sequence_parallel: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [s, b, h] at this rank's vision tokens, zero elsewhere; mask [s, b] of those tokens),
    this rank's sequence share under SP. ``rows`` [b, S]: the token ids (padded rows, or the whole
    packed row); ``parts``: (token id, features [that token's count in ``rows``, h]) each, the
    features in row order; ``local``: the columns of ``rows`` this rank's tokens are (None: all)."""
    from megatron.core import tensor_parallel

    index = torch.full(rows.shape, -1, dtype=torch.long, device=rows.device)
    offset, features = 0, []
    for token, feats in parts:
        mask = rows == token
        if int(mask.sum()) != feats.shape[0]:
            raise ValueError(
                f"{int(mask.sum())} tokens {token} in the rows for {feats.shape[0]} vision features"
            )
        index[mask] = offset + torch.arange(feats.shape[0], device=rows.device)  # row-major: row order
        offset += feats.shape[0]
        features.append(feats.to(dtype))
    if local is not None:
        index = index[:, local]
    vision = (index >= 0).transpose(0, 1).contiguous()
    full = torch.cat(features)[index.clamp(min=0)].transpose(0, 1)  # [s, b, h]
    full = torch.where(vision.unsqueeze(-1), full, 0.0).contiguous()
    if sequence_parallel:  # this rank's share, as the embedding scattered the words
        full = tensor_parallel.scatter_to_sequence_parallel_region(full)
        vision = tensor_parallel.scatter_to_sequence_parallel_region(vision.float()).bool()
    return full, vision


def with_vision_features(
    words: torch.Tensor,
    rows: torch.Tensor,
    parts: Sequence[tuple[int, torch.Tensor]],
    local: torch.Tensor | None,
    sequence_parallel: bool,
) -> torch.Tensor:
    """``words`` [s, b, h] (this rank's tokens; its sequence share under SP) with the vision tokens'
    embeddings replaced by ``parts``' features (``placed_features`` says what the arguments are)."""
    full, vision = placed_features(rows, parts, local, sequence_parallel, words.dtype)
    return torch.where(vision.unsqueeze(-1), full, words).contiguous()  # pipeline sends need contiguous
