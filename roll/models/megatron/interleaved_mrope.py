"""Interleaved multimodal RoPE (Qwen3-VL, Qwen3.5): rotary angles from 3-D positions where each
frequency takes its position from one axis in the order T H W T H W ... megatron-core 0.16's
``MultimodalRotaryEmbedding`` has only the sectioned layout of Qwen2-VL (all T's frequencies, then
H's, then W's), so a model replaces its GPTModel's rotary module with this one, built from the same
``inv_freq`` (which carries any partial rotary dimension)::

    model.rotary_pos_emb = InterleavedMRoPE(model.rotary_pos_emb.inv_freq)
"""

from __future__ import annotations

from typing import Any

import torch


class InterleavedMRoPE(torch.nn.Module):
    """Qwen3-VL's rotary angles [s, b, 1, head_dim] from 3-D positions [3, b, s]: frequency i takes
    the H position when i % 3 == 1 and i < 3 * mrope_section[1], the W position when i % 3 == 2 and
    i < 3 * mrope_section[2], the T position otherwise; the angles are repeated for the two halves of
    the head (megatron's non-interleaved rotation, transformers' ``rotate_half``)."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.inv_freq = inv_freq  # not a buffer, as megatron's rotary modules keep it

    def forward(
        self, position_ids: torch.Tensor, mrope_section: list[int], cp_group: Any = None
    ) -> torch.Tensor:
        inv_freq = self.inv_freq.to(device=position_ids.device, dtype=torch.float32)
        freqs = position_ids[..., None].float() * inv_freq  # [3, b, s, d/2]
        angles = freqs[0].clone()
        for axis in (1, 2):
            picked = slice(axis, mrope_section[axis] * 3, 3)
            angles[..., picked] = freqs[axis, ..., picked]
        emb = torch.cat((angles, angles), dim=-1)  # [b, s, d]
        return emb[..., None, :].transpose(0, 1).contiguous()
