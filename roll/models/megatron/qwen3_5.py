"""Qwen3.5 and Qwen3.5-MoE (HF ``model_type: qwen3_5`` / ``qwen3_5_moe``) on megatron-core:
transformers' vision tower in front of Qwen3-Next's hybrid language model.

What differs from Qwen3-Next (``roll.models.megatron.qwen3_next``), and how roll handles it:

- the Gated DeltaNet input projection is stored as four tensors, ``in_proj_qkv`` ([q; k; v] of all
  heads, like conv1d), ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (each in head order), where
  Qwen3-Next interleaves them per key head in ``in_proj_qkvz`` / ``in_proj_ba``: the weight layout
  ``gdn_in_split`` (``hybrid_layouts``) fuses them into megatron's ``in_proj``;
- rope: multimodal (3-D positions from the image grids, transformers' ``get_rope_index``) with the
  frequencies *interleaved* over the axes (frequency i belongs to height when i % 3 == 1 and
  i < 3 * mrope_section[1], to width when i % 3 == 2 and i < 3 * mrope_section[2], else to time),
  on the first ``partial_rotary_factor`` of each head: ``interleaved_mrope.InterleavedMRoPE``
  (megatron-core 0.16.1's mrope takes contiguous sections only);
- the dense model (Qwen3.5-27B) has a plain SwiGLU MLP in every layer; the MoE model routes every
  layer (softmax, top-k, always renormalised) and adds Qwen3-Next's sigmoid-gated shared expert;
  no ``mlp_only_layers`` / ``decoder_sparse_step``;
- the checkpoint names are transformers 5's module names (``model.language_model.*``,
  ``model.visual.*``, ``lm_head.*``, experts one tensor per expert and projection); the
  multi-token-prediction module (``mtp.*``) is not built: skipped on load with a log line, not
  exported or saved;
- the vision tower (``Qwen3_5VisionModel``: Qwen3-VL's without deepstack) is transformers' own,
  held whole on every rank of the first pipeline stage, as for Qwen2.5-VL (``qwen2_5_vl``); its
  output replaces the image tokens' embeddings. Padded or packed rows (``packed_vision``; context
  parallelism on packed rows); images only (a row with video inputs is refused).

Norms (zero-centred, the gated output norm plain), the output-gated attention with q/k norms and
the layout rules (TP x CP dividing the linear key heads; the Gated DeltaNet layers head-parallel
under context parallelism, ``gdn_context_parallel``) are Qwen3-Next's.

This file holds the config translation (imported by ``families`` without megatron-core);
``qwen3_5_model`` holds the modules.

>>> families.transformer_kwargs(hf_config)   # arch_kwargs: Gated DeltaNet layers, mrope_section
"""

from __future__ import annotations

from typing import Any

from roll.configs.errors import ConfigError
from roll.models.megatron import qwen3_next
from roll.models.megatron.hf_fields import head_dim, rope_parameters

MODEL_PATH = "model_args.model_name_or_path"
SKIPPED_PREFIXES = ("mtp.",)
# transformers' default when config.json's rope_parameters has no mrope_section (Qwen3_5TextRotaryEmbedding).
DEFAULT_MROPE_SECTION = (11, 11, 10)


def _refuse(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(
        MODEL_PATH,
        f"config.json {key}={value!r} is not supported for qwen3_5 by the Megatron strategies: {why}",
    )


def mrope_section(hf: Any) -> list[int]:
    """Frequencies per axis (time, height, width) of the rotary part of a head."""
    return list(rope_parameters(hf).get("mrope_section") or DEFAULT_MROPE_SECTION)


def arch_kwargs(hf: Any) -> dict[str, Any]:
    """TransformerConfig kwargs of the hybrid attention, the zero-centred norms and the rope
    sections; ConfigError naming the config.json key roll does not reproduce."""
    qwen3_next.check_hybrid(hf, "qwen3_5")
    section = mrope_section(hf)
    rotary = int(head_dim(hf) * float(rope_parameters(hf).get("partial_rotary_factor", 1.0)))
    if len(section) != 3 or 2 * sum(section) != rotary:
        raise _refuse(
            "rope_parameters.mrope_section",
            section,
            f"three sections summing to {rotary // 2} rotary frequencies",
        )
    return {**qwen3_next.hybrid_kwargs(hf), "mrope_section": section}


def check_moe(hf: Any) -> None:
    """What Qwen3.5-MoE's layers need of config.json: experts and the gated shared expert."""
    if not getattr(hf, "num_experts", 0):
        raise _refuse("num_experts", getattr(hf, "num_experts", None), "qwen3_5_moe has routed experts")
    if not getattr(hf, "shared_expert_intermediate_size", 0):
        raise _refuse(
            "shared_expert_intermediate_size",
            getattr(hf, "shared_expert_intermediate_size", None),
            "Qwen3.5-MoE's layers have a gated shared expert",
        )
