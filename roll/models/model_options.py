"""Names a role's ``model_args`` may use, mapped to what they mean; ``roll.models.loading`` applies
them and the config check before launch reads its allowed values from here (imports only torch).
"""

from __future__ import annotations

import torch

# ``model_args.dtype`` -> torch dtype.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# ``model_args.model_type`` values that load a value model (a causal LM body with a scalar value
# head, for the critic); None loads a causal LM. "trl" is ROLL's name for the same.
MODEL_TYPES = ("value", "trl")

# ROLL's ``flash_attn`` names and transformers' own names -> transformers' attn_implementation.
ATTN_IMPLEMENTATIONS: dict[str, str] = {
    "fa2": "flash_attention_2",
    "fa3": "flash_attention_3",
    "flash_attention_2": "flash_attention_2",
    "flash_attention_3": "flash_attention_3",
    "sdpa": "sdpa",
    "eager": "eager",
}
