"""A tiny Qwen3-VL saved as a model directory (the tokenizer of tests/tiny_vl.py, a Qwen2-VL image
processor with Qwen3-VL's 16-pixel patches), for the CPU tests and the GPU tests.

    model_dir = build_tiny_qwen3_vl_dir(tmp / "model")    # config, random weights, tokenizer, image processor
    moe_dir = build_tiny_qwen3_vl_dir(tmp / "moe", moe=True)    # Qwen3-VL-MoE: 4 experts in every layer
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_vl import build_tiny_vl_tokenizer, save_vl_dir, spread_matrices, vision_token_ids
from transformers import AutoModelForImageTextToText, Qwen3VLConfig, Qwen3VLMoeConfig

# 32 x 32 pixels per merged patch: images of 64 x 64 to 128 x 128 pixels give 4 to 16 image tokens.
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 16
# Video-R1 rows (tiny_vl.video_r1_rows: 8 frames at 4 fps): 4 frames of 64 x 64 at 2 fps, 2 temporal
# patches of 2 x 2 merged patches (4 video tokens each), at 0.25 s and 1.5 s (shown "0.2", "1.5").
# SGLang 0.5.16's Qwen3-VL-MoE adds deepstack after 3 decoder layers (roll refuses other counts).
SGLANG_DEEPSTACK = (0, 1, 2)
QWEN3_VIDEO_ARGS = {"video_fps": 2.0, "video_min_pixels": 64 * 64, "video_max_pixels": 64 * 64}


def tiny_qwen3_vl_config(tok, deepstack: tuple[int, ...] = (0, 1)) -> Qwen3VLConfig:
    """4 decoder layers (head size 32, interleaved mrope over 16 frequencies), a 3-block tower whose
    blocks ``deepstack`` (0 and 1) feed deepstack (added after decoder layers 0 and 1)."""
    text = {
        "vocab_size": len(tok),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    vision = {
        "depth": 3,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 128,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": list(deepstack),
    }
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        **vision_token_ids(tok),
        tie_word_embeddings=True,
    )


def tiny_qwen3_vl_moe_config(tok, deepstack: tuple[int, ...] = (0, 1)) -> Qwen3VLMoeConfig:
    """The tiny Qwen3-VL with every decoder layer a MoE layer: 4 experts of size 32, top 2."""
    dense = tiny_qwen3_vl_config(tok, deepstack).to_dict()
    text = {
        **dense["text_config"],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,  # 2I != H: the stacks are not square
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,  # vLLM's Qwen3-VL-MoE reads it (transformers always normalizes)
    }
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return Qwen3VLMoeConfig(
        text_config=text,
        vision_config=dense["vision_config"],
        tie_word_embeddings=True,
        **{k: dense[k] for k in keys},
    )


def build_tiny_qwen3_vl_dir(
    path: Path,
    seed: int = 0,
    std: float | None = None,
    full_processor: bool = False,
    moe: bool = False,
    deepstack: tuple[int, ...] = (0, 1),
) -> Path:
    """Random weights (``seed``; ``std``: every matrix drawn from N(0, std), so log-probs spread
    out), the tokenizer and a Qwen2-VL image processor with 16-pixel patches in ``path``;
    ``full_processor`` also loads and saves ``AutoProcessor`` (``Qwen3VLProcessor``, whose video
    processor needs torchvision), as vLLM loads it. ``deepstack``: the tower blocks that feed
    deepstack (SGLANG_DEEPSTACK for SGLang's Qwen3-VL-MoE, which assumes Qwen's 3)."""
    from transformers import Qwen2VLImageProcessor

    tok = build_tiny_vl_tokenizer()
    torch.manual_seed(seed)
    config = (tiny_qwen3_vl_moe_config if moe else tiny_qwen3_vl_config)(tok, deepstack)
    model = AutoModelForImageTextToText.from_config(config)
    spread_matrices(model, std)
    processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=16)
    return save_vl_dir(path, model, tok, processor, full_processor)


def released_layout(path: Path) -> Path:
    """Rewrite transformers 5's save (the modules' [E, 2I, H] / [E, H, I]) as Qwen's released
    checkpoints store the stacks: transposed. A stack already saved transposed (a transformers whose
    save reverts its load-time transpose) is kept: told apart by where the hidden size H is."""
    import json

    from safetensors.torch import load_file, save_file

    hidden = json.loads((path / "config.json").read_text())["text_config"]["hidden_size"]
    module_dim = {"gate_up_proj": -1, "down_proj": -2}  # where H is in the modules' layout
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, tensor in list(tensors.items()):
        dim = module_dim.get(name.rpartition(".")[2])
        if dim is not None and tensor.shape[dim] == hidden:
            tensors[name] = tensor.transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    return path
