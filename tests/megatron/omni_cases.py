"""What the Qwen3-Omni thinker tests share (CPU and GPU): transformers' thinker, the audio batch
(an audio row, an image row, an image + audio row and a text row through roll's data path, with
random responses) and the thinker's response log-probs of it, as roll scores them.

>>> batch = audio_batch(model, tmp_path)
>>> want = thinker_log_probs(model, batch, torch.bfloat16, "cuda")
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_qwen3_omni import write_wav
from tiny_vl import detection_rows

from roll.core.batch import Batch


def hf_thinker(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """transformers' ``Qwen3OmniMoeThinkerForConditionalGeneration`` of the checkpoint, in eval mode."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=dtype)
    return model.thinker.to(device).eval()


def audio_batch(path: Path, scratch: Path) -> Batch:
    """An audio row, an image row, an image + audio row and a text row (roll's default layout:
    ``audios`` under ``audio_folder``, written to ``scratch``) through roll's data path, left-padded,
    with random responses of 4..6 tokens."""
    from roll.configs.role import DataArgs
    from roll.distributed.strategy.generation import build_generation_batch
    from roll.models.vision import MULTI_MODAL_INPUTS, VisionProcessor
    from roll.pipeline.rlvr.data.dataset import load_prompt_files
    from roll.pipeline.rlvr.data.sampler import to_batch

    (scratch / "audios").mkdir()
    write_wav(scratch / "audios" / "a.wav", 0.37)  # 37 frames: 5 audio tokens
    write_wav(scratch / "audios" / "b.wav", 0.2, pitch=600.0)  # 20 frames: 3 audio tokens
    image = detection_rows(scratch / "images", 1)[0]
    rows = [
        {
            "prompt": [{"role": "user", "content": "<audio>Count the words."}],
            "audios": ["a.wav"],
            "ground_truth": "3",
        },
        image,
        {**image, "prompt": [{"role": "user", "content": "<image><audio>Both?"}], "audios": ["b.wav"]},
        {"prompt": [{"role": "user", "content": "Red?"}], "ground_truth": "red"},
    ]
    (scratch / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = VisionProcessor.load(str(path))
    args = DataArgs(
        file_name=[str(scratch / "rows.jsonl")], messages="prompt", audio_folder=str(scratch / "audios")
    )
    loaded = load_prompt_files(args, processor.tokenizer, 40, "actor_train.data_args", processor)
    assert len(loaded) == 4, loaded.bad_rows + loaded.too_long
    prompts = to_batch(loaded.rows, processor.tokenizer.pad_token_id, 40, processor)
    assert [sorted(r) if r else None for r in prompts[MULTI_MODAL_INPUTS]][::3] == [
        ["feature_attention_mask", "input_features"],
        None,
    ]
    gen = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 300, (6 - i % 3,), generator=gen).tolist() for i in range(4)]
    return build_generation_batch(prompts, responses, None, 1, processor.tokenizer.pad_token_id, 6)


def thinker_log_probs(
    path: Path, batch: Batch, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> torch.Tensor:
    """transformers' thinker's response log-probs [B, R] on CPU (0 at padding), the multimodal tokens
    excluded from responses as roll scores them; each row scored alone (in a left-padded batch,
    transformers scores the image + audio row 3e-3 away from its score alone, which roll matches)."""
    thinker = hf_thinker(path, dtype, device)
    return torch.cat([_row_log_probs(thinker, batch.index([i]), device) for i in range(len(batch))])


def _row_log_probs(thinker, batch: Batch, device: str) -> torch.Tensor:
    from roll.models.vision import exclude_response_tokens, forward_kwargs, response_excluded_tokens

    with torch.no_grad():
        logits = thinker(
            input_ids=batch["input_ids"].to(device),
            attention_mask=batch["attention_mask"].to(device),
            **forward_kwargs(batch, device),
        ).logits.float()
    logits = exclude_response_tokens(logits, response_excluded_tokens(thinker.config))
    width = batch["responses"].shape[1]
    logps = torch.log_softmax(logits[:, -width - 1 : -1], dim=-1)
    logps = logps.gather(-1, batch["responses"].to(device).unsqueeze(-1)).squeeze(-1).cpu()
    return torch.where(batch["response_mask"].bool(), logps, torch.zeros_like(logps))
