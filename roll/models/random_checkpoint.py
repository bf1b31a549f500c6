"""Hugging Face checkpoints with random weights at real model shapes, for scale runs and benchmarks
on machines without hub access.

A preset holds a published model's ``config.json`` values (layer sizes, heads, experts, vocabulary);
``num_hidden_layers`` may be cut so the same per-layer shapes fit fewer GPUs. The weights are
transformers' own initialisation of that architecture, saved with ``save_pretrained``, so every
loader (HF, Megatron conversion, vLLM) reads the checkpoint as it would read the real one.

    write_random_checkpoint("qwen3-30b-a3b", "output/qwen3-30b-a3b-4l", num_hidden_layers=4,
                            tokenizer_dir="output/default_example/sft_model")
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

from roll.configs.errors import ConfigError
from roll.models.vision import is_vision_config

logger = logging.getLogger("roll")
# Files of a vision-language model's directory besides the tokenizer's that a run reads.
VISION_FILES = ("preprocessor_config.json", "chat_template.json", "video_preprocessor_config.json")


def _qwen3(**sizes: Any) -> dict[str, Any]:
    """What the published Qwen3 config.json files share, with one model's sizes."""
    return dict(
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **sizes,
    )


def _qwen3_moe(**sizes: Any) -> dict[str, Any]:
    """Qwen3-MoE: the Qwen3 values and the routing every released size shares (128 experts, top 8)."""
    return _qwen3(
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **sizes,
    )


def _qwen2_5_vl(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool
) -> tuple[str, dict[str, Any]]:
    """A Qwen2.5-VL preset: the published text sizes, and the vision tower every size shares (32
    blocks of 1280, merged into the text width)."""
    text = dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=128000,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        tie_word_embeddings=tied,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    vision = dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        in_chans=3,
        out_hidden_size=hidden,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        tokens_per_second=2,
    )
    tokens = dict(
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653
    )
    return "Qwen2_5_VLConfig", dict(
        text_config=text, vision_config=vision, **tokens, tie_word_embeddings=tied
    )


def _qwen3_5(
    hidden: int, layers: int, heads: int, value_heads: int, moe: tuple[int, int, int] | None, **sizes: Any
) -> tuple[str, dict[str, Any]]:
    """A Qwen3.5 preset (Qwen/Qwen3.5-27B, -35B-A3B, -122B-A10B, -397B-A17B): what the published
    config.json files share (2 KV heads of 256 but the 27B's 4, 16 linear key heads of 128, every
    4th layer full attention, partial interleaved mrope, the 27-block vision tower of 1152) with one
    model's sizes; ``moe``: (experts, top-k, expert width, the shared expert's the same)."""
    text: dict[str, Any] = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        vocab_size=248320,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=248044,
    )
    text.update(sizes)
    if moe is not None:
        experts, top_k, width = moe
        text.update(
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=width,
            shared_expert_intermediate_size=width,
        )
    vision = dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        in_channels=3,
        out_hidden_size=hidden,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
    )
    tokens = dict(
        image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054
    )
    class_name = "Qwen3_5MoeConfig" if moe is not None else "Qwen3_5Config"
    return class_name, dict(text_config=text, vision_config=vision, **tokens, tie_word_embeddings=False)


def _qwen3_vl(
    text: dict[str, Any], vision: dict[str, Any], tied: bool, moe: bool = False
) -> tuple[str, dict[str, Any]]:
    """A Qwen3-VL preset: the published text sizes (``text``) and tower (``vision``: depth, width,
    MLP width, deepstack blocks); what every size shares (16-pixel patches, interleaved mrope over
    [24, 20, 20] frequencies, 256K positions, the token ids) is filled in here."""
    text = dict(
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=tied,
        bos_token_id=151643,
        eos_token_id=151645,
        **text,
    )
    vision = dict(
        num_heads=16,
        in_channels=3,
        out_hidden_size=text["hidden_size"],
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        hidden_act="gelu_pytorch_tanh",
        **vision,
    )
    tokens = dict(
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653
    )
    name = "Qwen3VLMoeConfig" if moe else "Qwen3VLConfig"
    return name, dict(text_config=text, vision_config=vision, **tokens, tie_word_embeddings=tied)


