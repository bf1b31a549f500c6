"""Tiny Qwen3.5 (dense) and Qwen3.5-MoE model directories for the CPU tests and the GPU tests: the
tiny Qwen2.5-VL's tokenizer and image processor (tests/tiny_vl.py) with a Qwen3.5 config.

    model_dir = build_tiny_qwen3_5_dir(tmp / "model", moe=True, mtp=True)

Every Qwen3.5 feature at a small size: Gated DeltaNet and gated full attention layers (two value
heads per key head), partial rope (half of each 32-wide head) with interleaved sections [3, 3, 2],
zero-centred norms, a vision tower without deepstack (patch 14, as the tiny image processor); the
MoE model 4 experts top-2 with a gated shared expert in every layer; ``mtp`` adds ``mtp.*``
tensors as the published checkpoints carry them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tiny_vl import (
    MAX_PIXELS,
    MIN_PIXELS,
    build_tiny_vl_tokenizer,
    save_vl_dir,
    vision_token_ids,
)
from transformers import AutoModelForImageTextToText

MTP = {"mtp.fc.weight": (64, 128), "mtp.norm.weight": (64,), "mtp.layers.0.input_layernorm.weight": (64,)}


def tiny_qwen3_5_config(tok, moe: bool, linear_head_dims: tuple[int, int] = (8, 12)) -> object:
    """``linear_head_dims``: the Gated DeltaNet key and value head widths (unequal here, so the
    split/fuse code sees both; vLLM's triton kernels take equal ones, as the released models have)."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": linear_head_dims[0],
        "linear_value_head_dim": linear_head_dims[1],
        "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    if moe:
        text |= {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 4}
        text |= {"num_experts_per_tok": 2}
    else:
        text |= {"intermediate_size": 96}
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
    }
    config_class = Qwen3_5MoeConfig if moe else Qwen3_5Config
    return config_class(
        text_config=text,
        vision_config=vision,
        **vision_token_ids(tok),
        tie_word_embeddings=False,
    )


def build_tiny_qwen3_5_dir(
    path: Path,
    moe: bool,
    seed: int = 0,
    std: float = 0.1,
    mtp: bool = False,
    full_processor: bool = False,
    linear_head_dims: tuple[int, int] = (8, 12),
) -> Path:
    """Random weights N(mean, ``std``): zero-centred norms around 0, the gated norm, A_log and
    dt_bias around 1, the rest around 0 (log-probs spread out); tokenizer and image processor;
    ``full_processor`` also saves ``AutoProcessor``'s files (what vLLM loads; needs torchvision)."""
    from transformers import Qwen2VLImageProcessor

    tok = build_tiny_vl_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(
        tiny_qwen3_5_config(tok, moe, linear_head_dims), dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            around_one = name.endswith(("linear_attn.norm.weight", "A_log", "dt_bias"))
            if name.startswith("model.visual.") and param.dim() < 2:
                continue  # the tower's LayerNorms and biases as built
            param.normal_(1.0 if around_one else 0.0, std)
    image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    save_vl_dir(path, model, tok, image_processor, full_processor)
    if mtp:
        tensors = load_file(path / "model.safetensors")
        tensors |= {name: torch.randn(shape) for name, shape in MTP.items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path
