"""A tiny Qwen2.5-VL saved as a model directory, and generated images with boxes in alibaba/ROLL's
vision-language row layout (Orsta-Data-47k's fields), for the CPU tests and the vLLM GPU test.

    model_dir = build_tiny_vl_dir(tmp / "model")          # config, random weights, tokenizer, image processor
    rows = detection_rows(tmp / "images", 4)              # {"data_source", "images", "prompt", "reward_model"}
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

from roll.models.tiny import build_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
COLORS = {"red box": (220, 30, 30), "blue box": (30, 30, 220)}
# 28 x 28 pixels per merged patch: images of 56 x 56 to 112 x 112 pixels give 4 to 16 image tokens.
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16


def build_tiny_vl_tokenizer():
    texts = [
        "Find every box. <answer>[{'bbox_2d': [100, 200, 300, 400], 'label': 'red box'}]</answer>",
        "How many boxes are there? The answer is \\boxed{2}.",
        "<image>What color is the box? blue red 0123456789",
    ] * 4
    tok = build_tokenizer(texts, vocab_size=400)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    return tok


def tiny_vl_config(tok) -> Qwen2_5_VLConfig:
    text = {
        "vocab_size": len(tok),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},  # head_dim 32 / 2
        "tie_word_embeddings": True,
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
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        **vision_token_ids(tok),
        tie_word_embeddings=True,
    )


def build_tiny_vl_dir(
    path: Path, seed: int = 0, full_processor: bool = False, std: float | None = None
) -> Path:
    """Random weights (``seed``; ``std``: every matrix drawn from N(0, std), so log-probs spread
    out), the tokenizer and a Qwen2-VL image processor in ``path``; ``full_processor`` also loads
    and saves ``AutoProcessor`` (``Qwen2_5_VLProcessor``; its video processor needs torchvision),
    as vLLM loads it. Head size 32 (text and vision), as GPU attention kernels take."""
    from transformers import Qwen2VLImageProcessor  # transformers 5.24 without torchvision: its PIL backend

    tok = build_tiny_vl_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_vl_config(tok))
    spread_matrices(model, std)
    image_processor = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return save_vl_dir(path, model, tok, image_processor, full_processor)


def vision_token_ids(tok) -> dict[str, int]:
    """A VL config's ``image_token_id``, ``video_token_id``, ``vision_start_token_id`` and
    ``vision_end_token_id`` in the tiny tokenizer."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def spread_matrices(model: torch.nn.Module, std: float | None) -> None:
    """Every matrix of ``model`` drawn from N(0, ``std``) (None: as built), so log-probs spread out."""
    if std is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, std)


def save_vl_dir(path: Path, model, tok, image_processor, full_processor: bool) -> Path:
    """Saves a tiny VL ``model`` (generation ids from ``tok``), ``tok`` and ``image_processor`` in
    ``path``; ``full_processor`` also loads and saves ``AutoProcessor`` (its video processor needs
    torchvision), as vLLM loads it."""
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    image_processor.save_pretrained(path)
    if full_processor:  # what vLLM loads: fails here, by name, where it would fail in the engine
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(path).save_pretrained(path)
    return path


