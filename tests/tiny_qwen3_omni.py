"""A tiny Qwen3-Omni-MoE (thinker only, as the Thinking edition) saved as a model directory: the
tokenizer of tests/tiny_vl.py plus the audio tokens, a Qwen2-VL image processor with 16-pixel
patches and a 32-bin WhisperFeatureExtractor (one preprocessor_config.json, as Qwen's releases), for
the CPU tests and the GPU tests; ``write_wav`` writes a stand-in audio file with the stdlib.

    model_dir = build_tiny_qwen3_omni_dir(tmp / "model")   # config, random weights, tokenizer, processors
    write_wav(tmp / "a.wav", seconds=1.0)                  # a 16 kHz mono tone, 16-bit PCM
"""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import torch
from tiny_qwen3_vl import MAX_PIXELS, MIN_PIXELS
from tiny_vl import build_tiny_vl_tokenizer, save_vl_dir, spread_matrices, vision_token_ids
from transformers import Qwen3OmniMoeConfig

AUDIO_TOKENS = ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")
MEL_BINS = 32


# The tokenizer attributes Qwen3OmniMoeProcessor reads (what vLLM loads), as Qwen's tokenizer names them.
NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "audio_token": "<|audio_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}


def build_tiny_omni_tokenizer():
    """tests/tiny_vl.py's tokenizer with Qwen3-Omni's audio tokens and their names
    (``tokenizer.audio_token``, ...)."""
    tok = build_tiny_vl_tokenizer()
    tok.add_tokens(list(AUDIO_TOKENS), special_tokens=True)
    specials = {
        k: getattr(tok, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token") if getattr(tok, k)
    }
    return type(tok)(tokenizer_object=tok._tokenizer, extra_special_tokens=NAMED_TOKENS, **specials)


def write_wav(path: Path, seconds: float, rate: int = 16000, pitch: float = 440.0) -> Path:
    """A mono tone of ``seconds`` at ``rate`` (16-bit PCM), written with the stdlib ``wave``."""
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.5 * np.sin(2 * np.pi * pitch * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return path


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
        "tie_word_embeddings": False,  # vLLM's thinker reads it from text_config
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
        # What vLLM's thinker reads instead of num_position_embeddings (the published config carries
        # both): a grid of image_size / patch_size = 8 positions per side, an Embedding like transformers'.
        "image_size": 128,
        "apply_vit_abs_pos_embed": True,
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


def build_tiny_qwen3_omni_dir(
    path: Path, seed: int = 0, std: float | None = 0.1, full_processor: bool = False
) -> Path:
    """Random weights (``seed``; every matrix N(0, ``std``)), the tokenizer, a Qwen2-VL image
    processor with 16-pixel patches and a ``MEL_BINS``-bin WhisperFeatureExtractor in ``path``; the
    checkpoint names the thinker's tensors ``thinker.*`` as Qwen's releases do. ``full_processor``
    also saves ``Qwen3OmniMoeProcessor`` built from these pieces and a Qwen2-VL video processor
    (which needs torchvision), as vLLM loads it."""
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3OmniMoeForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    tok = build_tiny_omni_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_qwen3_omni_config(tok))
    spread_matrices(model, std)
    processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=16)
    save_vl_dir(path, model, tok, processor, False)
    extractor = WhisperFeatureExtractor(feature_size=MEL_BINS)
    if full_processor:
        from transformers import Qwen2VLVideoProcessor, Qwen3OmniMoeProcessor

        video = Qwen2VLVideoProcessor(patch_size=16, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        Qwen3OmniMoeProcessor(processor, video, extractor, tok).save_pretrained(path)
    # one preprocessor_config.json with the image processor's keys and the extractor's (no key in common)
    merged = {**json.loads(processor.to_json_string()), **json.loads(extractor.to_json_string())}
    (path / "preprocessor_config.json").write_text(json.dumps(merged, indent=2))
    return path
