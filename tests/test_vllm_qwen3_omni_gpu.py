"""The ``vllm`` strategy on a tiny Qwen3-Omni-MoE thinker (tests/tiny_qwen3_omni.py: a ``thinker.*``
checkpoint, its processor built locally) on a real vLLM engine on CUDA (skipped without vLLM,
torchvision or a GPU): roll's data path builds image rows, audio rows (wav files under
``audio_folder``) and an image + audio row; vLLM gets one token per image and audio with the PIL
images and the hop-padded 16 kHz waveforms (``engine_vision.vllm_prompts``); the prompt ids vLLM
expands equal roll's row ids (so both count the same audio tokens), and its sampled-token log-probs
equal transformers' thinker (bf16 tolerance, tests/engine_gpu.py; each row's difference is printed
first, by modality) once roll has put vLLM 0.24's image positions right
(roll/distributed/strategy/vllm_omni_positions.py). Then a model update: another
checkpoint's ``thinker.*`` tensors, under the names roll's trainers send, and the engine samples as
transformers does with those weights.

    pytest tests/test_vllm_qwen3_omni_gpu.py -m gpu     # vLLM, torchvision on PYTHONPATH, 1 GPU
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("torchvision")  # Qwen3OmniMoeProcessor's video processor, which vLLM loads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

sys.path.insert(0, str(Path(__file__).parent))
from engine_gpu import assert_close, make_strategy  # noqa: E402
from tiny_qwen3_omni import build_tiny_qwen3_omni_dir, write_wav  # noqa: E402
from tiny_vl import detection_rows  # noqa: E402

from roll.configs.role import DataArgs  # noqa: E402
from roll.core.batch import Batch  # noqa: E402
from roll.core.sampling import SamplingParams  # noqa: E402
from roll.distributed.strategy.engine_vision import vllm_prompts  # noqa: E402
from roll.distributed.strategy.generation import prompt_token_lists  # noqa: E402
from roll.distributed.strategy.vllm_worker_extension import RollWorkerExtension  # noqa: E402
from roll.models.vision import (  # noqa: E402
    VisionProcessor,
    exclude_response_tokens,
    forward_kwargs,
    response_excluded_tokens,
)
from roll.pipeline.rlvr.data.dataset import load_prompt_files  # noqa: E402
from roll.pipeline.rlvr.data.sampler import to_batch  # noqa: E402

PROMPT_LENGTH = 64
MODALITIES = ["image", "audio", "image", "audio", "image+audio"]  # omni_prompts' rows


def print_row_diffs(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, n: int, what: str) -> None:
    """Each output row's mean and max |log-prob difference|, named by its prompt's modality (a GPU
    run then says which modality is off before assert_close fails)."""
    for row in range(len(got)):
        keep = mask[row].bool()
        diff = (got[row].float() - want[row].float()).abs()[keep]
        if diff.numel():
            label = MODALITIES[row // n]
            print(f"{what} row {row} ({label}): mean |diff| {diff.mean():.4f}, max {diff.max():.4f}")


def omni_prompts(root: Path, model: Path) -> Batch:
    """Two image rows, two audio rows (0.5 s and 0.37 s: 7 and 5 audio tokens) and an image + audio
    row, through roll's data path."""
    (root / "audios").mkdir(exist_ok=True)
    write_wav(root / "audios" / "a.wav", 0.5)
    write_wav(root / "audios" / "b.wav", 0.37, pitch=700.0)
    images = detection_rows(root / "images", 2)
    rows = [
        images[0],
        {
            "prompt": [{"role": "user", "content": "<audio>How many words?"}],
            "audios": ["a.wav"],
            "ground_truth": "2",
        },
        images[1],
        {
            "prompt": [{"role": "user", "content": "Say it.<audio>"}],
            "audios": ["b.wav"],
            "ground_truth": "hi",
        },
        {**images[0], "prompt": [{"role": "user", "content": "<image><audio>Both?"}], "audios": ["b.wav"]},
    ]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = VisionProcessor.load(str(model))
    args = DataArgs(
        file_name=[str(root / "rows.jsonl")], messages="prompt", audio_folder=str(root / "audios")
    )
    loaded = load_prompt_files(args, processor.tokenizer, PROMPT_LENGTH, "data_args", processor)
    assert len(loaded) == 5 and not loaded.bad_rows
    return to_batch(loaded.rows, processor.tokenizer.pad_token_id, PROMPT_LENGTH, processor)


