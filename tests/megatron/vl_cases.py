"""What the Megatron Qwen2.5-VL tests share: a tiny Qwen2.5-VL checkpoint, a batch of image rows
(and a text row) with random responses, and transformers' response log-probs of it.

>>> model = save_tiny_vl(tmp_path / "model")
>>> batch = vl_batch(model, tmp_path)                 # prompts with images + responses, roll's layout
>>> want = hf_log_probs(model, batch)                 # [B, R] with transformers' 3-D rope positions
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from tiny_vl import build_tiny_vl_dir, detection_rows, math_rows  # noqa: E402

from roll.configs.role import DataArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.distributed.strategy.generation import build_generation_batch  # noqa: E402
from roll.models.vision import (  # noqa: E402
    MULTI_MODAL_INPUTS,
    VisionProcessor,
    exclude_response_tokens,
    forward_kwargs,
    response_excluded_tokens,
)
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH = 48, 8


def save_tiny_vl(path: Path) -> Path:
    """The tiny Qwen2.5-VL (tests/tiny_vl.py) with spread-out weights, so log-probs differ."""
    return build_tiny_vl_dir(path, seed=0, std=0.1)


def vl_batch(model: Path, scratch: Path, seed: int = 0) -> Batch:
    """Two detection rows and one counting row (images of different sizes) and one text row, each
    with a random response of 4..8 tokens and random advantages."""
    processor = VisionProcessor.load(str(model))
    rows = detection_rows(scratch / "images", 2) + math_rows(scratch / "images", 1)
    rows.append(
        {
            "data_source": "text",
            "prompt": [{"role": "user", "content": "What color is red?"}],
            "ground_truth": "red",
        }
    )
    path = scratch / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data_args = DataArgs(file_name=[str(path)], messages="prompt")
    dataset = load_prompt_files(
        data_args, processor.tokenizer, PROMPT_LENGTH, "actor_train.data_args", processor
    )
    prompts = to_batch(dataset.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)
    gen = torch.Generator().manual_seed(seed)
    responses = [
        torch.randint(3, 300, (RESPONSE_LENGTH - i % 5,), generator=gen).tolist() for i in range(len(prompts))
    ]
    out = build_generation_batch(
        prompts, responses, None, 1, processor.tokenizer.pad_token_id, RESPONSE_LENGTH
    )
    out.tensors["advantages"] = torch.randn(len(out), RESPONSE_LENGTH, generator=gen)
    assert sum(1 for r in out[MULTI_MODAL_INPUTS] if r) == 3
    return out


def hf_log_probs(
    model: Path, batch: Batch, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.Tensor:
    """transformers' response log-probs [B, R] (0 at padding), with Qwen2.5-VL's 3-D rope positions
    (``mm_token_type_ids`` makes transformers compute them) and the vision tokens excluded, as
    roll scores responses."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=dtype).to(device).eval()
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    kwargs = forward_kwargs(batch, device)
    token_types = (ids == hf.config.image_token_id).int()
    with torch.no_grad():
        logits = hf(
            input_ids=ids, attention_mask=mask, mm_token_type_ids=token_types, **kwargs
        ).logits.float()
    logits = exclude_response_tokens(logits, response_excluded_tokens(hf.config))  # as roll scores them
    width = batch["responses"].shape[1]
    logps = torch.log_softmax(logits[:, -width - 1 : -1], dim=-1)
    logps = logps.gather(-1, batch["responses"].to(device).unsqueeze(-1)).squeeze(-1).cpu()
    return torch.where(batch["response_mask"].bool(), logps, torch.zeros_like(logps))
