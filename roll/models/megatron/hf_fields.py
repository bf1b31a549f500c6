"""HF ``config.json`` fields the megatron model families read, the same way on transformers 4 and 5.

``families`` (every family's GPTModel arguments) and ``deepseek`` (multi-latent attention, YaRN)
both read them; ``families`` imports ``deepseek``, so the readers live here rather than in either.

>>> rope_parameters(hf_config)["rope_type"]      # "default", "llama3", "yarn", ...
>>> head_dim(hf_config)                          # per-head width, also where config.json omits it
"""

from __future__ import annotations

from typing import Any


def head_dim(hf: Any) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def rope_parameters(hf: Any) -> dict[str, Any]:
    """rope parameters from transformers 5 (``rope_parameters``) or 4 (``rope_theta``/``rope_scaling``)."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params