def _qwen3_omni_moe() -> tuple[str, dict[str, Any]]:
    """Qwen/Qwen3-Omni-30B-A3B-Thinking's config.json: the thinker (Qwen3-VL-30B-A3B's language
    sizes with a 152064 vocab and 64K positions, a 27-block vision tower with deepstack, a 32-layer
    audio tower), no speech output (``enable_audio_output: false``; the talker's and code2wav's
    configs keep transformers' defaults, nothing of them is built). Written without the hub: the
    sizes were not checked against the published file, so treat memory figures for this preset as
    approximate (the layout checks only need the layer, head and expert counts)."""
    text = dict(
        hidden_size=2048,
        intermediate_size=768,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        vocab_size=152064,
        max_position_embeddings=65536,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [24, 20, 20],
            "interleaved": True,
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=2048,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
        # vLLM's thinker reads these (48 x 48 = 2304 positions of 16-pixel patches).
        image_size=768,
        apply_vit_abs_pos_embed=True,
    )
    audio = dict(
        d_model=1280,
        encoder_layers=32,
        encoder_attention_heads=20,
        encoder_ffn_dim=5120,
        num_mel_bins=128,
        output_dim=2048,
        n_window=50,
        n_window_infer=400,
        downsample_hidden_size=480,
        max_source_positions=1500,
    )
    thinker = dict(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        audio_token_id=151675,
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        audio_start_token_id=151669,
        position_id_per_seconds=13,
    )
    return "Qwen3OmniMoeConfig", dict(thinker_config=thinker, enable_audio_output=False)


# Config classes whose whole model no transformers Auto class builds -> the model class.
MODEL_CLASSES = {"Qwen3OmniMoeConfig": "Qwen3OmniMoeForConditionalGeneration"}


# Values of the published config.json files (Qwen/Qwen3-30B-A3B, Qwen/Qwen2.5-7B, ...).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        _qwen3_moe(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
        ),
    ),
    "qwen3-235b-a22b": (
        "Qwen3MoeConfig",
        _qwen3_moe(
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
        ),
    ),
    "qwen3-8b": (
        "Qwen3Config",
        _qwen3(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
    ),
    # Hybrid linear/full attention MoE (Gated DeltaNet; families.py, qwen3_next.py); the published
    # config.json's linear-attention sizes are Qwen3NextConfig's defaults.
    "qwen3-next-80b-a3b": (
        "Qwen3NextConfig",
        dict(
            hidden_size=2048,
            intermediate_size=5120,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            num_experts=512,
            num_experts_per_tok=10,
            vocab_size=151936,
            max_position_embeddings=262144,
            rope_theta=10_000_000.0,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2.5-7b": (
        "Qwen2Config",
        dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2.5-1.5b": (
        "Qwen2Config",
        dict(
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    # Vision-language (roll.models.vision): Qwen/Qwen2.5-VL-3B-Instruct's and -7B-Instruct's
    # config.json (the 7B: ROLL's qwen2.5-vl-7B-rlvr files, Megatron layouts); the text sizes (and
    # num_hidden_layers, token ids) live in text_config.
    "qwen2.5-vl-3b": _qwen2_5_vl(2048, 11008, 36, 16, 2, 151936, tied=True),
    "qwen2.5-vl-7b": _qwen2_5_vl(3584, 18944, 28, 28, 4, 152064, tied=False),
    # Qwen/Qwen3-VL-4B-Thinking's, Qwen/Qwen3-VL-32B-Thinking's and Qwen/Qwen3-VL-30B-A3B-Instruct's
    # config.json (ROLL's qwen3-vl files; the Instruct and Thinking editions share the shapes).
    "qwen3-vl-4b": _qwen3_vl(
        dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
        dict(depth=24, hidden_size=1024, intermediate_size=4096, deepstack_visual_indexes=[5, 11, 17]),
        tied=True,
    ),
    "qwen3-vl-32b": _qwen3_vl(
        dict(
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
            num_key_value_heads=8,
        ),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24]),
        tied=False,
    ),
    "qwen3-vl-30b-a3b": _qwen3_vl(
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,  # vLLM's Qwen3-VL-MoE reads it
        ),
        dict(depth=27, hidden_size=1152, intermediate_size=4304, deepstack_visual_indexes=[8, 16, 24]),
        tied=False,
        moe=True,
    ),
    # Qwen3-Omni-MoE (ROLL's qwen3-omni files): the thinker's text sizes under thinker_config.
    "qwen3-omni-30b-a3b": _qwen3_omni_moe(),
    # Qwen3.5 (ROLL's qwen3.5-* files): Qwen/Qwen3.5-27B, -35B-A3B, -122B-A10B, -397B-A17B.
    "qwen3.5-27b": _qwen3_5(5120, 64, 24, 48, None, intermediate_size=17408, num_key_value_heads=4),
    "qwen3.5-35b-a3b": _qwen3_5(2048, 40, 16, 32, (256, 8, 512)),
    "qwen3.5-122b-a10b": _qwen3_5(3072, 48, 32, 64, (256, 8, 1024)),
    "qwen3.5-397b-a17b": _qwen3_5(4096, 60, 32, 64, (512, 10, 1024)),
    # The Qwen3-MoE architecture at test size (CPU tests of the scale run's code paths).
    "tiny-qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[],
            vocab_size=1024,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        ),
    ),
}