def box_image(width: int, height: int, box: list[int], color: tuple[int, int, int]) -> bytes:
    image = Image.new("RGB", (width, height), (240, 240, 240))
    ImageDraw.Draw(image).rectangle(box, fill=color)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def detection_rows(image_dir: Path | None, n: int, as_paths: bool = True) -> list[dict]:
    """Detection rows: one box on a 56..112-pixel image, the ground truth in [0, 1000] coordinates
    (``det_verifier_normalized``), images as files under ``image_dir`` or as bytes."""
    rows = []
    for i in range(n):
        width, height = 56 + 28 * (i % 3), 56 + 14 * (i % 2)
        label = list(COLORS)[i % 2]
        box = [4 + i, 6, width // 2 + i, height // 2]
        data = box_image(width, height, box, COLORS[label])
        if as_paths:
            image_dir.mkdir(parents=True, exist_ok=True)
            (image_dir / f"det{i}.png").write_bytes(data)
            image = {"bytes": None, "path": f"{image_dir.name}/det{i}.png"}
        else:
            image = {"bytes": data, "path": f"det{i}.png"}
        gt = [
            {"bbox_2d": [b * 1000 // s for b, s in zip(box, (width, height, width, height))], "label": label}
        ]
        rows.append(
            {
                "data_source": "v3det_train",
                "images": [image],
                "prompt": [{"role": "user", "content": "<image>Find every box."}],
                "ability": "cv_detection",
                "reward_model": {
                    "ground_truth": f"<answer>{json.dumps(gt)}</answer>",
                    "accuracy_ratio": 1.0,
                    "format_ratio": 0.1,
                    "verifier": "detection",
                    "verifier_parm": {
                        "det_verifier_normalized": True,
                        "det_reward_ratio": {
                            "iou_max_label_first": 1.0,
                            "iou_max_iou_first": 0.0,
                            "iou_completeness": 0.3,
                            "map": 0.0,
                            "map50": 1.0,
                            "map75": 0.0,
                        },  # fmt: skip
                    },
                },
            }
        )
    return rows


def math_rows(image_dir: Path, n: int, tag: str = "mm_math") -> list[dict]:
    """Counting rows: ``k`` boxes on an image, ground truth ``\\boxed{k}``, as ROLL's math rows."""
    rows = []
    image_dir.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        k = 1 + i % 2
        image = Image.new("RGB", (56, 56), (250, 250, 250))
        for j in range(k):
            ImageDraw.Draw(image).rectangle([4 + 20 * j, 4, 16 + 20 * j, 16], fill=(30, 30, 220))
        image.save(image_dir / f"{tag}{i}.png")
        rows.append(
            {
                "data_source": tag,
                "images": [f"{image_dir.name}/{tag}{i}.png"],
                "prompt": [{"role": "user", "content": "<image>How many boxes are there?"}],
                "reward_model": {
                    "ground_truth": f"\\boxed{{{k}}}",
                    "accuracy_ratio": 1.0,
                    "format_ratio": 0.0,
                },
            }
        )
    return rows


# Video-R1 rows: 4 frames of 56 x 56 (2 temporal patches of 2 x 2 merged patches: 8 video tokens).
VIDEO_SIZE, VIDEO_FPS, VIDEO_FRAMES = 56, 4, 8
VIDEO_ARGS = {"video_fps": 2.0, "video_min_pixels": 56 * 56, "video_max_pixels": 56 * 56}


def write_video(
    path: Path, colors: list[tuple[int, int, int]], fps: int = VIDEO_FPS, size: int = VIDEO_SIZE
) -> Path:
    """An MPEG-4 video of one flat color per frame (needs PyAV)."""
    import av
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for color in colors:
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), color, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return path


def video_r1_rows(video_dir: Path, n: int) -> list[dict]:
    """Video-R1 rows (ROLL's video_r1 layout): which color comes first, multiple choice; videos of
    ``VIDEO_FRAMES`` frames at ``VIDEO_FPS`` under ``video_dir``, paths relative to its parent."""
    rows = []
    for i in range(n):
        first, second = list(COLORS.values())[i % 2], list(COLORS.values())[1 - i % 2]
        colors = [first] * (VIDEO_FRAMES // 2) + [second] * (VIDEO_FRAMES // 2)
        write_video(video_dir / f"clip{i}.mp4", colors)
        rows.append(
            {
                "modality_type": "video",
                "problem": "What color comes first? Options:\nA. red\nB. blue\n",
                "solution": f"<answer>{'AB'[i % 2]}</answer>",
                "video": f"{video_dir.name}/clip{i}.mp4",
                "problem_type": "multiple choice",
            }
        )
    return rows
