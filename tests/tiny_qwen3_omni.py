"""A tiny Qwen3-Omni-MoE (thinker only, as the Thinking edition) saved as a model directory: the
tokenizer of tests/tiny_vl.py plus the audio tokens, a Qwen2-VL image processor with 16-pixel
patches, for the CPU tests and the GPU tests.

    model_dir = build_tiny_qwen3_omni_dir(tmp / "model")   # config, random weights, tokenizer, image processor
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_qwen3_vl import MAX_PIXELS, MIN_PIXELS
from tiny_vl import build_tiny_vl_tokenizer, save_vl_dir, spread_matrices, vision_token_ids
from transformers import Qwen3OmniMoeConfig

AUDIO_TOKENS = ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")
MEL_BINS = 32


def build_tiny_omni_tokenizer():
    """tests/tiny_vl.py's tokenizer with Qwen3-Omni's audio tokens."""
    tok = build_tiny_vl_tokenizer()
    tok.add_tokens(list(AUDIO_TOKENS), special_tokens=True)
    return tok


def tiny_qwen3_omni_config(tok) -> Qwen3OmniMoeConfig:
    """A thinker of 2 MoE decoder layers (4 experts of size 32, top 2; head size 32, interleaved
    mrope over 16 frequencies), a 2-block vision tower whose blocks 0 and 1 feed deepstack, and a
    1-layer audio tower (transformers' 100-frame windows: 13 audio tokens per window)."""
    ids = vision_token_ids(tok)
    text = {
        "vocab_size": len(tok),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [6, 5, 5],
            "interleaved": True,
            "mrope_interleaved": True,
        },
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    vision = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 128,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
    }
    audio = {
        "num_mel_bins": MEL_BINS,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": 128,
        "downsample_hidden_size": 8,
        "max_source_positions": 200,
    }
    thinker = {
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio,
        "image_token_id": ids["image_token_id"],
        "video_token_id": ids["video_token_id"],
        "vision_start_token_id": ids["vision_start_token_id"],
        "audio_token_id": tok.convert_tokens_to_ids("<|audio_pad|>"),
        "audio_start_token_id": tok.convert_tokens_to_ids("<|audio_start|>"),
        "position_id_per_seconds": 13,
    }
    return Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)


def build_tiny_qwen3_omni_dir(path: Path, seed: int = 0, std: float | None = 0.1) -> Path:
    """Random weights (``seed``; every matrix N(0, ``std``)), the tokenizer and a Qwen2-VL image
    processor with 16-pixel patches in ``path``; the checkpoint names the thinker's tensors
    ``thinker.*`` as Qwen's releases do."""
    from transformers import Qwen2VLImageProcessor, Qwen3OmniMoeForConditionalGeneration

    tok = build_tiny_omni_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_qwen3_omni_config(tok))
    spread_matrices(model, std)
    processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=16)
    return save_vl_dir(path, model, tok, processor, False)