def hf_thinker(path: Path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16)
    return model.thinker.cuda().eval()


@torch.no_grad()
def hf_sampled_logprobs(thinker, out: Batch) -> torch.Tensor:
    """transformers' thinker's log-probs of the sampled responses, each row alone (in a left-padded
    batch transformers scores an image + audio row differently from alone; roll's trainers match
    it alone), with the multimodal tokens excluded as roll scores them."""
    excluded = response_excluded_tokens(thinker.config)
    width = out["responses"].shape[1]
    rows = []
    for i in range(len(out)):
        row = out.index([i]).to("cuda")
        logits = thinker(
            input_ids=row["input_ids"], attention_mask=row["attention_mask"], **forward_kwargs(row, "cuda")
        ).logits.float()
        logps = torch.log_softmax(exclude_response_tokens(logits, excluded)[:, -width - 1 : -1], dim=-1)
        logps = logps.gather(-1, row["responses"].unsqueeze(-1)).squeeze(-1)
        rows.append(torch.where(row["response_mask"].bool(), logps, torch.zeros_like(logps)).cpu())
    return torch.cat(rows)


def test_qwen3_omni_generates_with_images_and_audio_and_updates(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = build_tiny_qwen3_omni_dir(tmp_path / "a", seed=0, full_processor=True)
    b = build_tiny_qwen3_omni_dir(tmp_path / "b", seed=1, full_processor=True)
    prompts = omni_prompts(tmp_path, a)
    engine = make_strategy(
        "vllm",
        a,
        gpu_memory_utilization=0.2,
        enforce_eager=True,
        sleep_level=0,
        engine_kwargs={"limit_mm_per_prompt": {"image": 1, "audio": 1, "video": 0}},
    )
    # initialize fixed vLLM 0.24's image positions (vllm_omni_positions): its probe now comes out right
    assert engine.workers.call(RollWorkerExtension.roll_fix_mrope_positions) == ["correct"]
    # the prompt vLLM expands (its thinker's processing counts image and audio tokens) is roll's row
    ids = prompt_token_lists(prompts)
    tokens = engine.vision
    requests = vllm_prompts(prompts, ids, tokens.image, tokens.video, tokens.frames, tokens.audio)
    for row, output in zip(ids, engine.llm.generate(requests, engine._vllm.SamplingParams(max_tokens=1))):
        assert list(output.prompt_token_ids) == list(row)
    params = SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=3)
    out = engine.generate(prompts, params)
    assert torch.equal(out["prompts"][::2], prompts["prompts"]) and out["response_mask"].sum() > 0
    want = hf_sampled_logprobs(hf_thinker(a), out)
    print_row_diffs(out["infer_logprobs"], want, out["response_mask"], params.n, "generate")
    assert_close(
        out["infer_logprobs"], want, out["response_mask"], "Qwen3-Omni generate with images and audio"
    )
    # a model update: b's thinker.* tensors (what roll's trainers send), then b's log-probs
    new = hf_thinker(b)
    before = engine.generate(prompts, params)
    with pytest.raises(AssertionError):  # the old weights do not pass the tolerance
        assert_close(
            before["infer_logprobs"], hf_sampled_logprobs(new, before), before["response_mask"], "old"
        )
    stored = load_file(str(b / "model.safetensors"))
    assert all(name.startswith("thinker.") for name in stored)
    engine.load_weights(iter(stored.items()))
    after = engine.generate(prompts, params)
    print_row_diffs(
        after["infer_logprobs"], hf_sampled_logprobs(new, after), after["response_mask"], params.n, "after"
    )
    assert_close(
        after["infer_logprobs"], hf_sampled_logprobs(new, after), after["response_mask"], "after update"
    )
