"""The weight names SGLang's loader takes for a model type, from roll's names (no engine needed;
tested on CPU).

roll sends a vision-language model's weights under transformers 5's module names:
``model.language_model.*``, ``model.visual.*``, ``lm_head.*`` (``roll.models.megatron.weight_mapping``,
an HF model's ``state_dict``). SGLang 0.5.16 applies its checkpoint name mapper only when it reads a
model directory; ``update_weights_from_tensor`` and ``update_weights_from_distributed`` hand the
names straight to the model's ``load_weights``. Qwen3-VL's accepts both layouts; Qwen2.5-VL's
(``sglang/srt/models/qwen2_5_vl.py``) matches names against its own parameters (``model.*``,
``visual.*``, ``lm_head.*``): under roll's names it skipped every language-model tensor without a
word and stopped at the first stacked vision tensor (``KeyError:
'model.visual.blocks.0.mlp.gate_up_proj.weight'``). So such a model's names go out in its own
layout::

    rename = sglang_weight_names("qwen2_5_vl")
    rename("model.language_model.layers.0.mlp.up_proj.weight")   # "model.layers.0.mlp.up_proj.weight"
    rename("model.visual.blocks.0.attn.qkv.weight")              # "visual.blocks.0.attn.qkv.weight"
"""

from __future__ import annotations

from collections.abc import Callable

# model_type -> (roll's prefix, SGLang's prefix), first match wins.
PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": (("model.language_model.", "model."), ("model.visual.", "visual.")),
}


def sglang_weight_names(model_type: str | None) -> Callable[[str], str]:
    """The renaming of roll's weight names into what SGLang's ``load_weights`` of ``model_type``
    matches (the identity for a model whose loader takes roll's names)."""
    prefixes = PREFIXES.get(model_type or "")
    if not prefixes:
        return _same

    def rename(name: str) -> str:
        for ours, theirs in prefixes:
            if name.startswith(ours):
                return theirs + name[len(ours) :]
        return name

    return rename


def _same(name: str) -> str:
    return name
