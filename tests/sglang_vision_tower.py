"""SGLang 0.5.16's Qwen2.5-VL vision tower layout, for the tests that compare its outputs with
transformers'.

SGLang builds the full-attention blocks' ``cu_seqlens`` from ``t * h * w`` per image or video
(``sglang/srt/models/qwen2_5_vl.py``, ``Qwen2_5_VisionTransformer.forward``), so a video's patches
attend across all of its temporal patches there. Qwen's reference, transformers
(``get_vision_cu_seqlens``, ``merge_temporal=False``) and vLLM 0.24 (``get_rope_by_thw``) attend
within each temporal patch (``h * w``, ``t`` times). Images (one temporal patch) are the same in
all. SGLang's Qwen3-VL tower splits per temporal patch, as the others do::

    with tower_attends_across_frames():     # transformers' Qwen2.5-VL tower laid out as SGLang's
        logprobs = response_log_probs(model, batch)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def tower_attends_across_frames() -> Iterator[None]:
    """transformers' Qwen2.5-VL tower with one full-attention sequence per image or video: 5.17
    and later through ``get_vision_attention_seqlens(merge_temporal=True)``, 5.12 (SGLang 0.5.16's
    site) by its ``get_vision_cu_seqlens``."""
    import torch.nn.functional as F
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    if hasattr(modeling_qwen2_5_vl, "get_vision_attention_seqlens"):
        name, own = "get_vision_attention_seqlens", modeling_qwen2_5_vl.get_vision_attention_seqlens

        def across(grid_thw, config, merge_temporal=False, kwargs=None):
            return own(grid_thw, config, merge_temporal=True, kwargs=kwargs)

    else:
        name, own = "get_vision_cu_seqlens", modeling_qwen2_5_vl.get_vision_cu_seqlens

        def across(grid_thw, kwargs=None):
            seqlens = grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]
            return F.pad(seqlens.cumsum(dim=0, dtype=torch.int32), (1, 0), value=0)

    setattr(modeling_qwen2_5_vl, name, across)
    try:
        yield
    finally:
        setattr(modeling_qwen2_5_vl, name, own)