def preset_config(preset: str, num_hidden_layers: int | None = None, **overrides: Any):
    """The preset's transformers config, with ``num_hidden_layers`` and any field overridden."""
    if preset not in PRESETS:
        raise ConfigError("preset", f"unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    class_name, values = PRESETS[preset]
    values = dict(values)
    # A vision-language preset's language sizes are in text_config (Qwen3-Omni's thinker_config's):
    # overrides of those go there.
    outer = values
    if "thinker_config" in values:
        values = dict(values["thinker_config"])
    text = dict(values["text_config"]) if "text_config" in values else values
    for key, value in overrides.items():
        (text if key in text or key.endswith("token_id") else values)[key] = value
    if num_hidden_layers is not None:
        if num_hidden_layers < 1:
            raise ConfigError("num_hidden_layers", f"must be >= 1, got {num_hidden_layers}")
        text["num_hidden_layers"] = num_hidden_layers
    if text is not values:
        values["text_config"] = text
    if outer is not values:
        values = {**outer, "thinker_config": values}
    return getattr(transformers, class_name)(**values)


def write_random_checkpoint(
    preset: str,
    out: str | Path,
    num_hidden_layers: int | None = None,
    tokenizer_dir: str | Path | None = None,
    device: str = "cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    **config_overrides: Any,
) -> Path:
    """Build the preset's model with random weights on ``device`` and save it (and the tokenizer of
    ``tokenizer_dir``, whose special tokens then become the config's) under ``out``;
    ``config_overrides`` replace preset fields (e.g. a smaller ``hidden_size``). A vision-language
    preset needs ``tokenizer_dir`` to be the published model's (its vision tokens, and the
    ``VISION_FILES`` it holds are copied: the image processor's configuration)."""
    out = Path(out)
    overrides: dict[str, Any] = dict(config_overrides)
    tokenizer = None
    if tokenizer_dir is not None:
        from roll.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(str(tokenizer_dir))
        overrides.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    config = preset_config(preset, num_hidden_layers, **overrides)
    torch.manual_seed(seed)
    vision = is_vision_config(config)
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    with torch.device(device):
        if type(config).__name__ in MODEL_CLASSES:  # no Auto class maps it
            model = getattr(transformers, MODEL_CLASSES[type(config).__name__])._from_config(
                config, dtype=dtype
            )
        else:
            model = auto.from_config(config, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    layers = config.get_text_config().num_hidden_layers
    logger.info("%s with %d layers: %.2f B parameters -> %s", preset, layers, params / 1e9, out)
    model.save_pretrained(out, max_shard_size="4GB")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
        if vision:  # the image processor (and the chat template) of the model it came with
            for name in VISION_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out
